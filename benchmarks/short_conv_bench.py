r"""KDA's short convolution, forward and forward + backward: XLA's form against the kernels.

    python benchmarks/short_conv_bench.py                        # configs/1b.py: 4 x 4096 x 2048
    python benchmarks/short_conv_bench.py --batch=1 --seq=256    # CPU (interpret mode: slow)
    python benchmarks/short_conv_bench.py --tiles="32,128,4;64,128,8"
    python benchmarks/short_conv_bench.py --tiles="64,256,1,rows"   # the row form (ConvTiles.form)
    python benchmarks/short_conv_bench.py --activation=silu_l2     # KDA's q and k (K = 128)

Rows timed:

    copy        one elementwise pass over the same tensors (y = c x; dx = c dy): the floor.
    xla         ``kimi_k3.layers.ShortConv(impl="xla")``: the layer's float32 XLA form with its
                own backward pass (input gradient and the weight gradient's column sums).
    pallas      ``ShortConv(impl="pallas")``: ``pallas_kernels.short_conv``'s forward kernel and
                its one-pass backward kernel (input and weight gradients).
    R,BC,warps[,form[,unroll]]  the kernels called directly with other launch parameters
                (ConvTiles), forward and backward (with an activation: the row form only).

With ``--activation`` ("silu": KDA's v; "silu_l2": q and k, the norm over heads of ``--group``
channels) every row applies it too, and one more row shows the kernels without it:

    pallas+xla  the convolution kernels, then the activation as XLA's passes (what the layer
                ran before the kernels took the activation in).

Rows of packed documents (~1500 tokens: the mask matters), bf16 on the GPU. Prints the median
forward and forward + backward ms (benchmarks/timing.py: calls back to back, one wait per
batch), the bandwidth that time means for the tensors the step must read and write (forward:
x in, y out; backward: x, dy in, dx out), and the largest error of each output and gradient
against ``xla`` (``copy``'s are meaningless).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for benchmarks/

from benchmarks import timing
from kimi_k3.layers import ShortConv
from kimi_k3.layers.short_conv import apply_activation
from pallas_kernels import short_conv as kernels


def _layer_fns(layer_impl: str, C: int, W: int, seg, activation: str = "none", group: int = 0,
               fused: bool = True):
    """The layer's forward and forward+backward, on [B, T, C] views of [B, T, C/g, g] channels
    (g = ``group``: the norm's). ``fused=False`` applies the activation after the layer."""
    g = group or C
    layer = ShortConv((C // g, g), W, names=("kda_heads", None), rngs=nnx.Rngs(0),
                      impl=layer_impl)
    graphdef, state = nnx.split(layer)

    def conv(x, w):
        # the weight is the state's one leaf
        m = nnx.merge(graphdef, jax.tree.map(lambda _: w.reshape(W, C // g, g), state))
        x4 = x.reshape(*x.shape[:2], C // g, g)
        if fused:
            y = m(x4, seg, activation=activation)[0]
        else:
            y = apply_activation(m(x4, seg)[0], activation)
        return y.reshape(x.shape)

    def fwd_bwd(x, w, dy):  # dy an argument: as a closed-over constant XLA folds pads of it
        y, vjp = jax.vjp(conv, x, w)
        return (y, *vjp(dy))

    return jax.jit(conv), jax.jit(fwd_bwd), layer.weight[...].reshape(W, C)


def _kernel_fns(tiles: kernels.ConvTiles, seg, tail, activation: str, group: int):
    """The kernels with launch parameters ``tiles``, forward and backward."""
    act = dict(activation=activation, group=group)

    def conv(x, w):
        return kernels.conv_forward(x, tail, w, seg, tiles=tiles, **act)

    def fwd_bwd(x, w, dy):
        y = kernels.conv_forward(x, tail, w, seg, tiles=tiles, **act)
        return (y, *kernels.conv_backward(x, tail, w, seg, dy, tiles=tiles, **act))

    return jax.jit(conv), jax.jit(fwd_bwd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=2048)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--tiles", default="",
                    help="launch parameters to time besides the default, "
                         "'R,BC,warps[,form[,unroll]];...'")
    ap.add_argument("--activation", default="none", choices=kernels.ACTIVATIONS)
    ap.add_argument("--group", type=int, default=128, help="silu_l2's channels per norm")
    a = ap.parse_args(argv)
    B, T, C, W = a.batch, a.seq, a.channels, a.width
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    x = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
    dy = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
    seg = jnp.asarray(np.cumsum(rng.random((B, T)) < 1 / 1500, axis=1), jnp.int32)
    tail = jnp.zeros((B, W - 1, C), dtype)

    # The floor: one elementwise pass (x in, y out; dx from dy) at the card's bandwidth.
    rows = {"copy": (jax.jit(lambda x, w: x * w[0, 0].astype(x.dtype)),
                     jax.jit(lambda x, w, dy: (x * w[0, 0].astype(x.dtype),
                                               dy * w[0, 0].astype(x.dtype),
                                               jnp.zeros_like(w))))}
    group = a.group if a.activation == "silu_l2" else 0
    for impl in ("xla", "pallas"):
        fwd, fwd_bwd, w = _layer_fns(impl, C, W, seg, a.activation, group)
        rows[impl] = (fwd, fwd_bwd)
    if a.activation != "none":
        rows["pallas+xla"] = _layer_fns("pallas", C, W, seg, a.activation, group, False)[:2]
    for spec in filter(None, a.tiles.split(";")):
        R, BC, warps, *form = spec.split(",")  # form: [] or [form] or [form, unroll]
        form = [*form[:1], *(int(v) for v in form[1:2])]
        rows[spec] = _kernel_fns(kernels.ConvTiles(int(R), int(BC), int(warps), *form), seg,
                                 tail, a.activation, group)

    nbytes = B * T * C * jnp.dtype(dtype).itemsize  # one [B, T, C] tensor
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: {B} x {T} x {C}, width {W}, "
          f"{jnp.dtype(dtype).name}, activation {a.activation}, default tiles "
          f"{kernels.DEFAULT_TILES}, backward {kernels.DEFAULT_BWD_TILES} "
          f"(with an activation {kernels.DEFAULT_ACT_TILES})\n")
    print("| form | forward ms | GB/s | forward + backward ms | GB/s | largest error "
          "(y, dx, dw) |")
    print("|---|---|---|---|---|---|")
    want = jax.block_until_ready(rows["xla"][1](x, w, dy))
    for name, (fwd, fwd_bwd) in rows.items():
        out = jax.block_until_ready(fwd_bwd(x, w, dy))
        err = [float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32)))
                     / (float(jnp.max(jnp.abs(r.astype(jnp.float32)))) + 1e-30))
               for o, r in zip(out, want, strict=True)]
        t_fwd, t_all = timing.time_jax(fwd, x, w).ms, timing.time_jax(fwd_bwd, x, w, dy).ms
        print(f"| {name} | {t_fwd:.3f} | {2 * nbytes / t_fwd / 1e6:.0f} | {t_all:.3f} | "
              f"{5 * nbytes / t_all / 1e6:.0f} | {err[0]:.1e}, {err[1]:.1e}, {err[2]:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
