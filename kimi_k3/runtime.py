"""What every entry point sets up the same way: library logs, console lines, compiler options
for programs that run once, and the device's memory.

The trainer and the readers (evaluation, generation, passkey, the Hugging Face commands) use
these; none of them owns them.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time

import jax

# XLA's LLVM backend without its optimisations, for programs compiled once and run once or not
# at all: the jitted initialisers and the micro-batch estimate, whose compile takes far longer
# than their run. Only the code generated for each kernel changes, not the HLO program or its
# buffers, so the weights come out bit for bit the same and a memory estimate's scratch too
# (benchmarks/init_compile.py --options measures both).
RUN_ONCE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                             "xla_llvm_disable_expensive_passes": True}


@contextlib.contextmanager
def jax_setting(name: str, value):
    """``jax.config``'s ``name`` set to ``value`` inside, as it was after (an exception too)."""
    before = jax.config.values[name]
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


def run_once_compiler_options(platform: str) -> dict | None:
    """``compiler_options`` for a run-once program on ``platform`` (a device's ``.platform``):
    RUN_ONCE_COMPILER_OPTIONS where XLA generates code through LLVM (CPU, GPU), None (XLA's
    defaults) on a TPU."""
    return RUN_ONCE_COMPILER_OPTIONS if platform in ("cpu", "gpu", "cuda", "rocm") else None


class _QuietCheckpointLogs(logging.Filter):
    """Orbax reports every save in a dozen INFO lines; keep its warnings and errors only, less
    the one it gives whenever a step's item metadata is read on its own (harmless)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname:
            return True
        return record.levelno >= logging.WARNING and not str(record.msg).startswith(
            ("Metadata file does not exist", "Failed to get item metadata"))


def process_seconds() -> float | None:
    """Seconds since this process started (from Linux's /proc: imports, the backend's start and
    flag parsing included), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            # the fields after the command's closing parenthesis start at field 3; 22 is the start
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def quiet_library_logs() -> None:
    """Orbax's INFO lines off (its warnings stay), once per process however often called."""
    for name in ("absl", "orbax"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _QuietCheckpointLogs) for f in lg.filters):
            lg.addFilter(_QuietCheckpointLogs())


def console(message: str) -> None:
    """A plain line on stderr (process 0 only): summaries people read, without log prefixes."""
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def device_memory_bytes() -> int | None:
    """The allocator's limit on the first local device, or None where the backend keeps no
    statistics (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


# How a command ends (the README's reliability section). A scheduler requeues on
# EXIT_INTERRUPTED; `train.py && eval.py` stops on anything but 0.
EXIT_OK = 0
EXIT_FAILED = 1  # an error while running: bad data, a failed save, a non-finite step (stop)
EXIT_USAGE = 2  # a bad flag, config file or config field: nothing was run
EXIT_INTERRUPTED = 75  # stopped by a signal after saving (sysexits' EX_TEMPFAIL): rerun to resume


class Interrupted(Exception):
    """A run stopped early on request (SIGINT, SIGTERM, a preemption notice) after saving what
    it had: the message says where it stopped and how to go on."""


def exit_without_teardown(code: int = 0) -> None:
    """End the process now with ``code`` once its work is done: the ``atexit`` handlers run
    (logging, libraries' own shutdown), standard output and error are flushed, and then the
    interpreter's teardown is skipped. Unloading JAX, XLA and the hundreds of modules behind
    them, and running the device client's destructors, takes a visible part of a second that a
    finished command should not make its user wait for; the operating system frees the memory
    and the device anyway. Only for an entry point whose files are all closed by then (eval.py
    writes its files in ``with`` blocks; generate.py prints): a file left open would lose what
    Python still buffers for it."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say there
            pass
    os._exit(code)


def exit_if_stuck(code: int, seconds: float = 30.0) -> None:
    """For a process ending on an error: if it is still alive ``seconds`` later (a library's
    non-daemon thread waiting for something that will never come, as Orbax's did after a failed
    save), end it with ``code`` rather than hang. A daemon thread, so a process that ends in
    time never sees it; for entry points only (``kimi_k3.cli`` starts it), never a library or
    a test process."""

    def watch():
        time.sleep(seconds)
        print(f"{os.path.basename(sys.argv[0] or 'kimi_k3')}: still running {seconds:g} s after "
              f"the error above (background threads did not end); exiting with {code}",
              file=sys.stderr, flush=True)
        os._exit(code)

    threading.Thread(target=watch, name="kimi_k3_exit_if_stuck", daemon=True).start()
