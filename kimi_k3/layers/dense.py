"""Dense: a matmul from some trailing input axes to some output axes, with logical axis names.

    y[..., o1, o2, ...] = sum_{i1, i2, ...} x[..., i1, i2, ...] W[i1, i2, ..., o1, o2, ...]

One module covers D -> D', D -> (H, K) (per-head projections) and (H, V) -> D (output
projections), so no reshapes hide which axis is which. No bias: none of the layers here uses one.
Parameters live in ``param_dtype``; the product runs in ``dtype`` with float32 accumulation.
With float32 parameters and bf16 compute the weight's gradient comes out of its matmul in
float32 (``low_precision_einsum``): dW = x^T dy is never rounded to bf16.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_k3.sharding import param


class Dense(nnx.Module):
    """x [..., *in_shape] -> y [..., *out_shape]; W [*in_shape, *out_shape].

    Init: normal with std = init_scale / sqrt(prod(in_shape)) (fan-in scaling).
    """

    def __init__(
        self,
        in_shape: int | Sequence[int],
        out_shape: int | Sequence[int],
        *,
        names: Sequence[str | None],
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        init_scale: float = 1.0,
    ):
        self.in_shape = (in_shape,) if isinstance(in_shape, int) else tuple(in_shape)
        self.out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
        shape = self.in_shape + self.out_shape
        if len(names) != len(shape):
            raise ValueError(f"Dense: {len(names)} axis names {tuple(names)} for kernel {shape}")
        std = init_scale / math.sqrt(math.prod(self.in_shape))
        w = jax.random.normal(rngs.params(), shape, jnp.float32) * std
        self.kernel = param(w.astype(param_dtype), names)
        self.dtype = dtype
        self._eq = _equations(len(self.in_shape), len(self.out_shape))[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[x.ndim - len(self.in_shape):] != self.in_shape:
            raise ValueError(f"Dense: input {x.shape} does not end in {self.in_shape}")
        # Operands and result in the compute dtype; the matrix units accumulate in float32
        # anyway. Asking for a float32 result instead would make the backward pass multiply a
        # float32 cotangent with bf16 operands, which XLA runs as a float32 GEMM (several times
        # slower); f32_logits below is the variant for the one product that wants float32 out.
        w = self.kernel[...]
        if jnp.dtype(self.dtype).itemsize < jnp.dtype(w.dtype).itemsize:
            return low_precision_einsum(len(self.in_shape), len(self.out_shape), self.dtype,
                                        x, w)
        return jnp.einsum(self._eq, x.astype(self.dtype), w.astype(self.dtype))


def _equations(n_in: int, n_out: int):
    """Dense's product and its two transposes for ``n_in`` input and ``n_out`` output axes:
    y = x W, dx = dy W^T, dW = x^T dy (summed over every leading axis)."""
    letters = string.ascii_letters
    ins, outs = letters[:n_in], letters[n_in:n_in + n_out]
    return (f"...{ins},{ins}{outs}->...{outs}", f"...{outs},{ins}{outs}->...{ins}",
            f"...{ins},...{outs}->{ins}{outs}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def low_precision_einsum(n_in: int, n_out: int, dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    """Dense's product with the operands rounded to ``dtype`` (bf16) and a ``dtype`` result,
    for a higher-precision (float32) parameter ``w``. The weight's gradient comes out of its
    matmul in ``w``'s dtype, summed in float32 and never rounded to ``dtype``: as autodiff
    writes it, the transpose of ``w.astype(dtype)`` rounds each micro-batch's dW to bf16 and
    converts it back, and the float32 sum over micro-batches is a separate pass over every
    parameter (read dW, read and write the sum). A float32 dW is a GEMM output that XLA can
    add into the running sum inside the GEMM itself (cuBLAS's beta = 1)."""
    eq, _, _ = _equations(n_in, n_out)
    return jnp.einsum(eq, x.astype(dtype), w.astype(dtype))


def _low_precision_fwd(n_in, n_out, dtype, x, w):
    x_lo, w_lo = x.astype(dtype), w.astype(dtype)
    eq, _, _ = _equations(n_in, n_out)
    # Empty arrays carry x's and w's dtypes to the backward (residuals must be JAX values).
    return jnp.einsum(eq, x_lo, w_lo), (x_lo, w_lo, jnp.zeros((0,), x.dtype),
                                        jnp.zeros((0,), w.dtype))


def _low_precision_bwd(n_in, n_out, dtype, residuals, dy):
    x_lo, w_lo, x_like, w_like = residuals
    _, eq_dx, eq_dw = _equations(n_in, n_out)
    dy = dy.astype(dtype)
    dx = jnp.einsum(eq_dx, dy, w_lo).astype(x_like.dtype)
    dw = jnp.einsum(eq_dw, x_lo, dy, preferred_element_type=w_like.dtype)
    return dx, dw


low_precision_einsum.defvjp(_low_precision_fwd, _low_precision_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def f32_out_einsum(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(eq, x, w)`` with a float32 result from low-precision operands (the output head's
    logits), whose backward pass still multiplies in the operands' dtype: the float32
    cotangent is rounded to it first, as the forward's operands were."""
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)


def _f32_out_fwd(eq, x, w):
    return f32_out_einsum(eq, x, w), (x, w)


def _f32_out_bwd(eq, residuals, ct):
    x, w = residuals
    _, vjp = jax.vjp(lambda x, w: jnp.einsum(eq, x, w), x, w)
    return vjp(ct.astype(jnp.result_type(x, w)))


f32_out_einsum.defvjp(_f32_out_fwd, _f32_out_bwd)
