"""Dense: a matmul from some trailing input axes to some output axes, with logical axis names.

    y[..., o1, o2, ...] = sum_{i1, i2, ...} x[..., i1, i2, ...] W[i1, i2, ..., o1, o2, ...]

One module covers D -> D', D -> (H, K) (per-head projections) and (H, V) -> D (output
projections), so no reshapes hide which axis is which. No bias: none of the layers here uses one.
Parameters live in ``param_dtype``; the product runs in ``dtype`` with float32 accumulation.
"""

from __future__ import annotations

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
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        letters = string.ascii_letters
        ins, outs = letters[:n_in], letters[n_in:n_in + n_out]
        self._eq = f"...{ins},{ins}{outs}->...{outs}"

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[x.ndim - len(self.in_shape):] != self.in_shape:
            raise ValueError(f"Dense: input {x.shape} does not end in {self.in_shape}")
        y = jnp.einsum(
            self._eq, x.astype(self.dtype), self.kernel[...].astype(self.dtype),
            preferred_element_type=jnp.float32,
        )
        return y.astype(self.dtype)
