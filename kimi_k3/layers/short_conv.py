"""Causal depthwise short convolution over time (KDA's q, k and v each have one).

    y_t[c] = sum_{w=0}^{W-1} weight[w, c] * x_{t-(W-1)+w}[c]                 (W = 4 in K3)

The activation KDA applies next can come with it (``activation``): "silu" (v) or "silu_l2"
(q and k: SiLU, then an L2 norm over the last channel axis, the head's). The kernels
(``impl="pallas"``, their row form) compute it in the convolution's own passes: the forward
writes only the activation's output, and the backward recomputes the convolution of each row
from the rows of x it holds anyway. Otherwise it runs after the convolution in plain JAX.

Only taps inside the token's own document count: with packed documents a tap whose token has
another segment id reads zero, so no document sees its neighbour's tail. Tokens before the start
of the sequence come from ``tail`` (the last W-1 inputs of the previous piece, for prefill in
pieces and decoding) or are zero.

Context parallelism (tokens split over a "context" mesh axis, ``sharding.context_layout``):
each shard receives the previous shard's last W-1 inputs and their segment ids by one
``ppermute`` (the first shard receives zeros) and convolves its own tokens with them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from kimi_k3.layers.norms import l2_normalize
from kimi_k3.sharding import ContextLayout, context_layout, logical_to_spec, param
from pallas_kernels import device
from pallas_kernels import short_conv as short_conv_kernel


class ShortConv(nnx.Module):
    """x [B, T, *channels] -> y [B, T, *channels]; weight [W, *channels], no bias.

    Init as a PyTorch depthwise Conv1d: U(-1/sqrt(W), 1/sqrt(W)).
    """

    def __init__(self, channels: Sequence[int], width: int, *, names: Sequence[str | None],
                 rngs: nnx.Rngs, param_dtype=jnp.float32, impl: str = "xla"):
        if width < 1:
            raise ValueError(f"ShortConv: width must be >= 1, got {width}")
        if impl not in ("xla", "pallas"):
            raise ValueError(f"ShortConv: impl must be 'xla' or 'pallas', got {impl!r}")
        self.impl = impl
        self.channels = tuple(channels)
        self.width = width
        self.names = tuple(names)
        bound = 1.0 / math.sqrt(width)
        w = jax.random.uniform(rngs.params(), (width, *self.channels), jnp.float32, -bound, bound)
        self.weight = param(w.astype(param_dtype), ("conv", *names))

    def init_tail(self, batch_size: int, dtype) -> jax.Array:
        """Zeros [B, W-1, *channels]: the inputs before the first token."""
        return jnp.zeros((batch_size, self.width - 1, *self.channels), dtype)

    def __call__(
        self,
        x_BxTxC: jax.Array,
        segment_ids_BxT: jax.Array | None = None,
        tail_BxWm1xC: jax.Array | None = None,
        activation: str = "none",
    ) -> tuple[jax.Array, jax.Array]:
        """Returns (y [B, T, *channels] in x's dtype, new tail [B, W-1, *channels]): the
        convolution, then ``activation`` ("none", "silu" or "silu_l2")."""
        if activation not in short_conv_kernel.ACTIVATIONS:
            raise ValueError(f"ShortConv: activation must be one of "
                             f"{short_conv_kernel.ACTIVATIONS}, got {activation!r}")
        B, T = x_BxTxC.shape[:2]
        Wm1 = self.width - 1
        layout = context_layout()
        if layout is not None and Wm1 > 0 and layout.splits(T, Wm1):
            y = self._context_parallel(x_BxTxC, segment_ids_BxT, tail_BxWm1xC, layout)
            return apply_activation(y, activation), x_BxTxC[:, T - Wm1:]
        if tail_BxWm1xC is None:
            tail_BxWm1xC = self.init_tail(B, x_BxTxC.dtype)
        tail_BxWm1xC = tail_BxWm1xC.astype(x_BxTxC.dtype)
        seg = (jnp.zeros((B, T), jnp.int32) if segment_ids_BxT is None
               else segment_ids_BxT.astype(jnp.int32))
        # No kernel for a width of 1 (a scaling) or for one token (a decoding step: a few
        # multiply-adds XLA fuses with their neighbours, where a kernel is a launch of its own).
        impl = self.impl if Wm1 > 0 and T > 1 else "xla"
        group = self.channels[-1]
        if impl == "pallas" and (activation != "silu_l2" or group & (group - 1) == 0):
            y = _depthwise_causal_conv(x_BxTxC, tail_BxWm1xC, self.weight[...], seg, impl,
                                       activation)
        else:  # the norm's group is one kernel tile: a power of two
            y = apply_activation(_depthwise_causal_conv(x_BxTxC, tail_BxWm1xC, self.weight[...],
                                                     seg, impl), activation)
        if Wm1 == 0:
            return y, tail_BxWm1xC
        if T >= Wm1:
            return y, x_BxTxC[:, T - Wm1:]
        return y, jnp.concatenate([tail_BxWm1xC, x_BxTxC], axis=1)[:, T:]

    def _context_parallel(self, x_BxTxC, segment_ids_BxT, tail_BxWm1xC, layout: ContextLayout):
        """The convolution with the tokens split over ``layout.axes``: the same taps, the W-1
        inputs before a shard's first token come from the previous shard (the first shard's
        from ``tail``, or zeros)."""
        B, T = x_BxTxC.shape[:2]
        if segment_ids_BxT is None:
            segment_ids_BxT = jnp.zeros((B, T), jnp.int32)
        if tail_BxWm1xC is None:
            tail_BxWm1xC = self.init_tail(B, x_BxTxC.dtype)
        # Channels split as the weight's are (its logical names under the rules in force).
        w_spec = logical_to_spec(("conv", *self.names), layout.rules)
        w_spec = PartitionSpec(*w_spec, *[None] * (1 + len(self.channels) - len(w_spec)))
        x_spec = PartitionSpec(layout.batch, layout.axes, *w_spec[1:])
        tail_spec = PartitionSpec(layout.batch, None, *w_spec[1:])  # every shard, the first's
        body = functools.partial(_shard_conv, Wm1=self.width - 1, axes=layout.axes,
                                 n=layout.num_shards)
        return jax.shard_map(
            body, mesh=layout.mesh, in_specs=(x_spec, layout.tokens, tail_spec, w_spec),
            out_specs=x_spec)(x_BxTxC, segment_ids_BxT.astype(jnp.int32),
                              tail_BxWm1xC.astype(x_BxTxC.dtype), self.weight[...])


def _same_doc_masks(seg_BxT, W: int, feat: tuple) -> list:
    """[B, T, 1...] per lag: does x_{t-lag} belong to token t's document (None for lag 0)."""
    B, T = seg_BxT.shape
    masks = [None]
    for lag in range(1, W):
        prev = jnp.pad(seg_BxT, ((0, 0), (lag, 0)), mode="edge")[:, :T]
        masks.append((prev == seg_BxT).reshape(B, T, *feat))
    return masks


def apply_activation(y_BxTxC: jax.Array, activation: str) -> jax.Array:
    """The activation after a convolution that did not apply it (``ShortConv.__call__``)."""
    if activation == "none":
        return y_BxTxC
    # y is written before the SiLU (and the q/k norm) reads it. Without the barrier XLA fused
    # the convolutions (conv_impl "xla") into the norms' row reduction in the unrolled 1B step,
    # one slow kernel per layer, far slower than the convolutions and the norms apart.
    y_BxTxC = jax.nn.silu(lax.optimization_barrier(y_BxTxC))
    if activation == "silu":
        return y_BxTxC
    return l2_normalize(y_BxTxC, eps=short_conv_kernel.L2_EPS).astype(y_BxTxC.dtype)


# The forward kernel jitted (device.jit_per_choices): the calls of one program with the same
# shapes (a layer's q and k, every KDA layer) lower it once; the backward pass calls the kernel.
_conv_forward_once = device.jit_per_choices(short_conv_kernel.conv_forward,
                                            static_argnames=("activation", "group"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _depthwise_causal_conv(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, impl="xla", activation="none"):
    """y_t = sum_lag where(same document, w[W-1-lag] * x_{t-lag}, 0) in float32, returned in
    x's dtype; ``tail`` [B, W-1, *channels] holds the W-1 inputs before the first token (they
    count as the first token's document).

    Written with its own backward pass because the weight gradient is a column sum over every
    token (B T rows of C channels): taken as XLA derives it, it fused with the layer's other
    backward work into a reduction several times slower than reading its inputs. ``impl``
    "pallas" runs forward and backward as kernels (``pallas_kernels.short_conv``), which also
    apply ``activation`` (the L2 norm over the last channel axis); "xla" takes none.
    """
    if impl == "pallas":
        n = x_BxTxC.ndim - 2  # channel dims, flattened for the kernels
        y = _conv_forward_once(_flat(x_BxTxC, n), _flat(tail_BxWm1xC, n), _flat(w_WxC, n),
                               seg_BxT, activation=activation, group=x_BxTxC.shape[-1])
        return y.reshape(x_BxTxC.shape)
    assert activation == "none", activation  # ShortConv applies XLA's after
    W, T = w_WxC.shape[0], seg_BxT.shape[1]
    x_ext = jnp.concatenate([tail_BxWm1xC, x_BxTxC], axis=1)
    feat = (1,) * (x_ext.ndim - 2)
    w = w_WxC.astype(jnp.float32)
    y = jnp.zeros(x_BxTxC.shape, jnp.float32)
    for lag, same in enumerate(_same_doc_masks(seg_BxT, W, feat)):
        # Tap W-1-lag multiplies x_{t-lag}.
        term = lax.slice_in_dim(x_ext, W - 1 - lag, W - 1 - lag + T, axis=1)
        term = term.astype(jnp.float32) * w[W - 1 - lag]
        y = y + (term if same is None else jnp.where(same, term, 0.0))
    return y.astype(x_BxTxC.dtype)


def _flat(a: jax.Array, n: int) -> jax.Array:
    """a [..., *channels] (n channel dims) as [..., C]: the kernels' layout."""
    return a.reshape(*a.shape[:a.ndim - n], -1)


def _conv_fwd(x, tail, w, seg, impl, activation):
    return _depthwise_causal_conv(x, tail, w, seg, impl, activation), (x, tail, w, seg)


def _conv_bwd(impl, activation, res, dy_BxTxC):
    x, tail, w_WxC, seg = res
    W, T = w_WxC.shape[0], seg.shape[1]
    channels = x.shape[2:]
    seg_ct = np.zeros(seg.shape, jax.dtypes.float0)
    if impl == "pallas":
        n = len(channels)
        w_flat, dy_flat = _flat(w_WxC, n), _flat(dy_BxTxC, n)
        x_flat, tail_flat = _flat(x, n), _flat(tail, n)
        act = dict(activation=activation, group=channels[-1])
        dx, dw = short_conv_kernel.conv_backward(x_flat, tail_flat, w_flat, seg, dy_flat, **act)
        dtail = short_conv_kernel.tail_grad(w_flat, seg, dy_flat, x_BxTxC=x_flat,
                                            tail_BxWm1xC=tail_flat, **act)
        return (dx.reshape(x.shape), dtail.reshape(tail.shape).astype(tail.dtype),
                dw.reshape(w_WxC.shape).astype(w_WxC.dtype), seg_ct)
    x_ext = jnp.concatenate([tail, x], axis=1)
    w = w_WxC.astype(jnp.float32)
    dy = dy_BxTxC.astype(jnp.float32)
    # dy_lag[t] = dy_t where x_{t-lag} is in token t's document, else 0
    dy_lags = [dy if same is None else jnp.where(same, dy, 0.0)
               for same in _same_doc_masks(seg, W, (1,) * len(channels))]
    dx = jnp.zeros(x_ext.shape, jnp.float32)
    for lag, dy_lag in enumerate(dy_lags):
        dx = dx + jnp.pad(dy_lag * w[W - 1 - lag],
                          [(0, 0), (W - 1 - lag, lag)] + [(0, 0)] * len(channels))
    dw_WxC = _weight_grad_xla(x_ext, dy_lags, T).astype(w_WxC.dtype)
    return (dx[:, W - 1:].astype(x.dtype), dx[:, :W - 1].astype(tail.dtype), dw_WxC, seg_ct)


_depthwise_causal_conv.defvjp(_conv_fwd, _conv_bwd)


def _weight_grad_xla(x_ext, dy_lags, T: int):
    """dw [W, *channels] float32 from the masked float32 cotangents dy_lag [B, T, *channels]
    (lag = 0..W-1), each tap one column sum over a [B T, C] view."""
    W, (B, _, *channels) = len(dy_lags), dy_lags[0].shape
    dw = []
    for lag, dy_lag in enumerate(dy_lags):
        x_lag = lax.slice_in_dim(x_ext, W - 1 - lag, W - 1 - lag + T, axis=1)
        prod = (x_lag.astype(jnp.float32) * dy_lag).reshape(B * T, -1)
        dw.append(jnp.sum(prod, axis=0).reshape(*channels))
    return jnp.stack(dw[::-1])


def _shard_conv(x_BxTxC, seg_BxT, tail_BxWm1xC, w_WxC, *, Wm1: int, axes, n: int):
    """One shard's convolution (inside shard_map): x [B, T, *channels] with this shard's
    segment ids; the previous shard's last W-1 inputs arrive by ppermute, shard 0 takes
    ``tail`` (the inputs before the sequence: a cache's, or zeros) with its own first id."""
    B, T = x_BxTxC.shape[:2]
    if T < Wm1:
        raise ValueError(f"ShortConv: a shard of {T} tokens is shorter than the W-1 = {Wm1} "
                         f"tokens the next shard needs; use fewer context devices")
    shift = [(i, i + 1) for i in range(n - 1)]
    first = lax.axis_index(axes) == 0
    tail = jnp.where(first, tail_BxWm1xC, lax.ppermute(x_BxTxC[:, T - Wm1:], axes, shift))
    tail_seg = jnp.where(first, seg_BxT[:, :1], lax.ppermute(seg_BxT[:, T - Wm1:], axes, shift))
    x_ext = jnp.concatenate([tail, x_BxTxC], axis=1)
    seg_ext = jnp.concatenate([tail_seg, seg_BxT], axis=1)
    w = w_WxC.astype(jnp.float32)
    feat = (1,) * (x_BxTxC.ndim - 2)
    y = jnp.zeros(x_BxTxC.shape, jnp.float32)
    for lag in range(Wm1 + 1):
        # Tap w = W-1-lag multiplies x_{t-lag}; only taps in the token's own document count.
        x_lag = lax.slice_in_dim(x_ext, Wm1 - lag, Wm1 - lag + T, axis=1)
        term = x_lag.astype(jnp.float32) * w[Wm1 - lag]
        if lag > 0:
            prev = lax.slice_in_dim(seg_ext, Wm1 - lag, Wm1 - lag + T, axis=1)
            term = jnp.where((prev == seg_BxT).reshape(B, T, *feat), term, 0.0)
        y = y + term
    return y.astype(x_BxTxC.dtype)
