"""Child processes of the benchmark scripts: several started at once, each in a process group
of its own, the whole group killed once that child has run past its own time limit (a
benchmark's workers, compilers or fla's autotuning die with it).

    from benchmarks import processes
    (rc, seconds), = processes.run_at_once([dict(args=argv, stdout=log)], [300.0])

Neither JAX nor PyTorch is imported: ``benchmarks/run.py`` never touches a device.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to ``proc``'s whole process group (it leads one: ``run_at_once`` starts it in a
    session of its own), then reaps it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_at_once(popen_args: Sequence[dict], limits: Sequence[float],
                poll_s: float = 0.2) -> list[tuple[int | None, float]]:
    """Starts ``subprocess.Popen(**kw, start_new_session=True)`` for each ``kw`` of
    ``popen_args`` at once and waits for them all, killing child i's process group once it has
    run ``limits[i]`` seconds. Returns, for each, (its exit code, or None when it was killed at
    its limit; the seconds it ran)."""
    if len(popen_args) != len(limits):
        raise ValueError(f"run_at_once: {len(popen_args)} commands, {len(limits)} limits")
    t0 = time.monotonic()
    procs = [subprocess.Popen(**kw, start_new_session=True) for kw in popen_args]
    ended: dict[int, tuple[int | None, float]] = {}
    while len(ended) < len(procs):
        for i, proc in enumerate(procs):
            if i in ended:
                continue
            rc = proc.poll()
            ran = time.monotonic() - t0
            if rc is None and ran > limits[i]:
                kill_group(proc)
                ended[i] = (None, ran)
            elif rc is not None:
                ended[i] = (rc, ran)
        if len(ended) < len(procs):
            time.sleep(poll_s)
    return [ended[i] for i in range(len(procs))]
