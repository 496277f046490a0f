"""intra_fwd, intra_bwd_scores and intra_bwd_channels speed: the Mosaic GPU kernels
(pallas_kernels/kda_mgpu.py, kda_mgpu_bwd.py) against the Triton ones.

    python benchmarks/kda_mgpu_intra.py                    # B=8, T=4096, H=HV=16, K=V=128 (H200)
    python benchmarks/kda_mgpu_intra.py --forward          # + the whole kda_pallas forward
    python benchmarks/kda_mgpu_intra.py --backward         # intra_bwd_channels and
                                                           #   intra_bwd_scores, and the whole
                                                           #   kda_pallas gradient, only
    python benchmarks/kda_mgpu_intra.py --smoke            # tiny, interpret mode (any machine)

Inputs as benchmarks/kda_kernel.py's: bf16 q, k (L2-normalised), v; beta = sigmoid(x) and the
bounded gate g = -5 sigmoid(x) in --gate-dtype (float32 by default, what the model passes).
Both kernels get the same padded kernel-layout arguments (kda._prep) and the same KdaConfig
(default KernelTuning). Each time is the median (and min) of --iters device-synchronised calls
(jax.block_until_ready) after --warmup calls; "max rel diff" is the largest over outputs of
||mgpu - triton|| / ||triton||. Prints a markdown table. Needs a Hopper (sm_90) GPU (or --smoke).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kda_kernel import make_inputs as kernel_inputs
from pallas_kernels import kda as pk
from pallas_kernels import kda_calls as calls
from pallas_kernels import kda_mgpu, kda_mgpu_bwd
from pallas_kernels.kda import KernelTuning


def make_inputs(B, T, H, D, gate_dtype, seed=0):
    """kda_kernel.py's inputs (q, k L2-normalised, v, the bounded gate g, beta), with g and beta
    in ``gate_dtype``."""
    q, k, v, g, beta, _ = kernel_inputs(B, T, H, D, seed)
    return q, k, v, g.astype(gate_dtype), beta.astype(gate_dtype)


def timed(fn, args, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


@jax.jit
def _rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def rel(a, b):
    """||a - b|| / ||b||, on the device (the outputs are GBs at the default shape)."""
    return float(_rel(a, b))


def channels_inputs(cfg, kargs, G, seed=1):
    """intra_bwd_channels' arguments after cfg: q, k and the forward's G (the Triton
    intra_fwd), random bf16 h, dh, V', dO, dv and score gradients (dAqk lower triangular, dAkk
    strictly, and their transposes)."""
    qp, kp = kargs[:2]
    BHV, N, C, K, V = cfg.B * cfg.HV, cfg.N, cfg.C, cfg.K, cfg.V
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 8))

    def rand(*shape):
        return jax.random.normal(next(ks), shape, jnp.bfloat16)

    dA = [jnp.tril(rand(BHV, N, C, C), -i) for i in (0, 1)]
    dA += [jnp.swapaxes(x, -1, -2) for x in dA]
    return (qp, kp, G, (), dA, rand(BHV, N, V, K), rand(BHV, N, V, K), rand(BHV, N, C, V),
            rand(cfg.B, N * C, cfg.HV, V), rand(cfg.B, N * C, cfg.HV, V))


def backward_rows(args, cfg, kargs, inputs, mode, interpret):
    """Table rows: intra_bwd_channels alone (bf16 dq, dk as for H = HV; float32 dg as for a
    float32 g), intra_bwd_scores alone, and the whole kda_pallas gradient."""
    qp, kp, vp, gp, bp = kargs
    W, U, _, _, _, _, G, Akk, Tinv = calls.intra_fwd(cfg, qp, kp, vp, gp, bp, (), residuals=True)
    cargs = channels_inputs(cfg, kargs, G)
    kw = dict(dqk_dtype=jnp.bfloat16, dg_dtype=kargs[3].dtype)
    tri_cfg = dataclasses.replace(cfg, hopper=0)
    # the four matrices alone, unscaled, as the Mosaic GPU kernel reads them (calls.bwd_config)
    chan_cfg = dataclasses.replace(tri_cfg, bwd_rows=0)
    tri = jax.jit(lambda *a: calls.intra_bwd_channels(chan_cfg, *a, **kw), static_argnums=3)
    mg = jax.jit(lambda *a: kda_mgpu_bwd.intra_bwd_channels(cfg, *a, **kw, interpret=interpret),
                 static_argnums=3)
    t_tri = timed(tri, cargs, args.warmup, args.iters)
    t_mg = timed(mg, cargs, args.warmup, args.iters)
    diff = max(rel(a, b) for a, b in zip(mg(*cargs), tri(*cargs), strict=True))
    rows = [("intra_bwd_channels", t_tri, t_mg, diff)]

    h, _, Vp, dO, _ = cargs[5:]
    dVp = jax.random.normal(jax.random.PRNGKey(2), Vp.shape, Vp.dtype)
    sargs = (kp, vp, G, bp, (), W, U, Akk, Tinv, h, Vp, dVp, dO)
    tri = jax.jit(lambda *a: calls.intra_bwd_scores(tri_cfg, *a, dv_dtype=jnp.bfloat16),
                  static_argnums=4)
    mg = jax.jit(lambda *a: kda_mgpu_bwd.intra_bwd_scores(cfg, *a, dv_dtype=jnp.bfloat16,
                                                          interpret=interpret),
                 static_argnums=4)
    t_tri = timed(tri, sargs, args.warmup, args.iters)
    t_mg = timed(mg, sargs, args.warmup, args.iters)
    diff = max(rel(a, b) for a, b in zip(mg(*sargs), tri(*sargs), strict=True))
    rows.append(("intra_bwd_scores", t_tri, t_mg, diff))

    def grad(hopper):
        def loss(q, k, v, g, beta):
            o, S = pk.kda_pallas(q, k, v, g, beta, scale=args.D ** -0.5, initial_state=None,
                                 segment_ids=None, chunk_size=64, lower_bound=-5.0,
                                 backend=mode, tuning=KernelTuning(hopper=hopper))
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
        return jax.jit(jax.grad(loss, argnums=range(5)))

    t_tri = timed(grad(0), inputs, args.warmup, args.iters)
    for name, bits in (("kda_pallas gradient (fwd + bwd), Hopper's default: bwd scores",
                        pk.HOPPER_BWD_SCORES), ("kda_pallas gradient (fwd + bwd), all three",
                                                pk.HOPPER_ALL)):
        t_mg = timed(grad(bits), inputs, args.warmup, args.iters)
        diff = max(rel(a, b) for a, b in zip(grad(bits)(*inputs), grad(0)(*inputs), strict=True))
        rows.append((name, t_tri, t_mg, diff))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--gate-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--forward", action="store_true",
                    help="also time kda_pallas's forward (o, S) with hopper=0 and HOPPER_ALL")
    ap.add_argument("--backward", action="store_true",
                    help="also time intra_bwd_channels and intra_bwd_scores (inputs: the "
                         "forward's residuals, random state-pass tensors) and kda_pallas's "
                         "gradient: hopper=0 against HOPPER_BWD_SCORES (Hopper's default) "
                         "and HOPPER_ALL")
    ap.add_argument("--smoke", action="store_true",
                    help="B=1, T=128, H=1, interpret modes, 1 iteration: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.B, args.T, args.H, args.warmup, args.iters = 1, 128, 1, 0, 1
        mode, interpret = "interpret", kda_mgpu.interpret_params()
    else:
        if not kda_mgpu.is_hopper():
            sys.exit(f"needs a Hopper (sm_90) GPU, got {jax.devices()[0].device_kind} "
                     "(--smoke runs it in interpret mode)")
        mode, interpret = "gpu", None

    q, k, v, g, beta = make_inputs(args.B, args.T, args.H, args.D, jnp.dtype(args.gate_dtype))
    cfg = pk.make_config(q, v, scale=args.D ** -0.5, segment_ids=None, chunk_size=64,
                         lower_bound=-5.0, mode=mode, tuning=pk.default_tuning())
    kargs = pk._prep(q, k, v, g, beta, None, cfg)[:5]
    why = kda_mgpu.unsupported_reason(cfg, *kargs)
    if why is not None:
        sys.exit(f"the Mosaic GPU kernel does not take this config: {why}")

    rows = []
    # --backward alone times the backward only (each compile costs seconds: under a minute)
    for residuals in (False, True) if args.forward or not args.backward else ():
        tri = jax.jit(lambda *a, r=residuals: calls.intra_fwd(cfg, *a, (), residuals=r))
        mg = jax.jit(lambda *a, r=residuals: kda_mgpu.intra_fwd(cfg, *a, residuals=r,
                                                                  interpret=interpret))
        t_tri = timed(tri, kargs, args.warmup, args.iters)
        t_mg = timed(mg, kargs, args.warmup, args.iters)
        diff = max(rel(a, b) for a, b in zip(mg(*kargs), tri(*kargs), strict=True))
        tag = "+ residuals" if residuals else "no residuals"
        rows.append((f"intra_fwd, {tag}", t_tri, t_mg, diff))

    if args.forward:
        def fwd(hopper):
            return jax.jit(lambda q, k, v, g, beta: pk.kda_pallas(
                q, k, v, g, beta, scale=args.D ** -0.5, initial_state=None, segment_ids=None,
                chunk_size=64, lower_bound=-5.0, backend=mode,
                tuning=KernelTuning(hopper=hopper)))
        t_tri = timed(fwd(0), (q, k, v, g, beta), args.warmup, args.iters)
        t_mg = timed(fwd(pk.HOPPER_ALL), (q, k, v, g, beta), args.warmup, args.iters)
        diff = rel(fwd(pk.HOPPER_ALL)(q, k, v, g, beta)[0], fwd(0)(q, k, v, g, beta)[0])
        rows.append(("kda_pallas forward (o, S)", t_tri, t_mg, diff))

    if args.backward:
        rows += backward_rows(args, cfg, kargs, (q, k, v, g, beta), mode, interpret)

    dev = jax.devices()[0].device_kind
    print(f"\nB={args.B} T={args.T} H=HV={args.H} K=V={args.D}, bf16 q/k/v, {args.gate_dtype} "
          f"g/beta, C=64, {dev}, median (min) of {args.iters} after {args.warmup} warm-up\n")
    print("| call | Triton ms | Mosaic GPU ms | speedup | max rel diff |")
    print("| --- | --- | --- | --- | --- |")
    for name, (tm, tmin), (mm, mmin), diff in rows:
        print(f"| {name} | {tm:.3f} ({tmin:.3f}) | {mm:.3f} ({mmin:.3f}) | {tm / mm:.2f}x "
              f"| {diff:.1e} |")


if __name__ == "__main__":
    main()
