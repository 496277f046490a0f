r"""KDA's short convolution, forward + backward, in the forms its weight gradient can take.

    python benchmarks/short_conv_bench.py                        # configs/1b.py: 4 x 4096 x 2048
    python benchmarks/short_conv_bench.py --batch=1 --seq=256    # CPU

The weight gradient of a depthwise convolution is one reduction per tap over every token,

    dweight[w, c] = sum_{b, t} x[b, t - (W-1) + w, c] * dy[b, t, c]   (taps inside the document),

a column sum over B T rows of C channels. Forms timed (each checked against "model"):

    model       ``kimi_k3.layers.ShortConv`` as it is (its own backward pass, the "rows" sum).
    derived     the forward alone, differentiated by JAX (the layer's form before 2026-12-01).
    rows        the sum written over a [B T, C] view, in float32.
    two_stage   partial sums over row blocks of 512 tokens, then over the blocks.
    dot         one dot_general per tap with the channel as batch dimension (a batched GEMV).

Prints the median forward + backward ms of each and its largest gradient error.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_k3.layers import ShortConv


def _taps(x_BxTxC, seg_BxT, W):
    """x shifted by each lag (x_{t-lag}, zero before the row and across documents)."""
    B, T, _ = x_BxTxC.shape
    out = []
    for lag in range(W):
        x_lag = jnp.pad(x_BxTxC, ((0, 0), (lag, 0), (0, 0)))[:, :T]
        if lag:
            prev = jnp.pad(seg_BxT, ((0, 0), (lag, 0)), mode="edge")[:, :T]
            x_lag = jnp.where((prev == seg_BxT)[..., None], x_lag, 0)
        out.append(x_lag)
    return out


def _dweight(x_lag, dy, how: str):
    B, T, C = dy.shape
    if how == "rows":
        return jnp.sum((x_lag.astype(jnp.float32) * dy.astype(jnp.float32)).reshape(B * T, C), 0)
    if how == "two_stage":
        R = 512 if (B * T) % 512 == 0 else 1
        part = jnp.sum((x_lag.astype(jnp.float32) * dy.astype(jnp.float32))
                       .reshape(B * T // R, R, C), axis=1)
        return jnp.sum(part, axis=0)
    if how == "dot":
        return jax.lax.dot_general(x_lag.reshape(B * T, C), dy.reshape(B * T, C),
                                   (((0,), (0,)), ((1,), (1,))),
                                   preferred_element_type=jnp.float32)
    raise ValueError(how)


def derived(x_BxTxC, w_WxC, seg_BxT):
    """The convolution's forward; JAX derives its backward pass."""
    W = w_WxC.shape[0]
    y = sum(t.astype(jnp.float32) * w_WxC[W - 1 - lag]
            for lag, t in enumerate(_taps(x_BxTxC, seg_BxT, W)))
    return y.astype(x_BxTxC.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def conv(x_BxTxC, w_WxC, seg_BxT, how):
    return derived(x_BxTxC, w_WxC, seg_BxT)


def _fwd(x, w, seg, how):
    return conv(x, w, seg, how), (x, w, seg)


def _bwd(how, res, dy):
    x, w, seg = res
    W = w.shape[0]
    taps = _taps(x, seg, W)
    dw = jnp.stack([_dweight(taps[lag], dy, how) for lag in range(W)][::-1])
    # dx_s = sum_lag w[W-1-lag] dy_{s+lag} (same document).
    dx = jnp.zeros(x.shape, jnp.float32)
    for lag in range(W):
        dy_lead = jnp.pad(dy, ((0, 0), (0, lag), (0, 0)))[:, lag:]
        if lag:
            nxt = jnp.pad(seg, ((0, 0), (0, lag)), mode="edge")[:, lag:]
            dy_lead = jnp.where((nxt == seg)[..., None], dy_lead, 0)
        dx = dx + dy_lead.astype(jnp.float32) * w[W - 1 - lag]
    return dx.astype(x.dtype), dw.astype(w.dtype), None


conv.defvjp(_fwd, _bwd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=2048)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--forms", default="model,derived,rows,two_stage,dot")
    a = ap.parse_args(argv)
    B, T, C, W = a.batch, a.seq, a.channels, a.width
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    x = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
    dy = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
    seg = jnp.asarray(np.cumsum(rng.random((B, T)) < 1 / 1500, axis=1), jnp.int32)
    layer = ShortConv((C,), W, names=("kda_heads",), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    w = layer.weight[...]

    def model_fn(x, w):
        m = nnx.merge(graphdef, jax.tree.map(lambda _: w, state))  # the weight is its one leaf
        return m(x, seg)[0]

    fns = {"model": model_fn, "derived": lambda x, w: derived(x, w, seg)}
    for how in ("rows", "two_stage", "dot"):
        fns[how] = functools.partial(lambda x, w, how: conv(x, w, seg, how), how=how)

    def fwd_bwd(fn):
        def run(x, w, dy):  # dy an argument: as a closed-over constant XLA folds pads of it
            y, vjp = jax.vjp(fn, x, w)
            return (y, *vjp(dy))
        return jax.jit(run)

    want = None
    print(f"| form | fwd+bwd ms | dx err | dweight err |  ({jax.devices()[0].device_kind}, "
          f"{B} x {T} x {C}, W {W}, {jnp.dtype(dtype).name})")
    print("|---|---|---|---|")
    for name in a.forms.split(","):
        f = fwd_bwd(fns[name])
        out = jax.block_until_ready(f(x, w, dy))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, w, dy))
            times.append(time.perf_counter() - t0)
        if want is None:
            want = out
        err = [float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32)))
                     / (float(jnp.max(jnp.abs(r.astype(jnp.float32)))) + 1e-30))
               for o, r in zip(out[1:], want[1:], strict=True)]
        print(f"| {name} | {1e3 * np.median(times):.3f} | {err[0]:.1e} | {err[1]:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
