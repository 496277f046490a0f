"""The benchmarks' one timer: how a call is timed, the same for every benchmark.

    from benchmarks import timing

    t = timing.time_jax(jitted_fn, x, y)          # JAX: synchronised by jax.block_until_ready
    print(f"{t.ms:.3f} ms (min {t.min_ms:.3f}, {t.calls} calls, first call {t.first_call_s:.1f} s)")
    t = timing.time_torch(torch_fn, x)            # PyTorch on CUDA: torch.cuda.synchronize
    compiled, seconds = timing.compile_jax(jax.jit(fn), x, y)   # lower + compile, timed
    with timing.stopwatch() as sw:                # any one-off span (import, whole run)
        ...
    print(sw.seconds)

The policy (``time_calls``):

1. Warm-up: ``warmup`` calls, each waited for. The first is timed alone and reported as
   ``first_call_s``: it holds the compilation (a ``jax.jit`` function compiles on its first
   call; fla's Triton kernels autotune then) and is never part of the timed figures. The last
   warm-up call, once compiled, sizes the batches.
2. Timed: ``batches`` batches. A batch enqueues ``calls`` calls back to back (none waited for)
   and waits once, at its end, for every output of the batch; its time over its calls is one
   sample. ``calls`` is sized so that a batch lasts at least ``min_batch_s`` (at most
   ``max_calls``), unless given. Back-to-back calls keep the device busy between calls, as in a
   training step: waiting after every call adds the host's round trip to each and lets the
   clocks drop between calls.
3. Result: a frozen ``Timing`` with the median and the minimum over the batches of the seconds
   per call, the calls and batches timed, and ``first_call_s``.

``budget_s`` bounds the whole: no further batch starts once that many seconds have passed since
the first warm-up call began (at least one batch always runs). The outputs of one batch are
held until its wait: a benchmark near the device's memory limit passes ``calls=1`` (one call
per batch, each waited for).

Neither JAX nor PyTorch is imported with this module: ``jax_sync`` imports JAX, ``torch_sync``
(``time_torch``) PyTorch, on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

WARMUP = 2  # calls before timing: the first (compilation) timed alone, the last sizes batches
BATCHES = 7
MIN_BATCH_S = 0.05
MAX_CALLS = 200


@dataclasses.dataclass(frozen=True)
class Timing:
    """One timed function: seconds per call over ``batches`` batches of ``calls // batches``
    calls each (``seconds``: their median; ``min_seconds``: the fastest batch), and the first
    warm-up call's seconds, compilation included (nan when there was no warm-up call)."""

    seconds: float
    min_seconds: float
    calls: int
    batches: int
    first_call_s: float

    @property
    def ms(self) -> float:
        """Median milliseconds per call."""
        return 1e3 * self.seconds

    @property
    def min_ms(self) -> float:
        return 1e3 * self.min_seconds

    @property
    def calls_per_batch(self) -> int:
        return self.calls // self.batches


@dataclasses.dataclass
class Stopwatch:
    """Seconds since it started; frozen at the end of ``stopwatch()``'s block."""

    start: float
    end: float | None = None

    @property
    def seconds(self) -> float:
        return (time.perf_counter() if self.end is None else self.end) - self.start


@contextlib.contextmanager
def stopwatch() -> Iterator[Stopwatch]:
    """``with stopwatch() as sw: ...`` then ``sw.seconds``: the wall time of a one-off span
    (compilation, an import, a whole run), for what is not a repeatable call."""
    sw = Stopwatch(time.perf_counter())
    try:
        yield sw
    finally:
        sw.end = time.perf_counter()


def jax_sync(out):
    """Waits for every array in ``out`` (``jax.block_until_ready``)."""
    import jax

    return jax.block_until_ready(out)


def torch_sync(_out):
    """Waits for all of PyTorch's CUDA work (``torch.cuda.synchronize``; torch imported here)."""
    import torch

    torch.cuda.synchronize()


def first_call(fn: Callable, *args, sync: Callable[[Any], Any] = jax_sync) -> tuple[Any, float]:
    """``fn(*args)`` once, waited for with ``sync``: (its output, seconds)."""
    with stopwatch() as sw:
        out = fn(*args)
        sync(out)
    return out, sw.seconds


def batch_seconds(fn: Callable, args: tuple, calls: int, sync: Callable[[Any], Any]) -> float:
    """Seconds per call of ``calls`` calls of ``fn(*args)`` enqueued back to back, with one
    wait (``sync``) on all their outputs at the end."""
    with stopwatch() as sw:
        outs = [fn(*args) for _ in range(calls)]
        sync(outs)
    del outs
    return sw.seconds / calls


def calls_for(call_s: float, min_batch_s: float = MIN_BATCH_S, max_calls: int = MAX_CALLS) -> int:
    """Calls per batch so that a batch of calls of ``call_s`` seconds lasts ``min_batch_s``."""
    return max(1, min(max_calls, math.ceil(min_batch_s / max(call_s, 1e-7))))


def time_calls(fn: Callable, *args, sync: Callable[[Any], Any], warmup: int = WARMUP,
               batches: int = BATCHES, min_batch_s: float = MIN_BATCH_S,
               max_calls: int = MAX_CALLS, calls: int | None = None,
               budget_s: float | None = None) -> Timing:
    """Times ``fn(*args)`` by the module's policy, ``sync(outputs)`` waiting for the device.

    ``warmup`` >= 1 unless ``calls`` is given (the batches are sized from the last warm-up
    call); ``batches`` >= 1."""
    if batches < 1:
        raise ValueError(f"time_calls: batches must be at least 1, got {batches}")
    if warmup < 1 and calls is None:
        raise ValueError("time_calls: without a warm-up call, give calls (per batch)")
    if calls is not None and calls < 1:
        raise ValueError(f"time_calls: calls must be at least 1, got {calls}")
    with stopwatch() as total:
        first_s, last_s = math.nan, math.nan
        for i in range(warmup):
            _, last_s = first_call(fn, *args, sync=sync)
            if i == 0:
                first_s = last_s
        n = calls if calls is not None else calls_for(last_s, min_batch_s, max_calls)
        samples = []
        while len(samples) < batches:
            if samples and budget_s is not None and total.seconds >= budget_s:
                break
            samples.append(batch_seconds(fn, args, n, sync))
    return Timing(seconds=statistics.median(samples), min_seconds=min(samples),
                  calls=n * len(samples), batches=len(samples), first_call_s=first_s)


def time_jax(fn: Callable, *args, **kwargs) -> Timing:
    """``time_calls`` for a JAX function, each wait ``jax.block_until_ready`` of the outputs."""
    return time_calls(fn, *args, sync=jax_sync, **kwargs)


def time_torch(fn: Callable, *args, **kwargs) -> Timing:
    """``time_calls`` for a PyTorch callable on CUDA, each wait ``torch.cuda.synchronize()``
    (torch imported here, on first use)."""
    return time_calls(fn, *args, sync=torch_sync, **kwargs)


def compile_jax(jitted: Callable, *args) -> tuple[Any, float]:
    """``jitted.lower(*args).compile()``: (the compiled function, seconds to trace, lower and
    compile it)."""
    with stopwatch() as sw:
        compiled = jitted.lower(*args).compile()
    return compiled, sw.seconds
