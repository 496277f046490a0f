"""Checkpoints with Orbax: asynchronous saves every N steps, keep the last K, a save on SIGTERM,
and resume from the newest readable checkpoint — onto any mesh.

Layout under ``<workdir>/checkpoints``: one folder per step (``<step>/state``: parameters,
optimizer state, step, RNG as a sharded PyTree; ``<step>/data``: the input position as JSON).
A save in flight lives in a temporary folder that Orbax renames only once complete, so a run
killed mid-save leaves no half-written step behind (the temporary folder is removed at the next
start). A step folder that exists but cannot be read (corrupt, truncated, files missing) is
reported, the previous step is tried, and once an older step restores, the unreadable newer
ones are moved aside to ``<step>.unreadable`` so that training can write that step again.
If no step can be read, the run stops with each step's error rather than start from scratch.

Each step carries ``checksums.sha256`` (sha256sum's format: ``cd <step> && sha256sum -c
checksums.sha256`` checks it by hand): the SHA-256 of every file under its ``state/`` and
``data/``, written by process 0 once the step's files are complete and before Orbax renames
the temporary folder into place (an asynchronous save does it in Orbax's background thread,
off the training loop). A restore checks them first: a file whose bytes changed since the save
(same-size corruption that Orbax and TensorStore read without complaint) makes the step
unreadable, like a truncated one. A step without the file (saved before this existed) is read
unchecked.

A save that fails (a folder that cannot be written, a full disk) raises ``CheckpointSaveError``
(an OSError: one line, exit 1 from the entry points) naming the step and the latest step that
was saved, which stays; Orbax creates each step's folder in the calling thread, so a folder
that cannot be created fails there rather than leave Orbax's background threads waiting for a
signal that never comes (which kept the process from ever exiting).

Before a step is read, its saved parameters are held against config.model's
(``check_params_match``, the one check for resuming and for evaluation): another model is an
error naming the parameters that differ, never a partial or silently reshaped load.
``restore_model_for_eval`` reads only the parameters of one step into a ``HybridLM`` (evaluation,
sampling); ``resolve_step_dir`` finds that step from a step, checkpoints or run folder;
``load_model`` takes either such a path or ``init`` (the config's untrained weights).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from kimi_k3.layers.moe import ZEROED_STATE, ExpertBias
from kimi_k3.model import HybridLM
from kimi_k3.model_state import ModelInit
from kimi_k3.run_dir import absolute_path, find_run_folder
from kimi_k3.trees import path_str


class PreemptionFlag:
    """Set by SIGTERM or SIGINT (Ctrl-C) in a single process: the loop saves after the step in
    flight and stops. A second Ctrl-C stops at once without saving (the previous handler's
    KeyboardInterrupt). Multi-host jobs ask the checkpoint manager instead: JAX's coordination
    service catches SIGTERM and agrees on a step across hosts; Ctrl-C there stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self._event = threading.Event()
        self._previous = {}
        self.received: str | None = None  # "SIGTERM" or "SIGINT (Ctrl-C)", once set
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
        if self._event.is_set():
            if signum == signal.SIGINT:  # a second Ctrl-C: stop now, without saving
                self.restore_handler()
                raise KeyboardInterrupt
            return
        self.received = name
        again = "; Ctrl-C again stops at once without saving" if signum == signal.SIGINT else ""
        logging.warning("%s received: saving a checkpoint after this step, then stopping%s",
                        name, again)
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def restore_handler(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


class CheckpointSaveError(OSError):
    """A checkpoint could not be saved; the message names the step, the cause and the latest
    step on disk."""


class NoReadableCheckpoint(RuntimeError, ValueError):
    """Every saved step failed to restore (a ValueError too, so entry points print one line)."""


def _first_line(e: BaseException, limit: int = 240) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (TensorStore's errors
    run to pages of JSON). The innermost cause is the one that says what is wrong."""
    while e.__cause__ is not None:
        e = e.__cause__
    line = (str(e).strip().splitlines() or [""])[0]
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(e).__name__}: {line}"


def _why(e) -> str:
    """A restore error (an exception, or the text of a failed check) in one line."""
    return e if isinstance(e, str) else _first_line(e)


def _is_read_abort_noise(exc: BaseException | None) -> bool:
    """Errors from TensorStore reads still in flight when a failed restore has already given up
    (their asyncio loop is gone), and from their callbacks at interpreter shutdown."""
    text = str(exc)
    return (isinstance(exc, RuntimeError) and text == "Event loop is closed") or (
        isinstance(exc, ImportError) and "Python is likely shutting down" in text)


class _DropAbortedReads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in str(record.msg)


def silence_aborted_reads() -> None:
    """A restore that fails leaves TensorStore reads behind; each later reports "Event loop is
    closed" through ``sys.unraisablehook`` and asyncio's log, pages of it, burying the real
    error. Drop exactly those; anything else still reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "_kimi_k3", False):
        return

    def hook(unraisable):
        if not _is_read_abort_noise(unraisable.exc_value):
            previous(unraisable)

    hook._kimi_k3 = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_DropAbortedReads())


class _OneLineOrbaxErrors(logging.Filter):
    """Orbax logs each failure of a save with its whole traceback, from several threads: pages
    for one full disk. Keep the first line of each; ``CheckpointSaveError`` says what failed,
    and carries the traceback for --debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" in record.pathname and record.levelno >= logging.ERROR:
            record.msg, record.args = _first_line_of(record.getMessage()), None
            record.exc_info = record.exc_text = None
        return True


def _first_line_of(text: str, limit: int = 300) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def one_line_orbax_errors() -> None:
    """Installs ``_OneLineOrbaxErrors`` on absl's logger (Orbax logs through it), once."""
    lg = logging.getLogger("absl")
    if not any(isinstance(f, _OneLineOrbaxErrors) for f in lg.filters):
        lg.addFilter(_OneLineOrbaxErrors())


# ---------------------------------------------------------------------------------------------
# Checksums: <step>/checksums.sha256
# ---------------------------------------------------------------------------------------------

CHECKSUMS = "checksums.sha256"
_CHUNK = 16 << 20  # bytes read at a time


def _files(folder: epath.Path, prefix: str = "", top: bool = True):
    """(path relative to ``folder``, path) of every file in ``folder``'s subfolders, in name
    order. Not its own files (``top``): in a step folder those are Orbax's records of the step,
    which it rewrites as it commits the step."""
    for p in sorted(folder.iterdir(), key=lambda q: q.name):
        if p.is_dir():
            yield from _files(p, f"{prefix}{p.name}/", top=False)
        elif not top:
            yield prefix + p.name, p


def _sha256(path: epath.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(step_dir) -> None:
    """``<step_dir>/checksums.sha256``: the SHA-256 of every file of the step's items, in
    sha256sum's format, written whole or not at all."""
    step_dir = epath.Path(step_dir)
    lines = [f"{_sha256(p)}  {rel}\n" for rel, p in _files(step_dir)]
    tmp = step_dir / (CHECKSUMS + ".tmp")
    tmp.write_text("".join(lines))
    tmp.rename(step_dir / CHECKSUMS)


def verify_checksums(step_dir) -> str | None:
    """Why ``step_dir``'s files do not match its ``checksums.sha256`` (a file changed or
    missing), or None when they match or the step has no checksums."""
    step_dir = epath.Path(step_dir)
    listing = step_dir / CHECKSUMS
    if not listing.exists():
        logging.info("%s has no %s (saved before checksums were written): read unchecked",
                     step_dir, CHECKSUMS)
        return None
    for n, line in enumerate(listing.read_text().splitlines(), 1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64:
            return f"{CHECKSUMS} line {n} is not '<sha256>  <path>'"
        path = step_dir / rel
        if not path.exists():
            return f"{rel} is missing"
        if _sha256(path) != digest:
            return f"{rel} does not match its checksum (its bytes changed after the save)"
    return None


class Checkpointer:
    """The run's CheckpointManager; ``ckpt_cfg`` is ``config.checkpoint``."""

    def __init__(self, directory: str, ckpt_cfg):
        """``ckpt_cfg``: the checked ``config.checkpoint`` (a CkptSpec: every_steps, keep,
        async_save). Raises CheckpointSaveError when ``directory`` exists but cannot be
        written (before any training, rather than at the first save)."""
        self.directory = epath.Path(absolute_path(directory))
        silence_aborted_reads()
        one_line_orbax_errors()
        self.every_steps = ckpt_cfg.every_steps
        self.set_aside: list[tuple[int, str, str]] = []  # (step, why, moved to) of restore
        self._in_flight: int | None = None  # the step being saved
        self._failed: CheckpointSaveError | None = None
        self._check_writable()
        self._async = is_async = bool(ckpt_cfg.async_save)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=ckpt_cfg.keep,
            enable_async_checkpointing=is_async,
            cleanup_tmp_directories=True,
            create=True,
            # The step's folder made in the caller's thread (a failure raises here, instead of
            # in a background thread while the others wait for it forever); the checksums
            # written in Orbax's background thread once the files are complete.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False,
                                           post_finalization_callback=self._seal_in_flight)
            if is_async else None,
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "data"),
                                                 options=options)
        except OSError as e:
            raise CheckpointSaveError(f"checkpoint.dir {str(self.directory)!r} cannot be "
                                      f"created ({_first_line(e)})") from e

    def _check_writable(self) -> None:
        """A local ``directory`` that exists must take a new folder: probed by making one
        (permission bits say nothing to root, nor of a read-only mount)."""
        path = os.fspath(self.directory)
        if "://" in path or not os.path.isdir(path):
            return
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".kimi_k3_write_probe", dir=path))
        except OSError as e:
            raise CheckpointSaveError(
                f"checkpoint.dir {path!r} is not a folder this process can write ("
                f"{e.strerror or e}); make it writable, or save elsewhere with "
                f"--config.checkpoint.dir") from e

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def should_save(self, step: int) -> bool:
        return step % self.every_steps == 0

    def reached_preemption(self, step: int) -> bool:
        return jax.process_count() > 1 and self.manager.reached_preemption(step)

    def save(self, step: int, state, data_state: dict) -> bool:
        """Start saving step ``step`` (asynchronously unless configured otherwise). The arrays
        are copied to host memory before this returns, so ``state`` may be donated after.
        Raises CheckpointSaveError when this save or the previous one failed."""
        self.wait()  # Orbax would wait too; the previous step's errors are raised as ours
        self._in_flight = step
        try:
            saved = self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        data=ocp.args.JsonSave(data_state)),
                force=True,
            )
            if not self._async and jax.process_index() == 0:
                write_checksums(self.directory / str(step))  # a synchronous save: done
        except Exception as e:  # Orbax, TensorStore and the OS raise many kinds here
            raise self._save_failed(step, e) from e
        return saved

    def _seal_in_flight(self) -> None:
        """Orbax's post-finalisation callback (process 0, its background thread): the step's
        files are complete, its folder not yet renamed into place."""
        step = self._in_flight
        tmp = self.directory / f"{step}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}"
        write_checksums(tmp if tmp.exists() else self.directory / str(step))

    def _save_failed(self, step, e: BaseException) -> CheckpointSaveError:
        """The error for a failed save of ``step``, remembered so ``close`` does not wait for
        that save again."""
        saved = [d.name for d in _step_folders(self.directory)]
        kept = (f"the latest saved step, {saved[0]}, is kept: a rerun resumes from it" if saved
                else "no step was saved before it: a rerun starts from step 0")
        self._failed = CheckpointSaveError(
            f"checkpoint.dir {str(self.directory)!r}: saving step {step} failed "
            f"({_first_line(e)}); {kept}")
        return self._failed

    def wait(self) -> None:
        """Blocks until the save in flight is complete; raises CheckpointSaveError if it
        failed (or an earlier one did)."""
        if self._failed is not None:
            raise self._failed
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:
            raise self._save_failed(self._in_flight, e) from e

    def close(self) -> None:
        """Waits for the save in flight (raising CheckpointSaveError if it failed), then
        closes the manager."""
        try:
            if self._failed is None:
                self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # the failed save again: already raised once
                if self._failed is None:
                    raise

    def restore(self, abstract_state):
        """(step, state, data_state) from the newest readable step, or None if there is none.

        ``abstract_state`` holds ``jax.ShapeDtypeStruct``s with the target shardings, so a
        checkpoint written on one mesh restores onto another.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        errors = []
        for step in steps:
            corrupt = self._verify(step)
            if corrupt is not None:
                logging.error("checkpoint %s is unreadable (%s); trying the previous one",
                              self.directory / str(step), corrupt)
                errors.append((step, corrupt))
                continue
            try:
                saved = saved_params_metadata(self.directory / str(step) / "state")
            except Exception:  # unreadable: the restore below reports it and falls back
                saved = None
            if saved is not None:
                run = run_folder_of(self.directory / str(step))
                own = f" (--config={run})" if run else ""
                check_params_match(saved, abstract_state["params"], self.directory / str(step),
                                   advice=f"Resume with the run's own config{own}, or start a "
                                          f"new --workdir / --config.checkpoint.dir")
            try:
                out = self.manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                            data=ocp.args.JsonRestore()),
                )
            except Exception as e:  # Orbax, TensorStore and the OS raise many kinds here
                logging.error("checkpoint %s is unreadable (%s); trying the previous one",
                              self.directory / str(step), _first_line(e))
                errors.append((step, e))
                continue
            if errors:
                self._set_aside(errors)
            return step, out["state"], dict(out["data"] or {})
        if errors:
            detail = "; ".join(f"step {s}: {_why(e)}" for s, e in errors)
            raise NoReadableCheckpoint(
                f"checkpoint.dir {str(self.directory)!r}: no step could be restored ({detail}). "
                f"Nothing was moved or deleted; to start afresh, use a new --workdir"
            )
        return None

    def _verify(self, step: int) -> str | None:
        """Why step ``step`` fails its checksums, or None (``verify_checksums``): read by
        process 0, its verdict given to every process."""
        why = verify_checksums(self.directory / str(step)) if jax.process_index() == 0 else None
        if jax.process_count() > 1:
            bad = multihost_utils.broadcast_one_to_all(jnp.int32(why is not None))
            if bool(bad) and why is None:
                why = "its files do not match their checksums (checked by process 0)"
        return why

    def _set_aside(self, errors) -> None:
        """Moves each unreadable step of ``errors`` ((step, why), ...) to
        ``<step>.unreadable``, recorded in ``set_aside``."""
        for s, e in errors:
            dst = self.directory / f"{s}.unreadable"
            n = 1
            while dst.exists():
                dst, n = self.directory / f"{s}.unreadable{n}", n + 1
            self.set_aside.append((s, _why(e), os.fspath(dst)))
            src = self.directory / str(s)
            if jax.process_index() == 0 and src.exists():
                os.rename(os.fspath(src), os.fspath(dst))
                logging.warning("moved unreadable checkpoint %s to %s", src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("kimi_k3_checkpoint_set_aside")
        self.manager.reload()


class NoCheckpoints:
    """``checkpoint.enabled = False``: the Checkpointer's interface, saving and restoring nothing
    (benchmarks and throwaway runs, where writing the state would only cost time)."""

    set_aside = ()

    def latest_step(self) -> None:
        return None

    def should_save(self, step: int) -> bool:
        return False

    def reached_preemption(self, step: int) -> bool:
        return False

    def save(self, step: int, state, data_state: dict) -> bool:
        return False

    def restore(self, abstract_state) -> None:
        return None

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# The saved parameters against a model's: one check for resuming a run and for reading a model
# ---------------------------------------------------------------------------------------------


def saved_params_metadata(state_dir):
    """The ``"params"`` subtree of the metadata saved in a step's ``state`` folder: the saved
    parameters' paths, shapes and dtypes, no array read. Raises what Orbax raises for a folder
    it cannot read, and KeyError when the state holds no "params"."""
    meta = ocp.PyTreeCheckpointer().metadata(epath.Path(state_dir))
    tree = getattr(meta, "item_metadata", meta)  # Orbax versions nest the tree differently
    return getattr(tree, "tree", tree)["params"]


def _shapes(tree) -> dict[str, tuple]:
    """'embed/embedding' -> shape, for every leaf of a parameter tree (arrays,
    ``jax.ShapeDtypeStruct``s or Orbax metadata alike)."""
    return {path_str(k): tuple(x.shape) for k, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_params_match(saved_params, model_params, step_dir: str | os.PathLike, advice: str) -> None:
    """Raise ValueError unless ``saved_params`` (a checkpoint's, e.g. from
    ``saved_params_metadata``) and ``model_params`` (config.model's, abstract or real) have the
    same paths with the same shapes.

    The message names ``step_dir`` and the first few parameters of each kind of difference
    (another shape, missing from the checkpoint, not in config.model), then ``advice``: what
    the caller's user should do about it.
    """
    saved, model = _shapes(saved_params), _shapes(model_params)
    shapes = [k for k in model if k in saved and saved[k] != model[k]]
    missing = [k for k in model if k not in saved]
    extra = [k for k in saved if k not in model]
    if not (shapes or missing or extra):
        return
    shown = 3  # of each kind: enough to see the pattern (a width, a layer kind) without pages
    items = [f"{k}: checkpoint {saved[k]} vs config {model[k]}" for k in shapes[:shown]]
    items += [f"{k} {model[k]}: in config.model, not in the checkpoint" for k in missing[:shown]]
    items += [f"{k} {saved[k]}: in the checkpoint, not in config.model" for k in extra[:shown]]
    more = len(shapes) + len(missing) + len(extra) - len(items)
    # The first shape difference also in the trainer's older "checkpoint S, config E" wording,
    # which scripts and tests match, beside eval's "checkpoint S vs config E".
    first = f" (the first: checkpoint {saved[shapes[0]]}, config {model[shapes[0]]})" if shapes else ""
    counts = (f"{len(shapes)} parameters differ in shape{first}, {len(missing)} are missing from "
              f"the checkpoint, {len(extra)} are not in config.model")
    raise ValueError(
        f"checkpoint {str(step_dir)!r} does not match config.model: {counts}: "
        + "; ".join(items) + (f"; and {more} more" if more else "") + f". {advice}"
    )


# ---------------------------------------------------------------------------------------------
# Reading a checkpoint's parameters outside training (evaluation, sampling)
# ---------------------------------------------------------------------------------------------


def _step_folders(directory: epath.Path) -> list[epath.Path]:
    """The step folders (named by their step, holding ``state/``) in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    steps = [d for d in directory.iterdir() if d.name.isdigit() and (d / "state").is_dir()]
    return sorted(steps, key=lambda d: int(d.name), reverse=True)


def resolve_step_dir(path: str) -> tuple[str, int]:
    """(step folder, step) for a step folder (``<run>/checkpoints/<step>``, with ``state/``
    inside), a checkpoints folder (its newest step) or a run folder (the newest step of its
    ``checkpoints/``).

    Errors name ``--checkpoint``, the flag eval.py reads the path from: FileNotFoundError when
    ``path`` does not exist or holds no step, ValueError for a step folder not named by its step.
    """
    p = epath.Path(path)  # local or a URL (gs://...), as the trainer writes them
    if not p.exists():
        raise FileNotFoundError(f"--checkpoint: {path!r} does not exist")
    if (p / "state").is_dir():
        if not p.name.isdigit():
            raise ValueError(f"--checkpoint: {path!r} holds a state/ folder but is not named by its step")
        return path, int(p.name)
    for directory in (p, p / "checkpoints"):
        found = _step_folders(directory)
        if found:
            return os.fspath(found[0]), int(found[0].name)
    raise FileNotFoundError(
        f"--checkpoint: {path!r} is not a checkpoint step folder (<run>/checkpoints/<step> with a "
        f"state/ inside), a checkpoints folder or a run folder holding one"
    )


def run_folder_of(step_dir) -> str | None:
    """The run folder a step folder belongs to (``<run>/checkpoints/<step>``) when it holds the
    run's config file (``run_dir.write_config``), else None."""
    run = os.path.dirname(os.path.dirname(os.path.normpath(os.fspath(step_dir))))
    return find_run_folder(run) if run else None


def restore_model_for_eval(config, path: str, config_name: str = "--config",
                           give_config=lambda run: f"--config={run}") -> tuple[HybridLM, int]:
    """(a ``HybridLM`` for ``config.model`` holding the parameters saved at ``path``, its step),
    on the first device.

    ``path``: anything ``resolve_step_dir`` takes (a step, checkpoints or run folder). The
    step's checksums are checked first (``verify_checksums``: a ValueError names a file that
    changed since the save). Only the parameters are read (an Orbax partial restore of
    ``<step>/state``'s "params"); the optimizer state never is. They are checked against
    config.model first (``check_params_match``); the error names ``config_name``, where
    ``config`` came from, and, when the run folder holds its own config, the command-line words
    that pass it (``give_config(run_folder)``: the caller's flag, ``--config=RUN`` by default).
    A mixture of experts' routing biases are read with them; the rest of the model's
    non-parameter state comes from ``config.seed``, as in training.
    """
    step_dir, step = resolve_step_dir(path)
    corrupt = verify_checksums(absolute_path(step_dir))
    if corrupt is not None:
        raise ValueError(f"--checkpoint {path!r}: step {step} ({step_dir}) is corrupted: "
                         f"{corrupt}; read an earlier step (--checkpoint=<its step folder>)")
    state_dir = os.path.join(absolute_path(step_dir), "state")  # Orbax refuses relative paths
    graphdef, abs_params, abs_biases, abs_rest = nnx.split(abstract_model(config), nnx.Param,
                                                           ExpertBias, ...)
    want = nnx.to_pure_dict(abs_params)

    try:
        saved = saved_params_metadata(state_dir)
    except Exception as e:  # Orbax raises several kinds for a folder it cannot read
        raise ValueError(f"--checkpoint {path!r}: cannot read parameters from {state_dir!r} "
                         f"({_first_line(e, 300)})") from e
    run = run_folder_of(step_dir)
    check_params_match(saved, want, step_dir, advice=(
        f"config.model came from {config_name}; pass the config the checkpoint was trained with"
        + (f": {give_config(run)}" if run else "")))

    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    on_device = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
    item = {"params": on_device(want)}
    if jax.tree.leaves(abs_biases):  # a mixture of experts routes with its trained biases
        item["model_state"] = on_device(nnx.to_pure_dict(abs_biases))
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=device, dtype=x.dtype), item)
    out = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
    nnx.replace_by_pure_dict(abs_params, out["params"])
    if "model_state" in item:
        nnx.replace_by_pure_dict(abs_biases, out["model_state"])
    # The rest: measurements a forward pass overwrites and empty gradient sums (zeros will
    # do), anything else as the initialiser makes it.
    abs_stats, abs_other = nnx.split_state(abs_rest, ZEROED_STATE, ...)
    stats = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=device), abs_stats)
    other = (jax.jit(lambda: nnx.split(_fresh_model(config), nnx.Param, ExpertBias, ZEROED_STATE,
                                       ...)[4])()
             if jax.tree.leaves(abs_other) else abs_other)
    return nnx.merge(graphdef, abs_params, abs_biases, stats, other), step


INIT_CHECKPOINT = "init"  # --checkpoint=init: the config's freshly initialised weights


def _seed(config) -> int:
    """The seed a config's fresh weights come from (``config.seed``, 0 if unset)."""
    return int(config.get("seed", 0))


def _fresh_model(config) -> HybridLM:
    """``config.model`` initialised from ``config.seed``: what a restore fills."""
    return HybridLM(config.model, rngs=nnx.Rngs(_seed(config)))


def abstract_model(config) -> HybridLM:
    """The model ``load_model`` gives for ``config``, as shapes and dtypes only
    (``nnx.eval_shape``): a program can be compiled for it before the weights load."""
    return nnx.eval_shape(lambda: _fresh_model(config))


@dataclasses.dataclass(frozen=True)
class PendingModel:
    """``load_model``'s work in two steps: ``make_abstract()`` gives the model as shapes and
    dtypes (for ``init``, from the initialiser's trace, already done; for a checkpoint, an
    ``nnx.eval_shape``), ``load()`` gives (model, step)."""

    make_abstract: Callable[[], HybridLM]
    load: Callable[[], tuple[HybridLM, int | None]]


def pending_model(config, checkpoint: str, config_name: str = "--config",
                  give_config=lambda run: f"--config={run}") -> PendingModel:
    """``load_model(config, checkpoint, ...)`` as a PendingModel: a caller compiles programs for
    the abstract model while ``load()`` reads the checkpoint or runs the initialiser. For
    ``init`` the initialiser is traced here, once for both."""
    if checkpoint == INIT_CHECKPOINT:
        init = ModelInit(config.model, _seed(config))
        return PendingModel(lambda: init.abstract, lambda: (init.run(), None))
    return PendingModel(lambda: abstract_model(config),
                        lambda: restore_model_for_eval(config, checkpoint,
                                                       config_name=config_name,
                                                       give_config=give_config))


def load_model(config, checkpoint: str, config_name: str = "--config",
               give_config=lambda run: f"--config={run}") -> tuple[HybridLM, int | None]:
    """(a ``HybridLM`` for ``config.model``, its step) with the weights of ``checkpoint``: a step,
    checkpoints or run folder (``restore_model_for_eval``), or ``init`` for the weights
    ``config.seed`` initialises (step None).

    Raises FileNotFoundError naming a missing path, ValueError naming the parameters where
    ``config`` (from ``config_name``) and the checkpoint disagree.
    """
    return pending_model(config, checkpoint, config_name, give_config).load()
