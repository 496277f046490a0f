"""The entry points' command line: a bad flag or config is one line, a run folder is a config,
and every ending has its exit code.

    from kimi_k3 import cli
    if __name__ == "__main__":
        cli.run(main)            # train.py, eval.py, generate.py: absl's app.run, plus the below

Before absl parses the flags, ``--config`` and its ``--config.<field>=value`` overrides are
checked here, so each mistake is named in one line: a config path that does not exist, a run
folder with no config in it, a field that does not exist (with the nearest field names).
``--config=RUN`` (a run folder) and ``--config=RUN/config.json`` both mean the run's own
config, ``RUN/config.py`` (``run_dir.write_config`` writes it beside its JSON record).

While ``main`` runs, errors end the process with one line on stderr and an exit code
(``kimi_k3.runtime``): a ConfigError (a field out of range) 2, like a flag error; a ValueError
or OSError (bad input, a failed save) and FloatingPointError (a non-finite step) 1;
``runtime.Interrupted`` (a signal, after saving) and Ctrl-C 75. ``--debug`` (or
``KIMI_K3_DEBUG=1``) prints the traceback too.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from collections.abc import Callable, Sequence

import ml_collections
from absl import app, flags, logging

from kimi_k3 import compile_cache
from kimi_k3 import mesh as mesh_lib
from kimi_k3.config import ConfigError
from kimi_k3.config_files import load_config
from kimi_k3.run_dir import find_run_folder
from kimi_k3.runtime import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Interrupted,
    exit_if_stuck,
    exit_without_teardown,
)

DEBUG_ENV = "KIMI_K3_DEBUG"
RUN_CONFIG = "config.py"  # what a run folder holds as its config (run_dir.write_config)


def debug_requested(argv: Sequence[str]) -> bool:
    """``--debug`` among the arguments, or KIMI_K3_DEBUG set to a true value."""
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes")


def fail(code: int, message: str, program: str | None = None) -> None:
    """Ends the process with ``message`` as one line on stderr."""
    program = program or os.path.basename(sys.argv[0] or "kimi_k3")
    hint = f" (--debug or {DEBUG_ENV}=1 for the traceback)" if code == EXIT_FAILED else ""
    print(f"{program}: error: {message}{hint}" if code != EXIT_INTERRUPTED
          else f"{program}: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def one_line(err: BaseException) -> str:
    """The part of an exception a user acts on: its message on one line, at most about 1000
    characters (the start and the end kept); the innermost cause's where a wrapper says
    nothing."""
    while err.__cause__ is not None and not str(err).strip():
        err = err.__cause__
    text = str(err).strip() or type(err).__name__
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # repr()'d by its raiser
        text = text[1:-1]
    line = " ".join(text.replace("\\n", "\n").split())
    # keep both ends: errors name what is wrong first and end with what to do
    return line if len(line) <= 1000 else line[:590] + " [...] " + line[-400:]


# ---------------------------------------------------------------------------------------------
# --config and its overrides
# ---------------------------------------------------------------------------------------------


def resolve_config_path(spec: str) -> str:
    """``--config``'s value with a run folder (or its config.json record) turned into the run's
    ``config.py``. Raises ConfigError naming ``--config`` when nothing loadable is there."""
    path, sep, arg = spec.partition(":")
    given = path
    if os.path.isdir(path) or os.path.basename(path) == "config.json":
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        path = os.path.join(folder, RUN_CONFIG)
        if not os.path.isfile(path):
            raise ConfigError(f"--config: {given!r} holds no {RUN_CONFIG} (a run folder gets one "
                              f"when train.py starts; for another folder give a config file "
                              f"such as --config=configs/tiny.py)")
    elif not os.path.isfile(path):
        where = "" if os.path.isabs(path) else f" (from {os.getcwd()})"
        raise ConfigError(f"--config: no config file {given!r}{where}; give a config file such "
                          f"as --config=configs/tiny.py, or a run folder (--config=runs/NAME)")
    return path + sep + arg


def _field_error(config, dotted: str) -> str | None:
    """Why ``--config.<dotted>`` names no field of ``config`` (None: it does)."""
    node, walked = config, "config"
    for part in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            return f"{walked} is a value ({node!r}), not a section with fields"
        if part not in node:
            near = difflib.get_close_matches(part, list(node.keys()), n=3, cutoff=0.6)
            hint = (f"; did you mean {', '.join(f'--{walked}.{n}' for n in near)}?" if near
                    else f"; its fields: {', '.join(sorted(node.keys()))}")
            return f"{walked} has no field {part!r}{hint}"
        node, walked = node[part], f"{walked}.{part}"
    return None


def _flag_value(argv: Sequence[str], name: str) -> str | None:
    """The last ``--name=value`` of ``argv`` (None: not given)."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def run_folder_from(argv: Sequence[str], config_from: Sequence[str]) -> tuple[str, str] | None:
    """(flag, run folder) of the first flag in ``config_from`` whose value lies in a run folder
    holding its own config: ``--checkpoint=[LABEL=]PATH[@CONFIG]`` or ``--workdir=RUN``."""
    for name in config_from:
        value = _flag_value(argv, name)
        if value is None:
            continue
        path = value.partition("@")[0]
        if name == "checkpoint" and "=" in path:  # LABEL=PATH
            path = path.split("=", 1)[1]
        run = find_run_folder(path) if path else None
        if run:
            return name, run
    return None


def override_fields(argv: Sequence[str], flag: str = "config") -> list[str]:
    """The dotted fields that ``--config.<field>=value`` arguments override, in order."""
    return [a[len(flag) + 3:].split("=", 1)[0] for a in argv if a.startswith(f"--{flag}.")]


def check_config_args(argv: Sequence[str], flag: str = "config",
                      config_from: Sequence[str] = ()) -> list[str]:
    """``argv`` with ``--config`` resolved (run folders) and every ``--config.x.y=v`` override
    checked against the loaded config. Without ``--config``, the run folder named by the first
    of the ``config_from`` flags gives its own config (a line on stderr says so, with the
    overrides applied on top). Raises ConfigError naming the first bad argument."""
    out, spec = list(argv), None
    overrides = [a for a in argv if a.startswith(f"--{flag}.")]
    if _flag_value(argv, flag) is None and config_from:
        found = run_folder_from(argv, config_from)
        if found is None:
            raise ConfigError(
                f"--{flag}: not given, and no --{' or --'.join(config_from)} names a run folder "
                f"with its own config; give --{flag}=configs/x.py, or a run folder "
                f"(--{flag}=runs/NAME)")
        source, run = found
        out.insert(1, f"--{flag}={run}")
        said = f"; overrides: {' '.join(overrides)}" if overrides else ""
        print(f"{os.path.basename(out[0] or 'kimi_k3')}: --{flag}={run} (the run's own config, "
              f"from --{source}){said}", file=sys.stderr, flush=True)
        argv = out
    for i, a in enumerate(argv):
        if a.startswith(f"--{flag}="):
            spec = resolve_config_path(a.split("=", 1)[1])
            out[i] = f"--{flag}={spec}"
    if spec is None or not overrides:
        return out
    try:
        config = load_config(spec)
    except ConfigError:
        raise
    except Exception as e:  # the config file's own error: named with its flag
        raise ConfigError(f"--{flag}={spec}: {one_line(e)}") from e
    for a in overrides:
        dotted = a[len(f"--{flag}."):].split("=", 1)[0]
        why = _field_error(config, dotted)
        if why:
            raise ConfigError(f"--{flag}.{dotted}: {why}")
    return out


# ---------------------------------------------------------------------------------------------
# What the entry points share: flags and the opening of ``main``
# ---------------------------------------------------------------------------------------------

# A flag defined by a function here belongs to the entry point that calls it, as if defined
# there: absl's --help lists the main module's own flags only.
flags.disclaim_key_flags()


@dataclasses.dataclass(frozen=True)
class MultihostFlags:
    """--multihost, --coordinator_address, --num_processes, --process_id (``define_multihost_flags``)."""

    multihost: flags.FlagHolder
    coordinator_address: flags.FlagHolder
    num_processes: flags.FlagHolder
    process_id: flags.FlagHolder

    def initialize(self) -> bool:
        """Joins the processes the flags describe (``mesh.initialize_distributed``); True when
        it did."""
        return mesh_lib.initialize_distributed(self.coordinator_address.value,
                                               self.num_processes.value, self.process_id.value,
                                               force=self.multihost.value)


def define_multihost_flags() -> MultihostFlags:
    """The flags of a multi-host entry point (train.py, eval.py), defined as its own."""
    return MultihostFlags(
        flags.DEFINE_bool("multihost", False,
                          "Call jax.distributed.initialize() and let JAX detect the cluster."),
        flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (multi-host)."),
        flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host)."),
        flags.DEFINE_integer("process_id", None, "This process's index (multi-host)."))


def validate_with(flag: str, parse: Callable[[Sequence[str]], object]) -> None:
    """Registers ``parse`` as the validator of list flag ``flag``: the ValueError it raises on a
    bad item (naming the flag and the item) becomes absl's one-line flag error."""

    def check(values) -> bool:
        try:
            parse(values)
        except ValueError as err:
            raise flags.ValidationError(str(err)) from err
        return True

    flags.register_validator(flag, check)


def start(argv: Sequence[str], compilation_cache: str) -> None:
    """The opening of an entry point's ``main``: stray arguments are a usage error; library
    logs at WARNING unless --verbosity is given (the command prints its own lines; -v 0 for
    library logs); JAX's compilation cache in ``compilation_cache`` (``compile_cache.enable``)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    compile_cache.enable(compilation_cache)


# ---------------------------------------------------------------------------------------------
# Running an entry point
# ---------------------------------------------------------------------------------------------


def parse_flags(argv: list[str], config_from: Sequence[str] = ()) -> list[str]:
    """absl's flag parsing after ``check_config_args``; any error is one line and exit 2."""
    if debug_requested(argv):
        argv = [a for a in argv if a != "--debug"]
        return flags.FLAGS(check_config_args(argv, config_from=config_from))
    try:
        return flags.FLAGS(check_config_args(argv, config_from=config_from))
    except Exception as e:  # a flag, a config file or a field: all usage errors
        fail(EXIT_USAGE, one_line(e))
    raise AssertionError("unreachable")


def ending(err: BaseException) -> tuple[int, str | None]:
    """(exit code, the one line to print) for an error that ends an entry point; None: let it
    raise (its traceback is the message: an unexpected error, or absl's own exits)."""
    if isinstance(err, SystemExit):
        return (err.code if isinstance(err.code, int) else EXIT_FAILED), None
    if isinstance(err, Interrupted):
        return EXIT_INTERRUPTED, str(err)
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted (Ctrl-C); run the same command again to resume"
    if isinstance(err, ConfigError):
        return EXIT_USAGE, one_line(err)
    if isinstance(err, ValueError | OSError | FloatingPointError):
        return EXIT_FAILED, one_line(err)
    return EXIT_FAILED, None


def guarded(main: Callable, debug: Callable[[], bool] = lambda: debug_requested(sys.argv),
            process: bool = False, skip_teardown: bool = False):
    """``main`` with the module docstring's endings: one line and an exit code per error.
    ``process``: ``main`` is the whole process (an entry point's ``__main__``), which must end
    even when a library's thread would keep it alive (``runtime.exit_if_stuck``); never in a
    process that goes on (a test calling ``main``). ``skip_teardown`` (with ``process``): a
    ``main`` that returns ends the process at once (``runtime.exit_without_teardown``)."""

    def run_main(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
        except BaseException as e:  # the process ends now: it must, even if a thread hangs
            code, message = ending(e)
            if process:
                exit_if_stuck(code)
            if message is None or (code != EXIT_INTERRUPTED and debug()):
                raise
            fail(code, message)
        if process and skip_teardown and result is None:
            exit_without_teardown(0)
        return result

    return run_main


def run(main: Callable[[list[str]], None], config_from: Sequence[str] = (),
        skip_teardown: bool = False) -> None:
    """``app.run(main)`` with ``parse_flags`` and ``guarded``. ``config_from``: the flags whose
    run folder gives ``--config`` when it is not given (``check_config_args``).
    ``skip_teardown``: once ``main`` returns, the process ends without the interpreter's
    teardown (``runtime.exit_without_teardown``), for an entry point that has closed its
    files."""
    app.run(guarded(main, process=True, skip_teardown=skip_teardown),
            flags_parser=lambda argv: parse_flags(argv, config_from=config_from))
