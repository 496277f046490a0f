"""The MoE router's float32 product on bfloat16 matrix units, exact to float32 rounding.

A float32 array a splits into three bfloat16 parts (:func:`split3`):

    hi = bf16(a),  mid = bf16(a - hi),  lo = bf16(a - hi - mid)

each remainder taken in float32. Rounding to bfloat16 (8 significant bits) leaves a remainder
of at most 2^-8 |a| that, like a, ends at a's last float32 bit: a - hi has at most 16
significant bits, a - hi - mid at most 8, so lo is that remainder itself and

    hi + mid + lo = a  exactly,  |mid| <= 2^-8 |a| (1 + 2^-8),  |lo| <= 2^-16 |a|

for 2^-103 <= |a| < bfloat16's largest finite number. Below, lo may be subnormal, which GPUs
and XLA:CPU flush to zero: an error under 2^-126.

A product of two bfloat16 numbers is exact in float32 (at most 16 significant bits), so a
matmul of bfloat16 parts accumulating in float32 (tensor cores) multiplies exactly and rounds
only as it sums: the accuracy of a float32 matmul, at the speed of bfloat16 ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32, BF16 = jnp.float32, jnp.bfloat16


def split3(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(hi, mid, lo) bfloat16 with hi + mid + lo = a (float32) exactly (module docstring)."""
    parts, r = [], a.astype(F32)
    for _ in range(3):
        # reduce_precision, not a round trip through bfloat16: XLA:GPU, allowing excess
        # precision by default, removes f32 -> bf16 -> f32 convert pairs, which would make
        # every remainder zero.
        p = jax.lax.reduce_precision(r, exponent_bits=8, mantissa_bits=7)
        parts.append(p.astype(BF16))
        r = r - p
    return tuple(parts)


def _dot(a, b, a_axes, b_axes):
    """a . b contracting ``a_axes`` with ``b_axes``, bfloat16 products summed in float32."""
    return jax.lax.dot_general(a, b, ((a_axes, b_axes), ((), ())), preferred_element_type=F32)


def _add3(y_Nx3E):
    """The sum of the three E-wide slices of the last axis, smallest parts first."""
    hi, mid, lo = jnp.split(y_Nx3E, 3, axis=-1)
    return hi + (mid + lo)


def _logits(x_NxD, w_parts_Dx3E):
    return _add3(_dot(x_NxD, w_parts_Dx3E, (x_NxD.ndim - 1,), (0,)))


def _split_logits_fwd(x_NxD, w_DxE):
    w_parts_Dx3E = jnp.concatenate(split3(w_DxE), axis=1)
    return _logits(x_NxD, w_parts_Dx3E), (x_NxD, w_parts_Dx3E)


@jax.custom_vjp
def _split_logits(x_NxD, w_DxE):
    return _split_logits_fwd(x_NxD, w_DxE)[0]


def _split_logits_bwd(res, g_NxE):
    x_NxD, w_parts_Dx3E = res
    g_hi, g_mid, g_lo = split3(g_NxE)
    w_hi, w_mid, w_lo = jnp.split(w_parts_Dx3E, 3, axis=1)
    lead = tuple(range(x_NxD.ndim - 1))
    # dW = x^T g: x is exact in bfloat16, so g's three parts give every product exactly.
    dw_DxE = _add3(_dot(x_NxD, jnp.concatenate([g_hi, g_mid, g_lo], -1), lead, lead))
    # dx = g W^T: of the nine products of parts, mid*lo, lo*mid and lo*lo are each about
    # 2^-24 |g||W| or less, float32's own rounding; the other six go in as one contraction.
    g_Nx6E = jnp.concatenate([g_hi, g_hi, g_mid, g_hi, g_lo, g_mid], -1)
    w_Dx6E = jnp.concatenate([w_hi, w_mid, w_hi, w_lo, w_hi, w_mid], -1)
    dx_NxD = _dot(g_Nx6E, w_Dx6E, (g_NxE.ndim - 1,), (1,))
    return dx_NxD.astype(x_NxD.dtype), dw_DxE


_split_logits.defvjp(_split_logits_fwd, _split_logits_bwd)


def router_logits(x_NxD: jax.Array, w_DxE: jax.Array) -> jax.Array:
    """logits [N, E] float32 = x [N, D] W [D, E] at float32 precision; N may be several
    leading axes (the router's [B, T]), kept as they are: flattened, a [B, T] split over
    devices along T would have to be gathered.

    For bfloat16 x (exact in bfloat16 by definition) W is split into three bfloat16 parts
    whose sum is W exactly, and x [N, D] @ [W_hi | W_mid | W_lo] [D, 3E] is one bfloat16
    matmul whose three E-wide slices add up to x W: every product exact, only the float32
    sums round. The gradient (a custom VJP) does the same: dW = x^T g with g [N, E] float32
    split in three, dx = g W^T from the six products of parts of g and W above 2^-24
    relative, returned in x's dtype as the float32 product's cotangent would be. Any other
    dtype of x takes the float32 matmul at ``Precision.HIGHEST``.
    """
    w_DxE = w_DxE.astype(F32)
    if x_NxD.dtype != BF16:
        return jnp.einsum("...d,de->...e", x_NxD.astype(F32), w_DxE,
                          precision=jax.lax.Precision.HIGHEST)
    return _split_logits(x_NxD, w_DxE)
