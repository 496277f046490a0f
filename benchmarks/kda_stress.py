"""KDA kernel under model-like and extreme inputs: the Pallas kernel against impl="xla", forward
and all gradients, at a training shape (default that of configs/small.py: B=32, T=2048, H=12,
K=V=64, bf16 q/k/v, float32 g and beta, packed documents). Prints, per case, the relative error
of each output and the count of non-finite elements. A correctness probe for the GPU (CPU runs
the kernel in interpret mode: use a small --shape there).

    python benchmarks/kda_stress.py                  # GPU
    python benchmarks/kda_stress.py --shape 2,128,2,32
    python benchmarks/kda_stress.py --poison --tune hopper=0 --cases 4

The kernel is called directly (``pallas_kernels.kda.kda_pallas``, what ``kda(...,
impl="pallas")`` runs on finite inputs) so that --tune (launch parameters, ``tuning=``) and
--poison (every kernel output starts as NaN, ``poison=True``) reach it.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_k3.ops.kda import kda
from pallas_kernels import kda as pk
from pallas_kernels.tuning import KernelTuning

LB = -5.0
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def inputs(key, B, T, H, D, *, gate, doc_len, beta_mode, kind):
    ks = jax.random.split(key, 8)
    shape = (B, T, H, D)

    def unit(k):
        x = jax.nn.silu(jax.random.normal(k, shape, jnp.float32))
        return (x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)

    q, k = unit(ks[0]), unit(ks[1])
    if kind == "repeated_keys":  # one key for every token of a row: Akk entries near 1
        k = jnp.broadcast_to(k[:, :1], k.shape)
    v = jax.nn.silu(jax.random.normal(ks[2], shape, jnp.float32)).astype(jnp.bfloat16)
    x = jax.random.normal(ks[3], shape, jnp.float32)
    g = {"random": LB * jax.nn.sigmoid(2 * x), "at_bound": jnp.full(shape, LB),
         "near_zero": -1e-6 * jax.nn.sigmoid(x), "mixed": jnp.where(x > 0, LB, -1e-4)}[gate]
    beta = {"random": jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))),
            "one": jnp.ones((B, T, H)), "zero": jnp.zeros((B, T, H))}[beta_mode]
    seg = None
    if doc_len:
        cuts = jax.random.bernoulli(ks[5], 1.0 / doc_len, (B, T)).astype(jnp.int32)
        seg = jnp.cumsum(cuts, axis=1)
    return q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), seg, ks[6]


def ours(q, k, v, g, beta, seg, *, tuning, poison):
    """o [B, T, H, D] of the Pallas kernel."""
    return pk.kda_pallas(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=None,
                         segment_ids=seg, chunk_size=64, lower_bound=LB, tuning=tuning,
                         poison=poison)[0]


def xla(q, k, v, g, beta, seg):
    """o [B, T, H, D] of impl="xla", the reference."""
    return kda(q, k, v, g, beta, segment_ids=seg, lower_bound=LB, impl="xla")[0]


def run(attend, q, k, v, g, beta, seg, do):
    """(o, dq, dk, dv, dg, dbeta) of ``attend(q, k, v, g, beta, seg) -> o``; the gradients are
    those of sum(o * do)."""
    def loss(q, k, v, g, beta):
        o = attend(q, k, v, g, beta, seg)
        return jnp.sum(o.astype(jnp.float32) * do), o

    (_, o), grads = jax.value_and_grad(loss, argnums=range(5), has_aux=True)(q, k, v, g, beta)
    return (o, *grads)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32,2048,12,64", help="B,T,H,D")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=0, help="run only the first N cases")
    ap.add_argument("--poison", action="store_true",
                    help="every kernel output starts as NaN (an unwritten element shows)")
    ap.add_argument("--tune", default="",
                    help="launch parameters changed from the defaults, e.g. "
                         "hopper=0 (pallas_kernels.tuning.KernelTuning)")
    args = ap.parse_args(argv)
    B, T, H, D = (int(x) for x in args.shape.split(","))
    dev = jax.devices()[0]
    tuning = KernelTuning.parse(args.tune, source="--tune")
    print(f"device {dev.device_kind}, jax {jax.__version__}, B,T,H,D = {B},{T},{H},{D}, "
          f"tuning {tuning}, poison {args.poison}")
    cases = [("random", 0, "random", "plain", 1.0), ("random", 100, "random", "plain", 1.0),
             ("at_bound", 100, "random", "plain", 1.0), ("near_zero", 100, "random", "plain", 1.0),
             ("mixed", 100, "one", "plain", 1.0), ("random", 3, "random", "plain", 1.0),
             ("random", 100, "random", "plain", 1e-5), ("at_bound", 100, "random", "plain", 1e-5),
             ("random", 100, "one", "repeated_keys", 1.0), ("random", 100, "zero", "plain", 1.0),
             ("near_zero", 100, "one", "repeated_keys", 1.0)]
    if args.cases:
        cases = cases[: args.cases]
    worst = 0.0
    attend = {"pallas": functools.partial(ours, tuning=tuning, poison=args.poison), "xla": xla}
    fns = {impl: jax.jit(functools.partial(run, fn)) for impl, fn in attend.items()}
    for i, (gate, doc_len, beta_mode, kind, do_scale) in enumerate(cases):
        q, k, v, g, beta, seg, kd = inputs(jax.random.PRNGKey(args.seed + i), B, T, H, D,
                                           gate=gate, doc_len=doc_len, beta_mode=beta_mode,
                                           kind=kind)
        do = (do_scale * jax.random.normal(kd, v.shape, jnp.float32)).astype(jnp.float32)
        seg_arg = seg if seg is not None else jnp.zeros((B, T), jnp.int32)
        got = fns["pallas"](q, k, v, g, beta, seg_arg, do)
        again = fns["pallas"](q, k, v, g, beta, seg_arg, do)
        ref = fns["xla"](q, k, v, g, beta, seg_arg, do)
        same = all(bool(jnp.array_equal(a, b, equal_nan=True)) for a, b in zip(got, again, strict=True))
        parts = []
        for name, a, b in zip(NAMES, got, ref, strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            bad = int(np.sum(~np.isfinite(a)))
            err = float(np.linalg.norm(np.nan_to_num(a - b)) / max(np.linalg.norm(b), 1e-30))
            worst = max(worst, err if not bad else np.inf)
            parts.append(f"{name} {err:.1e}" + (f" NONFINITE {bad}" if bad else ""))
        print(f"gate={gate:9s} doc_len={doc_len:3d} beta={beta_mode:6s} {kind:13s} "
              f"do_scale={do_scale:g}: " + ", ".join(parts)
              + ("" if same else "  NOT DETERMINISTIC (two calls differ)"), flush=True)
    print(f"worst relative error {worst:.2e}")


if __name__ == "__main__":
    main()
