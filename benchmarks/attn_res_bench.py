"""What the Attention Residual reads cost in a training step, apart from the sublayers.

    python benchmarks/attn_res_bench.py                        # configs/1b.py's depth, 4 x 4096
    python benchmarks/attn_res_bench.py --variants=model,fused,fused:2x8/2x8x8
    python benchmarks/attn_res_bench.py --batch=1 --seq=256 --width=256   # CPU

A stack shaped like configs/1b.py's (40 sublayers, blocks of 10, width 2048, bf16) in which
every sublayer is a read, its RMSNorm and one width x width matmul, each layer (two
sublayers) under the model's remat policy ("dots_kernels"), unrolled. It times forward +
backward of the whole stack (benchmarks/timing.py: median ms per call) with the depth mixing
of each variant below, and with the plain residual stream ("none"); the difference is what
the reads (with their norms) and writes cost. Every variant's loss and gradients are checked
against the first variant's.

Variants of the unrolled read (``DepthResidual._read_list``, then the norm):
  model        the read as kimi_k3.layers.attn_res writes it for XLA: the logits as matmuls
               with w (bf16 in, float32 out), each finished source's RMS computed once
  fused        the read and its norm as one Pallas kernel pass each way
               (``attn_res_impl="pallas"``, pallas_kernels/depth_read.py); ``fused:RxW/RxWxS``
               launches the forward / backward kernels with R rows at W warps (the backward's
               programs take S steps of R rows)
  dot          matmuls, every source's RMS recomputed by each read
  sum          the logits as float32 sums over the width, every source's RMS recomputed by
               each read (an earlier form of the model's read)
  barrier      model, with the read's output gradient behind a second optimisation barrier
  dot_barrier  dot, with the barrier
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kimi_k3.config import REMAT_POLICIES
from kimi_k3.layers.attn_res import DepthResidual, _inv_rms
from kimi_k3.layers.norms import _scaled_rms_norm
from pallas_kernels import depth_read

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for benchmarks/
from benchmarks import timing
from benchmarks.attention_bench import rel


@jax.custom_vjp
def gradient_barrier(x):
    """The identity; its cotangent passes an optimisation barrier (written out whole before
    anything reads it, so XLA cannot fuse its producer into its consumers)."""
    return x


gradient_barrier.defvjp(lambda x: (x, None), lambda _, ct: (jax.lax.optimization_barrier(ct),))


def _read_sum(self, sources, inv_rms, w_D):
    """Float32 sums with w, every source's RMS recomputed by each read (one pass each)."""
    del inv_rms
    w = w_D.astype(jnp.float32)
    return self._mix(sources, jnp.stack([
        jnp.sum(s.astype(jnp.float32) * w, axis=-1) * _inv_rms(s, self.eps) for s in sources]))


def _read_dot(self, sources, inv_rms, w_D):
    """Matmuls with w, every source's RMS recomputed by each read."""
    del inv_rms
    return self._mix(sources, jnp.stack([
        jnp.einsum("btd,d->bt", s, w_D.astype(s.dtype), preferred_element_type=jnp.float32)
        * _inv_rms(s, self.eps) for s in sources]))


_model_read = DepthResidual._read_list
READS = {
    "model": _model_read,
    "sum": _read_sum,
    "dot": _read_dot,
    "barrier": lambda self, *a: gradient_barrier(_model_read(self, *a)),
    "dot_barrier": lambda self, *a: gradient_barrier(_read_dot(self, *a)),
}


class _Norm:
    """RMSNorm with a given scale (what DepthResidual.read_norm takes)."""

    def __init__(self, scale_D, dtype):
        self.scale, self.eps, self.dtype = scale_D, 1e-6, dtype

    def __call__(self, x):
        return _scaled_rms_norm(x, self.scale, self.eps, jnp.dtype(self.dtype))


def _tiles(spec: str) -> tuple:
    """"RxW/RxW[xS]" -> (forward ReadTiles, backward ReadTiles): rows, warps and (backward)
    steps per program, the default's steps when not given."""
    fwd, bwd = ([int(v) for v in part.split("x")] for part in spec.split("/"))
    if len(bwd) == 2:
        bwd.append(depth_read.DEFAULT_BWD_TILES.steps)
    return depth_read.ReadTiles(*fwd), depth_read.ReadTiles(*bwd)


def build(num_layers: int, D: int, block: int, mode: str, dtype, impl: str = "xla"):
    depth = DepthResidual(mode, 2 * num_layers, block, impl=impl)
    policy = REMAT_POLICIES["dots_kernels"]

    def layer(p, state):
        for j in range(2):
            sub = jax.tree.map(lambda a, j=j: a[j], p["sub"])
            x = depth.read_norm(state, p["query"][j] if mode != "none" else None,
                                _Norm(sub["scale"], dtype))
            out = jnp.dot(x, sub["w"], preferred_element_type=jnp.float32).astype(dtype)
            state = depth.write(state, out)
        return state

    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def loss(params, x_BxTxD):
        state = depth.init(x_BxTxD, unrolled=True)
        for p in params["layers"]:
            state = layer(p, state)
        out = depth.read(state, params["final"] if mode != "none" else None)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss))


def init_params(key, num_layers: int, D: int, dtype):
    layers = []
    for k in jax.random.split(key, num_layers):
        k1, k2, k3 = jax.random.split(k, 3)
        layers.append({
            "query": 0.02 * jax.random.normal(k1, (2, D), jnp.float32),
            "sub": {"scale": 1.0 + 0.1 * jax.random.normal(k2, (2, D), jnp.float32),
                    "w": (jax.random.normal(k3, (2, D, D), jnp.float32) / np.sqrt(D)).astype(dtype)},
        })
    return {"layers": layers, "final": 0.02 * jax.random.normal(key, (D,), jnp.float32)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--block", type=int, default=10, help="sublayers per block")
    ap.add_argument("--variants", default="model,fused")
    ap.add_argument("--reps", type=int, default=10,
                    help="timed batches of calls per row (benchmarks/timing.py)")
    args = ap.parse_args(argv)
    dtype = jnp.bfloat16
    key = jax.random.PRNGKey(0)
    params = init_params(key, args.layers, args.width, dtype)
    x = jax.random.normal(jax.random.fold_in(key, 1), (args.batch, args.seq, args.width),
                          jnp.float32).astype(dtype)
    print(f"{args.layers} layers, width {args.width}, blocks of {args.block} sublayers, "
          f"{args.batch} x {args.seq}, {jax.devices()[0].device_kind}, JAX {jax.__version__}")
    base = timing.time_jax(build(args.layers, args.width, args.block, "none", dtype), params, x,
                           batches=args.reps).ms
    print("| variant | fwd+bwd ms | minus plain residual ms | loss rel err | grad rel err |")
    print("|---|---|---|---|---|")
    print(f"| none (plain residual) | {base:.2f} | 0 | | |")
    ref = None
    defaults = depth_read.DEFAULT_FWD_TILES, depth_read.DEFAULT_BWD_TILES
    try:
        for name in args.variants.split(","):
            impl = "xla"
            if name.startswith("fused"):
                impl = "pallas"
                tiles = _tiles(name.split(":", 1)[1]) if ":" in name else (None, None)
                depth_read.DEFAULT_FWD_TILES = tiles[0] or defaults[0]
                depth_read.DEFAULT_BWD_TILES = tiles[1] or defaults[1]
            else:
                DepthResidual._read_list = READS[name]  # read while tracing, below
            fn = build(args.layers, args.width, args.block, "block", dtype, impl)
            loss, grads = fn(params, x)
            flat = np.concatenate([np.ravel(np.asarray(g, np.float32))
                                   for g in jax.tree.leaves(grads)])
            if ref is None:
                ref = (loss, flat)
            ms = timing.time_jax(fn, params, x, batches=args.reps).ms
            print(f"| {name} | {ms:.2f} | {ms - base:.2f} | {rel(loss, ref[0]):.1e} | "
                  f"{rel(flat, ref[1]):.1e} |", flush=True)
            DepthResidual._read_list = _model_read
    finally:
        DepthResidual._read_list = _model_read
        depth_read.DEFAULT_FWD_TILES, depth_read.DEFAULT_BWD_TILES = defaults


if __name__ == "__main__":
    main()
