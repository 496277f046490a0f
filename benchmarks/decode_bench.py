r"""Decoding speed against context length: time per output token, all-MLA vs 3:1, beside the
floor of what a step must read (issues #15, #57).

    # a GPU at the 1B shapes (the defaults): batch 1 and the largest power-of-two batch that
    # fits, found from a memory estimate (--search=jump); the compilation cache lets every
    # worker after a variant's first skip the model's init compile
    JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache python benchmarks/decode_bench.py \
        --out_dir=benchmarks/results/decode --contexts=131072,1048576 --variants=all-MLA,3:1 \
        --search=jump --max_batch=64 --warmup=2 --steps=20 --max_seconds=150
    # every power of two from batch 1 up to the cap timed (ms per token against the batch)
    python benchmarks/decode_bench.py --out_dir=/tmp/decode --search=double --max_batch=16
    # where batch 1's step spends its time: ms by model part, kernels per step, idle time
    python benchmarks/decode_bench.py --out_dir=/tmp/decode_profile --contexts=131072 \
        --variants=3:1,all-MLA --max_batch=1 --profile_dir=/tmp/decode_traces
    # CPU, toy sizes, seconds (what the tests run)
    python benchmarks/decode_bench.py --smoke --out_dir=/tmp/decode

The model: ``long_context_memory``'s shapes (``--d_model`` ... ``--dtype``; the defaults are
the 1B model's: 20 layers of width 2048, 16 heads of 128, MLA latent 512 + 64), its weights
stored in the compute dtype, its layers unrolled as in configs/1b.py (``bench_config``), the
MLA caches read as ``--decode_impl`` says (``model.mla.decode_impl``; before timing, where it
resolves to the Pallas kernel, the kernel is checked against XLA's form on the card, and with
"auto" a kernel that fails the check gives way to "xla": the tables say which read ran).

What is timed: the decoding loop that ``kimi_k3/generate.py`` runs (``Decoder.decode``: greedy
steps of ``HybridLM.step`` in a while loop on the device, the cache donated), ``--steps`` steps
in one call after ``--warmup`` calls of one step (the first compiles), synchronised once. At batch
1, then the same number of steps one jitted call each (``Decoder.step``), back to back, as a
caller of the step makes them: their time, and the time the host took to hand them over, say
what the host adds when it is in the loop.

    ms per step = wall time of the timed steps / their number   (each row gets one token per
                  step: the time per output token of every sequence in the batch)
    tokens/s    = batch / (seconds per step)
    floor ms    = the bytes the step must read / the card's memory bandwidth    (``read_bytes``:
                  every weight once, as the decoder holds it; each KDA state and convolution
                  tail; of each MLA cache the context + 1 entries a row attends to)
    x floor     = ms per step / floor ms

The bandwidth is kimi_k3/plan.py's figure for the card (``plan.local_device``: its table of
cards, not repeated here; a CPU gets that table's "cpu" entry), or ``--hbm_gbps``.

No prefill: a step's time does not depend on what the cache holds, so the cache is
``init_cache(batch, context + 2 (warmup + steps))`` (``generate``'s sizing: prompt + new tokens),
filled in place with random values of its own dtypes (MLA latents and conv tails standard
normal, the KDA states 0.1 x standard normal), and its position counter set to ``context``:
every step attends over the whole context, as after a prefill of that many tokens. The
weights are the model's initialisation. tests/test_bench_decode.py checks that a step from
such a cache gives the logits of the model's ``prefill`` of that one token.

Largest batch that fits: powers of two up to ``--max_batch``, tried in the worker process, an
out-of-memory error (XLA's RESOURCE_EXHAUSTED) caught and the next size chosen (``next_batch``):

- ``--search=double``: 1, 2, 4, ... until one fails or the cap; every size is timed.
- ``--search=jump``: 1, then the largest power of two that the device's memory limit
  (``memory_stats()['bytes_limit']``) should hold, taking batch 1's peak less the weights as
  the bytes of a row; then doubling on while they fit, halving while they fail. The same
  largest power of two as ``double`` (fitting is monotone in the batch) in fewer
  compilations; where the backend reports no memory (CPU) it is ``double``.

Either way, once two batches have run, a batch whose peak the line through their peaks puts
above 1.1 x the memory limit is not tried (status ``no_fit``).

Every (variant, context) point runs in its own process (``long_context_memory.stream_worker``),
contexts in increasing order, so an out-of-memory crash loses that point alone and the peak is
that point's own; a variant whose batch 1 fails at one context is not run at longer ones
(``not_run``). ``--max_seconds`` bounds a point, the worker's start included: the timed steps
shrink to what is left of it, a larger batch is not started when less is left than the last
batch took (``budget``), and a worker still running ``--grace_seconds`` after it is killed
(``timeout``).

Columns of ``decode.csv`` (one row per batch tried): variant, pattern, context, batch, status
(ok | oom | no_fit | budget | timeout | error | not_run; ``running`` while it runs),
ms_per_step (the loop on the device), call_ms_per_step (one call per step), host_ms_per_step
(the time the host took to hand those calls to the device, per step: near call_ms_per_step when
the host, not the card, sets their pace), tokens_per_s, steps (timed), first_call_s
(compilation + one step), peak_bytes (the worker's allocator high-water mark so far, where the
backend reports it: GPU/TPU),
cache_bytes (the cache the step is given), params, read_bytes, hbm_gbps, floor_ms, x_floor
(above), cache_read (how the MLA caches were read), detail. ``decode.md`` holds the tables (ms
per step at each context and batch, with all-MLA / other at the same batch, the floor and the
multiple of it; the largest batch of each; the ratios beside the Kimi Linear report's) and
``decode_ms_per_token.png`` the plot; the three are rewritten after every batch.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import sys
import time

# The repository root, for ``kimi_k3`` and for this folder's long_context_memory.py.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import long_context_memory as lcm  # noqa: E402
from benchmarks import timing, trace_parts  # noqa: E402

# JAX and the model are imported inside the functions that run in each point's own worker
# process: the driver only spawns them and gathers their rows, so it never holds a device.

FIELDS = ("variant", "pattern", "context", "batch", "status", "ms_per_step", "call_ms_per_step",
          "host_ms_per_step", "tokens_per_s", "steps",
          "first_call_s", "peak_bytes", "cache_bytes", "params", "read_bytes", "hbm_gbps",
          "floor_ms", "x_floor", "cache_read", "detail")
REFERENCE = "all-MLA"  # the variant the others are compared with
# The 1B model's shapes, as long_context_memory.py's flags take them (configs/1b.py's width,
# depth, heads and latent; that script's vocabulary, FFN width and full-rank queries).
ONE_B = dict(d_model=2048, num_layers=20, heads=16, head_dim=128, kv_lora_rank=512)
# Time per output token, all-MLA over Kimi Linear, from the Kimi Linear report, for the table.
KIMI_LINEAR_REPORT = {"batch_1": "about 2.2x", "largest": "6.3x at 1M (larger batches)"}
FILL_CHUNK_ELEMENTS = 2**24  # random values made per loop step while filling the cache (64 MiB f32)
NO_FIT_MARGIN = 1.1  # a batch predicted to need more than this x the memory limit is not tried


# ---------------------------------------------------------------------------------------------
# The decoding cache, random, and the timed step
# ---------------------------------------------------------------------------------------------


_MODELS: dict[tuple[str, int], object] = {}  # (config as JSON, seed) -> its model, in this process


def build_model(cfg, seed: int = 0):
    """``HybridLM(cfg)`` initialised inside one jitted call (eagerly, every initialiser would
    compile on its own; the rbg key compiles faster, see HybridLM's docstring). Once per
    (config, seed) in a process: the in-process driver's points, and the tests, share it."""
    import jax
    from flax import nnx

    from kimi_k3.model import HybridLM

    key = (cfg.to_json_best_effort(sort_keys=True), seed)
    if key not in _MODELS:
        _MODELS[key] = nnx.jit(lambda: HybridLM(cfg, rngs=nnx.Rngs(jax.random.key(seed, impl="rbg"))))()
    return _MODELS[key]


def bench_config(args, variant: str):
    """The benchmark's model: ``long_context_memory``'s shapes, its weights stored in the
    compute dtype (what a decoding step reads: 2 bytes a weight in bf16, not float32 masters),
    the layers unrolled as in configs/1b.py, the latent cache read by ``--decode_impl``."""
    cfg = lcm.model_config(args, variant)
    cfg.param_dtype = args.dtype
    cfg.scan_layers = False
    cfg.mla.decode_impl = args.decode_impl
    cfg.kda.step_impl = args.kda_step_impl
    return cfg


def read_bytes(weight_bytes: int, cache, context: int) -> int:
    """The bytes one step must read at least: every weight once (``weight_bytes``, as the
    decoder holds them), each KDA state and convolution tail once, and of each MLA latent
    cache the ``context + 1`` entries per row it attends to (not the unused rest of the cache).
    ``cache``: the cache (or its shapes)."""
    import jax

    total = weight_bytes
    for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
        name = getattr(path[-1], "key", None)
        itemsize = x.dtype.itemsize
        if name == "latent_kv":  # [..., B, S, L]: the entries up to the context
            total += x.size // x.shape[-2] * min(context + 1, x.shape[-2]) * itemsize
        elif name != "pos":
            total += x.size * itemsize
    return total


def card_bandwidth(override: float = 0.0) -> tuple[float, str]:
    """(GB/s, whose figure) of this process's device: ``override`` when given, else the
    planner's figure for the card (``kimi_k3.plan.DEVICES``, by ``local_device``; a CPU gets
    its "cpu" entry), else (0, why): no floor is computed."""
    from kimi_k3 import plan

    if override:
        return float(override), "--hbm_gbps"
    card = plan.local_device(None)
    if card.hbm_gbps:
        return float(card.hbm_gbps), f"{card.name} (kimi_k3/plan.py)"
    if card.platform == "cpu":
        cpu = plan.DEVICES["cpu"]
        return float(cpu.hbm_gbps), f"{cpu.name} (kimi_k3/plan.py)"
    return 0.0, f"{card.name}: not in kimi_k3/plan.py's DEVICES (give --hbm_gbps)"


def check_decode_kernel(decode_impl: str, dtype) -> str:
    """The correctness gate before timing: where the latent cache's read resolves to the
    Pallas kernel on this device, the kernel against the "xla" form on a random cache at the
    1B model's latent (16 heads, 512 + 64, 3 rows of 5,000 entries, 4,321 visible); raises
    when they differ by more than bf16 rounding. Returns what was checked."""
    import jax
    import jax.numpy as jnp

    from kimi_k3.dispatch import choose_decode_attention_impl
    from kimi_k3.layers.attention import latent_decode_attention
    from pallas_kernels import latent_decode

    H, R, D = 16, 512, 64
    impl = choose_decode_attention_impl(decode_impl, dtype=jnp.dtype(dtype).name,
                                        unsupported=latent_decode.unsupported(H, R, D))
    if impl != "pallas":
        return f"latent cache read: {impl}"
    k1, k2 = jax.random.split(jax.random.key(0))
    q = jax.random.normal(k1, (3, H, R + D), jnp.float32).astype(dtype)
    kv = jax.random.normal(k2, (3, 5000, R + D), jnp.float32).astype(dtype)
    run = jax.jit(lambda impl, q, kv: latent_decode_attention(
        q, kv, jnp.int32(4321), scale=0.05, value_dim=R, impl=impl), static_argnums=0)
    got, want = run("pallas", q, kv), run("xla", q, kv)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    if not err < 2e-2:
        raise RuntimeError(f"the Pallas latent-cache read differs from XLA's by {err:.3g} "
                           f"(relative): run with --decode_impl=xla")
    return f"latent cache read: pallas (agrees with xla to {err:.1e})"


def random_cache(model, batch: int, max_len: int, context: int, seed: int = 0) -> dict:
    """``model.init_cache(batch, max_len)`` filled with random values of its own dtypes (KDA
    states 0.1 x standard normal, everything else standard normal) and ``pos = context``.

    One jitted program writes each array in place, ``FILL_CHUNK_ELEMENTS`` values at a time
    (a loop of dynamic-update-slices), so the fill needs 64 MiB beside the cache: a batch whose
    step fits is never refused by its fill."""
    import jax
    import jax.numpy as jnp

    if not 0 <= context < max_len:
        raise ValueError(f"random_cache: context {context} must lie in [0, max_len={max_len})")

    def fill(x, key, scale):
        width = x.shape[-1] if x.ndim else 1
        n_rows = x.size // width
        rows = max(1, min(n_rows, FILL_CHUNK_ELEMENTS // width))
        if rows == n_rows:  # small: in one go
            return (scale * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)

        def chunk(j, flat):
            start = jnp.minimum(j * rows, n_rows - rows)  # the last chunk overlaps the one before
            part = scale * jax.random.normal(jax.random.fold_in(key, j), (rows, width), jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(flat, part.astype(x.dtype), start, axis=0)

        flat = jax.lax.fori_loop(0, -(-n_rows // rows), chunk, x.reshape(n_rows, width))
        return flat.reshape(x.shape)

    @jax.jit
    def make(key, pos):
        paths, treedef = jax.tree_util.tree_flatten_with_path(model.init_cache(batch, max_len))
        leaves = []
        for i, (path, x) in enumerate(paths):
            name = getattr(path[-1], "key", None)
            if name == "pos":
                leaves.append(pos.astype(x.dtype))
            else:
                leaves.append(fill(x, jax.random.fold_in(key, i), 0.1 if name == "state" else 1.0))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    # rbg keys: XLA:CPU compiles threefry slowly, and the values need no more than rbg's.
    return make(jax.random.key(seed, impl="rbg"), jnp.int32(context))


def step_ready_cache(decoder, token_B, cache):
    """``cache`` nested as the step returns it, so every timed step reuses one compilation."""
    import jax

    from kimi_k3.eval_scoring import align_cache

    return align_cache(cache, jax.eval_shape(decoder.step, token_B, cache)[1])


def profile_step(decoder, token_B, cache, trace_dir: str, steps: int = 3):
    """Where a step's device time goes: ``steps`` calls of the compiled step under
    ``jax.profiler``, each kernel attributed to the model part its instruction's named scope
    says (benchmarks/trace_parts.py). Returns ({"parts": {part: ms per step}, "kernels":
    kernels per step, "idle_ms": the device's idle time per step, "top": the five largest
    kernels (ms, op_name)}, the cache)."""
    import jax

    call, hlo = decoder.compiled_step(token_B, cache)
    logits_BxV, cache = call(token_B, cache)  # the first call of the program, untraced
    jax.block_until_ready(cache)
    os.makedirs(trace_dir, exist_ok=True)
    jax.profiler.start_trace(trace_dir)
    for _ in range(steps):
        logits_BxV, cache = call(token_B, cache)
        jax.block_until_ready(cache)
    jax.profiler.stop_trace()
    got = trace_parts.attribute(trace_parts.kernel_events(trace_dir),
                                trace_parts.op_names_from_hlo(hlo), steps)
    parts = collections.defaultdict(float)
    for (part, _), ms in got["parts"].items():
        parts[part] += ms
    idle = sum(ms for part, (ms, _) in got["idle"].items() if part != "(between steps)")
    top = [(ms, name[:120]) for (_, name), ms in got["top"][:5]]
    return {"parts": dict(parts), "kernels": got["kernels"], "idle_ms": idle, "top": top}, cache


def decode_loop(decoder, context: int, max_len: int, logits_BxV, cache, n: int):
    """``n`` greedy steps in one call of the decoder's loop on the device (``Decoder.decode``,
    what ``generate`` runs), from position ``context``. Returns (last logits, cache)."""
    import jax.numpy as jnp
    import numpy as np

    from kimi_k3.generate import GREEDY, loop_rows, start_book

    B, N = logits_BxV.shape[0], max_len - context
    rows = loop_rows(np.zeros((B, 1), np.int32), np.zeros(B), 1, N, (), None, GREEDY)
    rows["last"] = jnp.int32(max_len - 1)  # no prompt: every step's token is recorded
    book = start_book(B, N, context)
    logits_BxV, cache, _ = decoder.decode(logits_BxV, cache, book, rows, n, GREEDY)
    return logits_BxV, cache


def run_steps(decoder, token_B, cache, n: int):
    """``n`` calls of the decoder's jitted step (generate's own, cache donated), each feeding
    ``token_B``; nothing waits for the device in between. Returns (last logits, cache)."""
    logits_BxV = None
    for _ in range(n):
        logits_BxV, cache = decoder.step(token_B, cache)
    return logits_BxV, cache


# ---------------------------------------------------------------------------------------------
# The batch search
# ---------------------------------------------------------------------------------------------


def pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def next_batch(tried: dict[int, bool], cap: int, guess: int | None = None) -> int | None:
    """The next power-of-two batch to try, None when the largest that fits is known.

    ``tried``: {batch: it fitted}. Batch 1 first; then ``guess`` (the jump), else the double
    of the largest that fitted; once one has failed, the halves of the smallest failure down to
    the largest success. ``cap`` is rounded down to a power of two."""
    cap = pow2_floor(cap)
    if not tried:
        return 1
    fits = [b for b, ok in tried.items() if ok]
    fails = [b for b, ok in tried.items() if not ok]
    if not fits:
        return None
    best = max(fits)
    if fails:
        half = min(fails) // 2
        return half if half > best else None
    nxt = pow2_floor(min(guess, cap)) if guess and guess > best else 2 * best
    return nxt if nxt <= cap else None


def predicted_peak(peaks: dict[int, int], batch: int) -> float | None:
    """Peak bytes at ``batch``, on the line through the measured peaks of the two largest
    batches that ran ({batch: peak}); None with fewer than two. An under-estimate when the
    smaller one's peak is still the model's initialisation (then the batch is tried)."""
    if len(peaks) < 2:
        return None
    (b0, p0), (b1, p1) = sorted(peaks.items())[-2:]
    return p1 + (p1 - p0) / (b1 - b0) * (batch - b1)


def guess_largest_batch(limit_bytes: int | None, peak_1: int | None, fixed_bytes: int,
                        cap: int) -> int | None:
    """The largest power of two <= cap whose batch should fit in ``limit_bytes``: the fixed
    bytes (weights) plus, per row, batch 1's peak less them (an over-estimate: batch 1's peak
    also holds the per-call buffers that do not grow with the batch). None when the backend
    reports no memory."""
    if not limit_bytes or not peak_1:
        return None
    per_row = max(peak_1 - fixed_bytes, 1)
    room = 0.97 * limit_bytes - fixed_bytes
    return pow2_floor(min(cap, max(2, int(room // per_row))))


# ---------------------------------------------------------------------------------------------
# One point (variant, context), in this process
# ---------------------------------------------------------------------------------------------


def _memory_limit():
    import jax

    stats = jax.devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def run_point(args, variant: str, context: int, emit=print, started: float | None = None) -> list[dict]:
    """Time decoding at ``context`` for one variant at each batch the search tries; emits (a
    ``running`` row before, the final one after) and returns one row per batch. ``started``:
    when the point's ``--max_seconds`` began (default now)."""
    import gc
    import json

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from kimi_k3.generate import Decoder

    deadline = (time.perf_counter() if started is None else started) + args.max_seconds
    cfg = bench_config(args, variant)
    model = build_model(cfg, args.seed)
    decoder = Decoder(model, fuse=args.fuse)
    gate = ""
    if "M" in cfg.pattern:
        try:
            gate = check_decode_kernel(args.decode_impl, cfg.dtype)
        except Exception as err:  # a kernel that does not compile or agree on this card
            if args.decode_impl != "auto":
                raise
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
            gate = f"latent cache read: xla (the Pallas kernel failed its check: {first})"
            cfg.mla.decode_impl = "xla"
            model = build_model(cfg, args.seed)
            decoder = Decoder(model, fuse=args.fuse)
    hbm_gbps, _ = card_bandwidth(args.hbm_gbps)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    fixed_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    max_len = context + 2 * (args.warmup + args.steps)  # the loop's steps, then the calls'
    limit = _memory_limit()
    rng = np.random.default_rng(args.seed)
    tried: dict[int, bool] = {}
    guess = None
    peaks: dict[int, int] = {}  # batch -> peak bytes, of the batches that ran
    rows = []
    last_try_s = 0.0

    def send(row):
        emit(lcm.RESULT + json.dumps(row))

    while (batch := next_batch(tried, args.max_batch, guess)) is not None:
        row = {"variant": variant, "pattern": cfg.pattern, "context": context, "batch": batch,
               "params": params, "status": "running", "detail": "", "hbm_gbps": hbm_gbps,
               "cache_read": gate}
        need = predicted_peak(peaks, batch)
        if need and limit and need > NO_FIT_MARGIN * limit:
            row.update(status="no_fit", detail=f"not run: predicted peak {need / 2**30:.1f} GiB > "
                                                f"{NO_FIT_MARGIN:g} x the {limit / 2**30:.1f} GiB limit")
            tried[batch] = False
            rows.append(row)
            send(row)
            continue
        left = deadline - time.perf_counter()
        if tried and left < last_try_s:
            row.update(status="budget", detail=f"not run: {max(left, 0):.0f} s of --max_seconds "
                                                f"{args.max_seconds:g} left, the last batch took "
                                                f"{last_try_s:.0f} s")
            rows.append(row)
            send(row)
            break
        send(row)
        t_try = time.perf_counter()
        try:
            row["cache_bytes"] = lcm.cache_bytes(model, max_len, batch)
            row["read_bytes"] = read_bytes(decoder.weight_bytes, jax.eval_shape(
                lambda: model.init_cache(batch, max_len)), context)
            if hbm_gbps:
                row["floor_ms"] = 1e3 * row["read_bytes"] / (hbm_gbps * 1e9)
            token_B = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch,)), jnp.int32)
            cache = random_cache(model, batch, max_len, context, args.seed)
            cache = step_ready_cache(decoder, token_B, cache)
            logits_BxV = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
            loop = functools.partial(decode_loop, decoder, context, max_len)
            # benchmarks/timing.py's pieces: the cache threads through the steps (donated),
            # so the warm-up calls and the one timed call of n steps are made here
            (logits_BxV, cache), row["first_call_s"] = timing.first_call(
                loop, logits_BxV, cache, 1)
            one_step = None
            for _ in range(args.warmup - 1):
                (logits_BxV, cache), one_step = timing.first_call(loop, logits_BxV, cache, 1)
            n = args.steps
            if one_step:  # what is left of the budget bounds the timed steps
                n = max(1, min(n, int((deadline - time.perf_counter()) / one_step / 2)))
            with timing.stopwatch() as timed:
                logits_BxV, cache = loop(logits_BxV, cache, n)
                jax.block_until_ready((logits_BxV, cache))
            seconds = timed.seconds / n
            row.update(status="ok", steps=n, ms_per_step=1e3 * seconds,
                       tokens_per_s=batch / seconds, peak_bytes=lcm.peak_bytes_in_use())
            if batch == 1:  # the same steps one call each, as a caller of Decoder.step makes them
                (logits_BxV, cache), _ = timing.first_call(run_steps, decoder, token_B, cache, 1)
                with timing.stopwatch() as timed:
                    logits_BxV, cache = run_steps(decoder, token_B, cache, n)
                    handed = time.perf_counter()
                    jax.block_until_ready((logits_BxV, cache))
                row.update(call_ms_per_step=1e3 * timed.seconds / n,
                           host_ms_per_step=1e3 * (handed - timed.start) / n)
            if row.get("floor_ms"):
                row["x_floor"] = row["ms_per_step"] / row["floor_ms"]
            if not np.isfinite(np.asarray(logits_BxV)).all():
                row["detail"] = "non-finite logits"
            if args.profile_dir and batch == 1:
                row["profile"], cache = profile_step(
                    decoder, token_B, cache, os.path.join(
                        args.profile_dir, f"{variant.replace(':', 'to')}_{context}"))
            del cache, logits_BxV
        except Exception as err:  # XLA raises its own types for OOM; anything else is reported too
            row["status"] = "oom" if lcm.is_oom(err) else "error"
            text = str(err).strip()
            row["detail"] = f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"
            cache = logits_BxV = None
        gc.collect()  # the failed batch's buffers go before the next one is made
        last_try_s = time.perf_counter() - t_try
        tried[batch] = row["status"] == "ok"
        if row["status"] == "ok" and row.get("peak_bytes"):
            peaks[batch] = row["peak_bytes"]
        rows.append(row)
        send(row)
        if row["status"] == "error":
            break
        if batch == 1 and row["status"] == "ok" and args.search == "jump":
            guess = guess_largest_batch(limit, row.get("peak_bytes"), fixed_bytes, args.max_batch)
    return rows


# ---------------------------------------------------------------------------------------------
# The driver: points in subprocesses (or in process), then CSV, tables and plot
# ---------------------------------------------------------------------------------------------


def largest(rows: list[dict], variant: str, context: int) -> tuple[dict | None, str]:
    """The largest batch that ran at (variant, context), and what stopped the search: the
    status of the smallest larger batch tried (oom, budget, ...) or the cap."""
    mine = [r for r in rows if r["variant"] == variant and r["context"] == context]
    ok = [r for r in mine if r["status"] == "ok"]
    if not ok:
        return None, ""
    best = max(ok, key=lambda r: r["batch"])
    above = sorted((r for r in mine if r["batch"] > best["batch"]), key=lambda r: r["batch"])
    return best, (above[0]["status"] if above else "cap")


def _num(x, fmt="{:.4g}") -> str:
    return "" if x is None or x == "" else fmt.format(x)


def _ratio(a, b) -> str:
    return "" if not a or not b else f"{a / b:.2f}x"


def format_tables(rows: list[dict], device: str, args) -> str:
    variants = [v for v in args.variants if any(r["variant"] == v for r in rows)]
    gbps = sorted({r["hbm_gbps"] for r in rows if r.get("hbm_gbps")})
    reads = {v: sorted({r["cache_read"] for r in rows if r["variant"] == v and r.get("cache_read")})
             for v in variants}
    floor = (f"floor = the bytes a step must read (every weight once, in the dtype the decoder "
             f"holds it; each KDA state and convolution tail; each MLA cache's entries up to the "
             f"context) / the card's bandwidth, {', '.join(f'{g:g}' for g in gbps)} GB/s "
             f"(kimi_k3/plan.py's figure for the card, or --hbm_gbps); x floor = ms / floor ms"
             if gbps else "floor: no bandwidth known for this card (give --hbm_gbps)")
    others = [v for v in variants if v != REFERENCE] if REFERENCE in variants else []
    contexts = sorted({r["context"] for r in rows})
    at = {(r["variant"], r["context"], r["batch"]): r for r in rows}
    params = {r["variant"]: r["params"] for r in rows if r.get("params")}
    lines = [
        f"device: {device}",
        f"model: d_model {args.d_model}, {args.num_layers} layers, {args.heads} heads, head dim "
        f"{args.head_dim}, MLA latent {args.kv_lora_rank} + {args.shared_head_dim}, {args.dtype}; "
        + ", ".join(f"{v} {lcm.pattern_for(v, args.num_layers)} {params[v] / 1e6:.4g}M parameters"
                    for v in variants if v in params),
        f"cache: init_cache(batch, context + 2 x ({args.warmup} + {args.steps})) filled with random values, "
        f"position = context; {args.warmup} warm-up steps, then up to {args.steps} timed "
        f"(--search={args.search}, --max_batch={args.max_batch})",
        "",
        "Time per output token = ms per step (every row of the batch gets one token per step), "
        "the steps in one call of generate's loop on the device (Decoder.decode).",
        "projections: " + ("each layer's products of one input as one (the Decoder's default)"
                           if args.fuse else "each its own product (--no-fuse)")
        + f"; KDA step after them: {args.kda_step_impl} (--kda_step_impl)",
        floor,
        "how each step read the MLA caches: " + ("; ".join(
            f"{v}: {', '.join(r)}" for v, r in reads.items() if r) or "no MLA layer"),
        "",
    ]
    head = ["context", "batch"] + [f"{v} ms" for v in variants] + [f"{REFERENCE} / {v}" for v in others]
    head += [f"{v} floor ms" for v in variants] + [f"{v} x floor" for v in variants]
    head += [f"{v} tokens/s" for v in variants] + [f"{v} peak (GiB)" for v in variants]
    head += [f"{v} cache (GiB)" for v in variants]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for T in contexts:
        for b in sorted({r["batch"] for r in rows if r["context"] == T}):
            cells = [at.get((v, T, b)) for v in variants]
            ms = {v: c["ms_per_step"] for v, c in zip(variants, cells, strict=True)
                  if c and c["status"] == "ok"}
            line = [f"{T:,}", str(b)]
            line += [_num(ms.get(v)) if v in ms else (c["status"] if c else "")
                     for v, c in zip(variants, cells, strict=True)]
            line += [_ratio(ms.get(REFERENCE), ms.get(v)) for v in others]
            line += [_num(c.get("floor_ms")) if c else "" for c in cells]
            line += [_num(c.get("x_floor"), "{:.2f}x") if c else "" for c in cells]
            line += [_num(c.get("tokens_per_s"), "{:,.1f}") if c else "" for c in cells]
            line += [lcm.gib(c.get("peak_bytes")) if c else "" for c in cells]
            line += [lcm.gib(c.get("cache_bytes")) if c else "" for c in cells]
            lines.append("| " + " | ".join(line) + " |")

    lines += ["", "Largest power-of-two batch that ran (stopped by: the larger batch's status, or "
                  "the cap):", "",
              "| context | variant | batch | stopped by | ms per step | floor ms | x floor | "
              "tokens/s | peak (GiB) | cache (GiB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for T in contexts:
        for v in variants:
            best, why = largest(rows, v, T)
            if best is None:
                status = ", ".join(sorted({r["status"] for r in rows if r["variant"] == v
                                           and r["context"] == T})) or "not run"
                lines.append(f"| {T:,} | {v} | none | {status} | | | | | | |")
                continue
            lines.append(f"| {T:,} | {v} | {best['batch']} | {why} | {_num(best['ms_per_step'])} | "
                         f"{_num(best.get('floor_ms'))} | {_num(best.get('x_floor'), '{:.2f}x')} | "
                         f"{best['tokens_per_s']:,.1f} | {lcm.gib(best.get('peak_bytes'))} | "
                         f"{lcm.gib(best.get('cache_bytes'))} |")

    if others:
        lines += ["", f"{REFERENCE} against the others, beside the Kimi Linear report's figures "
                      f"(time per output token, {REFERENCE} / Kimi Linear): at batch 1 the ratio "
                      f"of ms per step; at each model's largest batch the ratio of tokens/s "
                      f"(the time per output token of the batch, amortised).", ""]
        head = ["context"] + [f"batch 1: {REFERENCE} / {v}" for v in others] + ["report, batch 1"]
        head += [f"largest batches: {v} / {REFERENCE} tokens/s" for v in others] + ["report, larger batches"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for T in contexts:
            one = {v: at.get((v, T, 1)) for v in variants}
            ms1 = {v: r["ms_per_step"] for v, r in one.items() if r and r["status"] == "ok"}
            big = {v: largest(rows, v, T)[0] for v in variants}
            line = [f"{T:,}"] + [_ratio(ms1.get(REFERENCE), ms1.get(v)) for v in others]
            line.append(KIMI_LINEAR_REPORT["batch_1"] if T == 2**20 else "")
            for v in others:
                a, b = big.get(v), big.get(REFERENCE)
                line.append("" if not (a and b) else f"{_ratio(a['tokens_per_s'], b['tokens_per_s'])} "
                                                     f"({a['batch']} vs {b['batch']} rows)")
            line.append(KIMI_LINEAR_REPORT["largest"] if T == 2**20 else "")
            lines.append("| " + " | ".join(line) + " |")
    called = [r for r in rows if r.get("call_ms_per_step")]
    if called:
        lines += ["", "The same steps one jitted call each (Decoder.step), against the loop on the "
                      "device (Decoder.decode, generate's): host ms is the time the host took to "
                      "hand a call over; when it nears the call's ms, the host sets the pace.", "",
                  "| context | variant | batch | loop ms | a call per step ms | host ms | call / loop |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['context']:,} | {r['variant']} | {r['batch']} | {_num(r['ms_per_step'])} | "
                  f"{_num(r['call_ms_per_step'])} | {_num(r['host_ms_per_step'])} | "
                  f"{_ratio(r['call_ms_per_step'], r['ms_per_step'])} |" for r in called]
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        lines += ["", "", profile_table(profiled)]
    return "\n".join(lines)


def profile_table(rows: list[dict]) -> str:
    """Batch 1's step by model part (``--profile_dir``): device ms per step of each part's
    kernels, the kernels per step and the device's idle time between them."""
    parts = [p for p in (*trace_parts.PARTS, *trace_parts.MOE_PARTS, "other")
             if any(r["profile"]["parts"].get(p) for r in rows)]
    head = ["context", "variant", "ms per step", "floor ms", "kernels", "idle ms", *parts]
    lines = ["Batch 1's step by model part (device ms per step; XLA's command buffers off, so "
             "every kernel is a launch of its own):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        p = r["profile"]
        lines.append("| " + " | ".join(
            [f"{r['context']:,}", r["variant"], _num(r.get("ms_per_step")), _num(r.get("floor_ms")),
             f"{p['kernels']:.0f}", f"{p['idle_ms']:.3f}"]
            + [f"{p['parts'].get(part, 0.0):.3f}" for part in parts]) + " |")
    lines += ["", "Largest kernels (ms per step, op_name):", ""]
    for r in rows:
        lines += [f"- {r['variant']} at {r['context']:,}: {ms:.3f} ms `{name}`"
                  for ms, name in r["profile"]["top"]]
    return "\n".join(lines)


def write_outputs(rows: list[dict], out_dir: str, device: str, args, plot: bool = True) -> dict[str, str]:
    from kimi_k3 import plots

    os.makedirs(out_dir, exist_ok=True)
    paths = {"csv": os.path.join(out_dir, "decode.csv"), "md": os.path.join(out_dir, "decode.md"),
             "png": os.path.join(out_dir, "decode_ms_per_token.png")}
    lcm.write_csv(paths["csv"], rows, FIELDS)
    with open(paths["md"], "w") as f:
        f.write(format_tables(rows, device, args) + "\n")

    series, note = {}, []
    for v in args.variants:
        for T in sorted({r["context"] for r in rows}):
            one = next((r for r in rows if (r["variant"], r["context"], r["batch"], r["status"])
                        == (v, T, 1, "ok")), None)
            best, _ = largest(rows, v, T)
            for label, r in ((f"{v}, batch 1", one), (f"{v}, largest batch", best)):
                if r is not None:
                    xs, ys = series.setdefault(label, ([], []))
                    xs.append(T)
                    ys.append(r["ms_per_step"])
            if best is not None and best["batch"] > 1:
                note.append(f"{v} {plots.tokens_label(T)}: {best['batch']}")
    if series and plot:
        plots.line_plot(paths["png"], series, title=f"Decoding ({device})",
                        xlabel="context (tokens)", ylabel="ms per step (per output token)",
                        logx=True, logy=True, token_axis=True,
                        note="largest batches: " + ", ".join(note) if note else None)
    return paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]
    strs = lambda s: [x for x in s.split(",") if x]
    p.add_argument("--out_dir", default="benchmarks/results/decode")
    p.add_argument("--contexts", type=ints, default=[8192, 131072, 524288, 1048576],
                   help="tokens already in the cache when the timed steps start")
    p.add_argument("--variants", type=strs, default=["all-MLA", "3:1"],
                   help=f"of {lcm.VARIANTS}; {REFERENCE} is the reference of the ratios")
    lcm.add_model_args(p)
    p.set_defaults(**ONE_B)
    p.add_argument("--max_batch", type=int, default=64,
                   help="the cap of the largest-batch search (rounded down to a power of two)")
    p.add_argument("--search", default="double", choices=("double", "jump"),
                   help="largest-batch search: every power of two from 1, or 1 then a memory "
                        "estimate (module docstring)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per batch (at most)")
    p.add_argument("--max_seconds", type=float, default=60.0,
                   help="budget of one (variant, context) point, worker start included")
    p.add_argument("--grace_seconds", type=float, default=120.0,
                   help="a worker still running this long after its budget is killed")
    p.add_argument("--decode_impl", default="auto", choices=("auto", "xla", "pallas"),
                   help="how a step reads the MLA latent cache (model.mla.decode_impl); 'auto' "
                        "falls back to 'xla' when the Pallas kernel fails its check on the card")
    p.add_argument("--hbm_gbps", type=float, default=0.0,
                   help="the card's memory bandwidth for the floor, GB/s; 0 = kimi_k3/plan.py's "
                        "figure for the card")
    p.add_argument("--profile_dir", default="",
                   help="also profile batch 1's step at each point (traces in this folder; XLA's "
                        "command buffers are then off, for the timings too): ms by model part, "
                        "kernels per step, idle time")
    p.add_argument("--kda_step_impl", default="xla", choices=("xla", "pallas"),
                   help="a KDA layer's step after its projections (model.kda.step_impl): XLA's "
                        "ops, or one kernel (pallas_kernels/kda_decode.py)")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                   help="the Decoder's fused projections (kimi_k3/layers/fused.py; --no-fuse: "
                        "each product on its own, for comparison)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in_process", action=argparse.BooleanOptionalAction, default=False,
                   help="run every point in this process (peak memory then accumulates)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU toy sizes as defaults: contexts 32 and 64, batches up to 2, the "
                        "long-context benchmark's toy model, in process; explicit flags still win")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(contexts=[32, 64], max_batch=2, warmup=2, steps=2, in_process=True,
                       **lcm.SMOKE_MODEL)
    args = p.parse_args(argv)
    for v in args.variants:
        try:
            lcm.pattern_for(v, args.num_layers)
        except ValueError as e:
            p.error(str(e))
    if not args.contexts or min(args.contexts) < 1:
        p.error(f"--contexts: {args.contexts} must be positive integers")
    for name in ("max_batch", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: {getattr(args, name)} must be >= 1")
    if not (math.isfinite(args.max_seconds) and args.max_seconds > 0):
        p.error(f"--max_seconds: {args.max_seconds} must be a positive number")
    return args


def main(argv=None) -> list[dict]:
    started = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.profile_dir:  # before any backend starts, here and in the workers
        trace_parts.commands_apart()
    if args.worker:
        print(lcm.DEVICE + lcm.device_name(), flush=True)
        run_point(args, args.variant, args.context, emit=lambda s: print(s, flush=True),
                  started=started)
        return []
    # With workers, this process never touches the accelerator (it would hold its memory).
    device = [lcm.device_name() if args.in_process else "device not yet known"]
    print(f"contexts {args.contexts}; variants {args.variants}; batches up to "
          f"{pow2_floor(args.max_batch)} ({args.search})", flush=True)
    rows: dict[tuple, dict] = {}  # (variant, context, batch) -> row; a "running" row is replaced

    def on_row(r):
        rows[(r["variant"], r["context"], r["batch"])] = r
        if r["status"] == "running":
            print(f"  batch {r['batch']:>5} ...", flush=True)
        else:
            ms = "" if r.get("ms_per_step") is None else f"{r['ms_per_step']:.4g} ms/step"
            if r.get("x_floor"):
                ms += f" ({r['x_floor']:.2f}x the floor {r['floor_ms']:.3g} ms)"
            if r.get("call_ms_per_step"):
                ms += (f"; a call per step {r['call_ms_per_step']:.4g} ms (host "
                       f"{r['host_ms_per_step']:.3g} ms)")
            print(f"  batch {r['batch']:>5}: {r['status']:<7} {ms:<40} peak "
                  f"{lcm.gib(r.get('peak_bytes')) or '-'} GiB, cache {lcm.gib(r.get('cache_bytes')) or '-'} "
                  f"GiB {r.get('detail', '')}", flush=True)
        # The CSV and tables after every batch (a cut-short run keeps them), the plot after
        # every point.
        write_outputs(list(rows.values()), args.out_dir, device[0], args, plot=False)

    def on_device(name):
        if device[0] != name:
            device[0] = name
            print(f"device: {name}", flush=True)

    failed: set[str] = set()  # variants whose batch 1 did not run at a shorter context
    for context in sorted(args.contexts):
        for variant in args.variants:
            print(f"- {variant} at {context:,} tokens ...", flush=True)
            if variant in failed:
                on_row({"variant": variant, "pattern": lcm.pattern_for(variant, args.num_layers),
                        "context": context, "batch": 1, "status": "not_run",
                        "detail": "batch 1 did not run at a shorter context"})
                continue
            if args.in_process:
                for r in run_point(args, variant, context, emit=lambda s: None):
                    on_row(r)
            else:
                _point_in_subprocess(argv, args, variant, context, rows, on_row, on_device)
            if not any(r["status"] == "ok" for r in rows.values()
                       if r["variant"] == variant and r["context"] == context):
                failed.add(variant)
            paths = write_outputs(list(rows.values()), args.out_dir, device[0], args)
    out = list(rows.values())
    print(format_tables(out, device[0], args))
    print("wrote " + ", ".join(paths.values()))
    return out


def _point_in_subprocess(argv, args, variant, context, rows, on_row, on_device) -> None:
    """One point in a fresh worker (``lcm.stream_worker``); a worker that dies or is killed turns
    the batch it was running into an oom (killed by the system), timeout or error row."""
    t0 = time.perf_counter()
    timeout = args.max_seconds + args.grace_seconds
    code, tail = lcm.stream_worker(__file__, [*argv, "--worker", f"--variant={variant}",
                                              f"--context={context}"], on_row, on_device, timeout)
    if code == 0:
        return
    timed_out = time.perf_counter() - t0 >= timeout
    print(f"  {variant} at {context}: worker exited with {code}: {tail[:300]}", flush=True)
    # Killed by the system (host memory), or aborted by the device allocator, is out of memory.
    oom = code in (-9, 137) or lcm.is_oom(RuntimeError(tail))
    status = "timeout" if timed_out else "oom" if oom else "error"
    mine = [r for r in rows.values() if r["variant"] == variant and r["context"] == context]
    running = [r for r in mine if r["status"] == "running"] or ([] if mine else [
        {"variant": variant, "pattern": lcm.pattern_for(variant, args.num_layers), "context": context,
         "batch": 1}])
    for r in running:
        on_row({**r, "status": status, "detail": f"worker exit code {code}"
                + (f" after {timeout:g} s" if timed_out else "") + f": {tail[:200]}"})


if __name__ == "__main__":
    main()
