"""KDA kernel speed: forward and forward+backward, ours (the Pallas kernel) vs impl="xla", fla, jla.

    python benchmarks/kda_kernel.py                      # the table of BENCHMARKS.md (GPU)
    python benchmarks/kda_kernel.py --shapes 8x4096,small --no_xla   # + configs/small.py's
    python benchmarks/kda_kernel.py --shapes 8x4096 --no_xla --breakdown --sweep 8x4096
    python benchmarks/kda_kernel.py --sweep 8x4096 --variants "bk=64;bv_intra=128" --adopt
    python benchmarks/kda_kernel.py --tune bk=16,warps_grad=8 --shapes 8x4096
    python benchmarks/kda_kernel.py --shapes 8x4096 --documents 3000 --sweep 8x4096 \
        --variants "hopper=0"   # rows of ~1.3 documents, as configs/1b.py trains on: ours only
    python benchmarks/kda_kernel.py --no_xla --fla_tuning benchmarks/results/fla_autotune_h200.tgz
        # fla's autotuning results from earlier runs (copy the file back from the card after)

Ours is ``pallas_kernels.kda.kda_pallas``, what ``kda(..., impl="pallas")`` runs for these
inputs, called with an explicit ``tuning=``: ``KernelTuning()`` changed by --tune (on a Hopper
card its default takes the Mosaic GPU kernels; --variants "hopper=0" times the Triton ones);
--sweep times variants of it, and --adopt measures the table with the fastest.

Inputs: bf16 q, k (L2-normalised), v, beta (sigmoid); float32 bounded gate g = -5 sigmoid(x)
(K3's gate); H = HV = 16, K = V = 128 (configs/1b.py's; 8 x 4096 is its micro-batch of 8 rows),
and for "small" configs/small.py's 32 x 2048 with H = 12, K = V = 64. Forward+backward is o
and the gradients of the cotangent do with respect to all five inputs, as fla's
``torch.autograd.grad(o, inputs, do)`` (--sum_loss: sum(o * do) and its gradients instead).
Every time (ours, jla, xla and fla) is benchmarks/timing.py's: compilation (fla: autotuning) and
warm-up left out, then the median over batches of calls enqueued back to back, one wait per
batch (``jax.block_until_ready``; fla's ``torch.cuda.synchronize``), so the card stays busy
between calls.

"ours, gate in kernel" is the same kernel fed the gate's logits f and its parameters (A_log,
dt_bias) instead of g: the kernel computes g = -5 sigmoid(exp(A_log) (f + dt_bias)) itself
(issue #19), and its forward+backward includes the gradient with respect to f.

Peers, in the same process on the same card, each when importable (they are not project
dependencies; carry their wheels): fla's ``chunk_kda(..., safe_gate=True, lower_bound=-5)``
(fla-core, PyTorch + Triton) and jla's Mosaic GPU KDA (jax-linear-attention,
``jla.ops.mosaic_gpu.kda.kda``; Python 3.12, sm_90). A peer that is missing or fails leaves
"—" in its columns. Writes a markdown table (--out) and prints it.

--documents L packs every row with documents of about L tokens (segment ids, as the trainer's
rows of packed documents; lengths drawn from an exponential law with mean L, at least 16):
ours, the gate in the kernel and --sweep take them; the peers and impl="xla" are skipped
(they would compute another function), as is --breakdown.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tarfile
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import timing
from kimi_k3.ops.kda import kda
from pallas_kernels import kda as pk
from pallas_kernels import kda_calls as calls
from pallas_kernels.tuning import KernelTuning

# name -> (B, T, H, D): batch, tokens, heads (HV = H), head dim (K = V = D).
SHAPES = {"8x4096": (8, 4096, 16, 128), "2x16384": (2, 16384, 16, 128),
          "1x65536": (1, 65536, 16, 128), "1x262144": (1, 262144, 16, 128),
          "small": (32, 2048, 12, 64), "smoke": (1, 128, 2, 64)}
LOWER = -5.0


def make_inputs(B, T, H=16, D=128, seed=0):
    """Device arrays: q, k, v, beta, do in bf16 (q, k L2-normalised), g float32 in [-5, 0)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    shape = (B, T, H, D)

    def unit(key):
        x = jax.random.normal(key, shape, jnp.float32)
        return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)

    q, k = unit(ks[0]), unit(ks[1])
    v = jax.random.normal(ks[2], shape, jnp.bfloat16)
    g = LOWER * jax.nn.sigmoid(jax.random.normal(ks[3], shape, jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32)).astype(jnp.bfloat16)
    do = jax.random.normal(ks[5], shape, jnp.bfloat16)
    return jax.block_until_ready((q, k, v, g, beta, do))


def document_ids(B: int, T: int, mean_len: int, seed: int = 2):
    """segment_ids [B, T] int32: each row packed with documents numbered 1, 2, ... whose
    lengths are drawn from an exponential law of mean ``mean_len`` (at least 16 tokens)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        lengths = []
        while sum(lengths) < T:
            lengths.append(max(16, int(rng.exponential(mean_len))))
        rows.append(np.repeat(np.arange(1, len(lengths) + 1), lengths)[:T])
    return jnp.asarray(np.stack(rows), jnp.int32)


def xla_fwd(q, k, v, g, beta):
    """o [B, T, H, D] of impl="xla"."""
    return kda(q, k, v, g, beta, lower_bound=LOWER, impl="xla")[0]


def ours_fwd(tuning: KernelTuning, segs=None):
    """(q, k, v, g, beta) -> o [B, T, H, D] of the Pallas kernel launched with ``tuning``, over
    the documents ``segs`` [B, T] (None: one document per row)."""
    return functools.partial(_ours, tuning=tuning, segs=segs)


def _ours(q, k, v, g, beta, *, tuning, segs):
    return pk.kda_pallas(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=None,
                         segment_ids=segs, chunk_size=64, lower_bound=LOWER, tuning=tuning)[0]


def gate_inputs(arrays, seed=1):
    """The gate's logits f [B, T, H, D] float32 and parameters A_log [H], dt_bias [H, D]."""
    q = arrays[0]
    H, D = q.shape[2:]
    kf, ka, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    f = jax.random.normal(kf, q.shape, jnp.float32)
    A_log = jnp.log(jax.random.uniform(ka, (H,), jnp.float32, 1.0, 16.0))
    dt_bias = 0.1 * jax.random.normal(kb, (H, D), jnp.float32)
    return f, A_log, dt_bias


def ours_gate_in_kernel(tuning: KernelTuning, A_log, dt_bias, segs=None):
    """(q, k, v, f, beta) -> o of the Pallas kernel computing the bounded gate from f itself."""
    def fwd(q, k, v, f, beta):
        return pk.kda_pallas(q, k, v, f, beta, scale=q.shape[-1] ** -0.5, initial_state=None,
                             segment_ids=segs, chunk_size=64, lower_bound=LOWER, tuning=tuning,
                             A_log=A_log, dt_bias=dt_bias)[0]
    return fwd


def jla_fwd():
    """(q, k, v, g, beta) -> o of jla's Mosaic GPU KDA, or None (printed why) if unavailable."""
    try:  # optional: jax-linear-attention is not a project dependency
        from jla.ops.mosaic_gpu.kda import kda as jla_kda
    except Exception as err:
        print(f"jla unavailable: {err}")
        return None
    return lambda q, k, v, g, beta: jla_kda(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]


def jax_fns(fwd, sum_loss: bool = False):
    """Jitted forward and forward+backward: o and the gradients in all five inputs of the
    cotangent do, the work of fla's ``torch.autograd.grad(o, inputs, do)``.

    o is returned, as a training step uses it: with gradients alone XLA drops whatever computes
    only o (a kernel that makes nothing else), and the time would leave it out. ``sum_loss``
    (--sum_loss): the value and gradients of sum(o * do) instead, which adds an XLA reduction
    over o and do that fla's time does not hold."""
    if sum_loss:
        def loss(q, k, v, g, beta, do):
            o = fwd(q, k, v, g, beta)
            return jnp.sum(o.astype(jnp.float32) * do)

        return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

    def fwdbwd(q, k, v, g, beta, do):
        o, vjp = jax.vjp(fwd, q, k, v, g, beta)
        return o, vjp(do.astype(o.dtype))

    return jax.jit(fwd), jax.jit(fwdbwd)


def bench_jax(fwd, arrays, sum_loss: bool = False):
    """(forward, forward+backward) median ms of ``fwd(q, k, v, g, beta) -> o`` (``jax_fns``)."""
    fwd, fwdbwd = jax_fns(fwd, sum_loss)
    q, k, v, g, beta, do = arrays
    t_f = timing.time_jax(fwd, q, k, v, g, beta).ms
    t_fb = timing.time_jax(fwdbwd, q, k, v, g, beta, do).ms
    return t_f, t_fb


def restore_fla_tuning(path: str) -> str:
    """Points Triton's cache (TRITON_CACHE_DIR) at a fresh directory holding the autotuning
    results in ``path`` (a .tgz of ``save_fla_tuning``; none yet: an empty one), and returns it.

    fla autotunes each kernel on first use and, with Triton's ``cache_results``, keeps the
    winner as ``<hash>/<kernel>.autotune.json`` in that cache; on a fresh machine the tuning
    takes minutes per head shape. The hash covers Triton's and fla's versions, the
    card and the tuning key, so results from the same software on the same card are reused and
    anything else is tuned anew. Call before fla (and so Triton) first runs."""
    cache = tempfile.mkdtemp(prefix="triton_cache_")
    if os.path.exists(path):
        try:
            with tarfile.open(path) as tar:
                members = [m for m in tar.getmembers()
                           if m.isfile() and m.name.endswith(".autotune.json")
                           and not m.name.startswith("/") and ".." not in m.name.split("/")]
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(cache, members=members, **safe)
        except (tarfile.TarError, OSError) as err:
            raise SystemExit(f"--fla_tuning: {path} is not a readable .tgz of autotuning "
                             f"results ({err}); give another path, or none to tune afresh") from None
        print(f"fla tuning: {len(members)} results from {path}", flush=True)
    os.environ["TRITON_CACHE_DIR"] = cache
    return cache


def save_fla_tuning(cache: str, path: str) -> int:
    """Writes every ``*.autotune.json`` under ``cache`` to the .tgz ``path`` (paths relative to
    the cache); returns how many."""
    found = sorted(Path(cache).glob("*/*.autotune.json"))
    with tarfile.open(path, "w:gz") as tar:
        for f in found:
            tar.add(f, arcname=str(f.relative_to(cache)))
    return len(found)


def fla_fns(arrays):
    """fla's chunk_kda on ``arrays`` (make_inputs): () -> o without gradients, and () -> the
    gradients of sum(o * do) in all five inputs. Needs torch and fla-core (ImportError)."""
    import torch
    from fla.ops.kda import chunk_kda

    # The same device buffers, shared through DLPack (copied so autograd owns its leaves).
    tq, tk, tv, tg, tb = (torch.from_dlpack(x).clone().requires_grad_() for x in arrays[:5])
    tdo = torch.from_dlpack(arrays[5]).clone()

    def fwd():
        with torch.no_grad():
            return chunk_kda(tq, tk, tv, tg, tb, safe_gate=True, lower_bound=LOWER)[0]

    def fwdbwd():
        o = chunk_kda(tq, tk, tv, tg, tb, safe_gate=True, lower_bound=LOWER)[0]
        return torch.autograd.grad(o, (tq, tk, tv, tg, tb), tdo)

    return fwd, fwdbwd


def bench_fla(arrays):
    """(forward, forward+backward) median ms of fla's chunk_kda, or None (printed why) if fla
    cannot be imported."""
    try:  # optional: torch, triton and fla-core are not project dependencies
        import torch
        fwd, fwdbwd = fla_fns(arrays)
    except Exception as err:
        print(f"fla unavailable: {err}")
        return None
    t_f = timing.time_torch(fwd).ms
    t_fb = timing.time_torch(fwdbwd).ms
    torch.cuda.empty_cache()
    return t_f, t_fb


def breakdown(name, arrays, tuning: KernelTuning):
    """Median ms of each kernel of ours, launched with ``tuning`` (printed as each finishes)."""
    q, k, v, g, beta, do = arrays
    B, _, H, D = q.shape
    cfg = pk.make_config(q, v, scale=D ** -0.5, segment_ids=None, chunk_size=64,
                         lower_bound=LOWER, mode=pk._resolve_mode(None, None), tuning=tuning)
    h0t = pk._state_to_kernel(jnp.zeros((B, H, D, D), jnp.float32), cfg)
    qp, kp, vp, gp, bp, _ = pk._prep(q, k, v, g, beta, None, cfg)
    dop = do.astype(v.dtype)

    def timed(label, fn, *a):
        out, first = timing.first_call(fn, *a)  # compiles; its outputs feed the next kernels
        t = timing.time_jax(fn, *a, warmup=1)
        print(f"  {name} {label}: {t.ms:.3f} ms (first call {first:.1f} s)", flush=True)
        return out

    W, U, QG, Kg, Aqk, gam = timed("intra_fwd", jax.jit(
        lambda *a: calls.intra_fwd(cfg, *a, ())), qp, kp, vp, gp, bp)
    *_, G, Akk, Tinv = timed("intra_fwd+residuals", jax.jit(
        lambda *a: calls.intra_fwd(cfg, *a, (), residuals=True)), qp, kp, vp, gp, bp)
    timed("state_fwd", jax.jit(lambda *a: calls.state_fwd(
        cfg, *a, out_dtype=v.dtype, residuals=False)), W, U, QG, Kg, Aqk, gam, h0t)
    _, _, h, Vp = timed("state_fwd+residuals", jax.jit(lambda *a: calls.state_fwd(
        cfg, *a, out_dtype=v.dtype, residuals=True)), W, U, QG, Kg, Aqk, gam, h0t)
    dh, dVp, _ = timed("state_bwd", jax.jit(lambda *a: calls.state_bwd(cfg, *a)),
                       dop, W, QG, Kg, Aqk, gam, h0t)
    timed("intra_bwd", jax.jit(lambda *a: calls.intra_bwd(
        cfg, qp, kp, vp, G, bp, (), *a, dqk_dtype=q.dtype, dv_dtype=v.dtype,
        dg_dtype=g.dtype)), W, U, Akk, Tinv, h, dh, Vp, dVp, dop)
    dv, _, *dA = timed("  intra_bwd_scores", jax.jit(lambda *a: calls.intra_bwd_scores(
        cfg, kp, vp, G, bp, (), *a, dv_dtype=v.dtype)), W, U, Akk, Tinv, h, Vp, dVp, dop)
    timed("  intra_bwd_channels", jax.jit(lambda dA, *a: calls.intra_bwd_channels(
        cfg, qp, kp, G, (), dA, *a, dqk_dtype=q.dtype, dg_dtype=g.dtype)),
        dA, h, dh, Vp, dop, dv)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x4096,2x16384,1x65536,1x262144",
                    help="comma list of keys of SHAPES")
    ap.add_argument("--no_xla", action="store_true", help="skip impl='xla'")
    ap.add_argument("--no_fla", action="store_true", help="skip fla")
    ap.add_argument("--no_jla", action="store_true", help="skip jla")
    ap.add_argument("--no_gate_in_kernel", action="store_true",
                    help="skip ours with the gate computed in the kernel")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-kernel times of ours (first shape)")
    ap.add_argument("--breakdown_only", action="store_true", help="only the per-kernel times")
    ap.add_argument("--sweep", default="", help="a shape key: try launch parameters there")
    ap.add_argument("--variants", default=SWEEP,
                    help="';'-separated launch-parameter changes from --tune's, each like "
                         "--tune, for --sweep (default: %(default)s)")
    ap.add_argument("--tune", default="",
                    help="launch parameters changed from the defaults, e.g. "
                         "bv_seq=16,warps_seq=4 (pallas_kernels.tuning.KernelTuning)")
    ap.add_argument("--adopt", action="store_true",
                    help="run --sweep first and measure the table with its fastest forward+backward "
                         "(the defaults included)")
    ap.add_argument("--documents", type=int, default=0,
                    help="pack the rows with documents of about this many tokens (ours only)")
    ap.add_argument("--sum_loss", action="store_true",
                    help="JAX forward+backward as the value and gradients of sum(o * do) (an "
                         "XLA reduction more than fla's time holds)")
    ap.add_argument("--out", default="", help="write the markdown table here")
    ap.add_argument("--fla_tuning", default="",
                    help="a .tgz of fla's autotuning results: read before fla runs (if it "
                         "exists), written back after each shape (see restore_fla_tuning)")
    args = ap.parse_args(argv)
    jax_times = functools.partial(bench_jax, sum_loss=args.sum_loss)
    triton_cache = restore_fla_tuning(args.fla_tuning) if args.fla_tuning else None
    if args.documents < 0 or (args.documents and (args.breakdown or args.breakdown_only)):
        ap.error(f"--documents must be 0 or a positive length, without --breakdown; got "
                 f"{args.documents}{' with --breakdown' * (args.breakdown or args.breakdown_only)}")
    packed = args.documents > 0
    segs_of = lambda name: (document_ids(*SHAPES[name][:2], args.documents) if packed else None)
    dev = jax.devices()[0]
    tuning = KernelTuning.parse(args.tune, source="--tune")
    variants = parse_variants(args.variants, tuning) if args.sweep else []
    print(f"device: {dev.device_kind}, jax {jax.__version__}, tuning {tuning}", flush=True)

    names = args.shapes.split(",")
    results = {n: dict.fromkeys(COLUMNS) for n in names}

    def report():
        table = format_table(dev, results, tuning, args.documents)
        print(table, flush=True)
        if args.out:
            Path(args.out).write_text(table + "\n")

    if args.adopt and args.sweep:
        candidates = [(args.tune or "defaults", tuning), *variants]
        times = sweep(args.sweep, make_inputs(*SHAPES[args.sweep]), candidates,
                      segs_of(args.sweep), args.sum_loss)
        if not times:
            raise SystemExit(f"--adopt: every variant failed at {args.sweep}")
        label, tuning = candidates[min(times, key=lambda i: times[i][1])]
        print(f"adopted {label}: tuning {tuning}", flush=True)
    if args.breakdown_only:
        for name in names:
            breakdown(name, make_inputs(*SHAPES[name]), tuning)
        return
    if packed:
        print(f"rows of packed documents (mean {args.documents} tokens): ours only", flush=True)
    jla = None if args.no_jla or packed else jla_fwd()

    def measure(name, column, bench, *bench_args):
        """One cell, bench(*bench_args): a failure is printed and leaves the cell empty."""
        try:
            results[name][column] = bench(*bench_args)
        except Exception as err:
            print(f"  {column} {name} failed: {str(err).splitlines()[0][:200]}")
        print(f"{name}: {column} fwd / fwd+bwd {fmt(results[name][column])} ms", flush=True)

    for i, name in enumerate(names):  # shape by shape, so a run cut short keeps whole rows
        arrays, segs = make_inputs(*SHAPES[name]), segs_of(name)
        results[name]["ours"] = jax_times(ours_fwd(tuning, segs), arrays)
        print(f"{name}: ours fwd / fwd+bwd {fmt(results[name]['ours'])} ms", flush=True)
        if args.breakdown and i == 0:  # every kernel compiles again: the first shape only
            breakdown(name, arrays, tuning)
        if not args.no_gate_in_kernel:
            f, A_log, dt_bias = gate_inputs(arrays)
            measure(name, "ours_gk", jax_times,
                    ours_gate_in_kernel(tuning, A_log, dt_bias, segs), (*arrays[:3], f, *arrays[4:]))
        if jla is not None:
            measure(name, "jla", jax_times, jla, arrays)
        # fla last of the peers: it autotunes its kernels on first use, which on a fresh
        # machine takes minutes, so a run cut short keeps jla's cells
        if not args.no_fla and not packed:
            measure(name, "fla", bench_fla, arrays)
            if triton_cache:
                save_fla_tuning(triton_cache, args.fla_tuning)
        if not args.no_xla and not packed:
            measure(name, "xla", jax_times, xla_fwd, arrays)
        del arrays
        report()
    if args.sweep and not args.adopt:  # last: a run cut short still has the table
        sweep(args.sweep, make_inputs(*SHAPES[args.sweep]), variants, segs_of(args.sweep),
              args.sum_loss)


# The default --variants: one launch parameter changed at a time.
SWEEP = "bv_seq=32;bv_seq=64;warps_seq=8;bk=64;bk_fwd=32;warps_grad=8;stages_seq=3;hopper=0"


def parse_variants(spec: str, base: KernelTuning) -> list[tuple[str, KernelTuning]]:
    """"bk=64;bv_intra=128" -> [("bk=64", base with bk=64), ("bv_intra=128", ...)], each
    item checked like --tune (before anything is timed)."""
    return [(item, KernelTuning.parse(item, base=base, source="--variants"))
            for item in spec.split(";") if item]


def sweep(name, arrays, variants, segs=None, sum_loss=False) -> dict[int, tuple[float, float]]:
    """Times of ours with each (label, tuning) of ``variants`` (over the documents ``segs``):
    {index: (fwd, fwd+bwd) ms} (``sum_loss``: as ``jax_fns``)."""
    times = {}
    for i, (label, tuning) in enumerate(variants):
        try:
            times[i] = t = bench_jax(ours_fwd(tuning, segs), arrays, sum_loss)
            print(f"  sweep {name} {label}: fwd {t[0]:.3f} ms, fwd+bwd {t[1]:.3f} ms", flush=True)
        except Exception as err:
            print(f"  sweep {name} {label}: failed {str(err).splitlines()[0][:200]}")
    return times


def fmt(t):
    return "—" if t is None else f"{t[0]:.2f} / {t[1]:.2f}"


# The table's columns: ours (g given), ours with the gate in the kernel, the peers, impl="xla".
COLUMNS = ("ours", "ours_gk", "fla", "jla", "xla")
HEADERS = {"ours": "ours", "ours_gk": "ours, gate in kernel", "fla": "fla", "jla": "jla",
           "xla": "xla"}


def format_table(dev, results, tuning: KernelTuning, documents: int = 0):
    """Markdown: per shape, forward / forward+backward ms of every column, and the speed-ups of
    ours (and ours with the gate in the kernel) over fla and jla: peer time / our time."""
    rows = (f"rows of packed documents of ~{documents} tokens (ours only)" if documents
            else "one document per row")
    lines = [
        f"Card: {dev.device_kind}; JAX {jax.__version__}; bf16 q/k/v/beta, fp32 bounded gate "
        f"(lower_bound={LOWER}); K = V = head dim; {rows}. Times in ms (median), forward / "
        "forward+backward; Mtok/s = B*T / time; \"x fla\" = fla's time / ours.",
        "",
        f"Our launch parameters: {tuning}",
        "",
        "| B x T, H x D | " + " | ".join(HEADERS[c] for c in COLUMNS)
        + " | ours Mtok/s | ours x fla | ours x jla | gate in kernel x fla "
        "| gate in kernel x jla |",
        "|---|" + "---|" * (len(COLUMNS) + 5),
    ]
    for name, r in results.items():
        ours = r.get("ours")
        if ours is None:
            continue
        B, T, H, D = SHAPES[name]
        cells = [fmt(r.get(c)) for c in COLUMNS]
        mt = f"{B * T / ours[0] / 1e3:.1f} / {B * T / ours[1] / 1e3:.1f}"
        ratios = [speedup(r.get(peer), r.get(mine))
                  for mine in ("ours", "ours_gk") for peer in ("fla", "jla")]
        lines.append(f"| {B} x {T}, {H} x {D} | " + " | ".join(cells) + f" | {mt} | "
                     + " | ".join(ratios) + " |")
    return "\n".join(lines)


def speedup(peer, mine) -> str:
    """"fwd / fwd+bwd" of peer time / our time, "—" when either is missing."""
    if peer is None or mine is None:
        return "—"
    return f"{peer[0] / mine[0]:.2f}x / {peer[1] / mine[1]:.2f}x"


if __name__ == "__main__":
    main()
