"""Decoding's fused products: a layer's Dense products that read one input as one product, and
those of one shape that read different inputs as one batched product.

At batch 1 a decoding step multiplies a single row by every weight, and a product of a few
megabytes costs about one kernel launch whatever its size: a KDA layer's eight small products
(q, k, v, beta and the low-rank gate pairs) cost several times the reading of their weights. The
``Decoder`` (kimi_k3/generate.py) therefore holds each such group as one weight:

    [y_1 | ... | y_n] = x [W_1 | ... | W_n]             SharedInput: W_i [*in, *out_i]
    [y_1 ; ... ; y_n] = [x_1 ; ... ; x_n] [W_1 ; ... ; W_n]   Stacked: W_i [*in, *out], one
                                                        batched product over i

Each output element is the same sum over the input axes as the separate product's, in the same
dtype (the operands and the result in the compute dtype, float32 accumulation), so the model's
numbers do not change; only the number of kernels does.

A layer names its groups in ``FUSED`` (group -> the Dense attributes it may have; those it has
take part) and ``FUSED_STACKED`` (the groups of one kernel shape), and reads them through
:func:`shared_input` and :func:`stacked`, which use the fused weight when
:func:`fuse_for_decoding` has made one and the separate Dense modules otherwise (training, and
any model the Decoder did not build). A fused model has no separate weights left for those
products: it is for decoding, not for training or saving.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from kimi_k3.layers.dense import Dense


def _lead(dense: Dense) -> tuple[int, ...]:
    """The axes a kernel has before its own (a scanned stack's "layers" axis), as a shape."""
    w = dense.kernel.get_value()
    return w.shape[: w.ndim - len(dense.in_shape) - len(dense.out_shape)]


class SharedInput(nnx.Module):
    """Dense modules that read the same x [..., *in] as one product: x -> {name_i: y_i}, each
    y_i [..., *out_i] as ``parts[i](x)`` gives it. Kernel: [*lead, *in, sum_i prod(out_i)]."""

    def __init__(self, names: Sequence[str], parts: Sequence[Dense]):
        first = parts[0]
        self.names = tuple(names)
        self.in_shape, self.dtype = first.in_shape, first.dtype
        self.out_shapes = tuple(p.out_shape for p in parts)
        flat = [p.kernel.get_value().reshape(*_lead(p), *p.in_shape, -1) for p in parts]
        self.kernel = nnx.Param(jnp.concatenate(flat, axis=-1))
        letters = string.ascii_letters[: len(self.in_shape)]
        self._eq = f"...{letters},{letters}Z->...Z"

    def __call__(self, x: jnp.ndarray) -> dict[str, jnp.ndarray]:
        y = jnp.einsum(self._eq, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        outs, start = {}, 0
        for name, shape in zip(self.names, self.out_shapes, strict=True):
            n = math.prod(shape)
            outs[name] = y[..., start : start + n].reshape(*y.shape[:-1], *shape)
            start += n
        return outs


class Stacked(nnx.Module):
    """Dense modules of one kernel shape [*in, *out], each reading its own x_i [..., *in], as one
    batched product: (x_1, ..., x_n) -> (y_1, ..., y_n). Kernel: [*lead, n, *in, *out]."""

    def __init__(self, names: Sequence[str], parts: Sequence[Dense]):
        del names  # the inputs and outputs go by position
        first = parts[0]
        self.in_shape, self.out_shape, self.dtype = first.in_shape, first.out_shape, first.dtype
        axis = len(_lead(first))
        self.kernel = nnx.Param(jnp.stack([p.kernel.get_value() for p in parts], axis=axis))
        letters = string.ascii_letters
        ins = letters[: len(self.in_shape)]
        outs = letters[len(self.in_shape) : len(self.in_shape) + len(self.out_shape)]
        self._eq = f"Z...{ins},Z{ins}{outs}->Z...{outs}"

    def __call__(self, *xs: jnp.ndarray) -> tuple[jnp.ndarray, ...]:
        x = jnp.stack([x.astype(self.dtype) for x in xs])
        y = jnp.einsum(self._eq, x, self.kernel[...].astype(self.dtype))
        return tuple(y[i] for i in range(len(xs)))


def shared_input(module: nnx.Module, group: str, x: jnp.ndarray) -> dict[str, jnp.ndarray]:
    """{name: the product of x by that Dense} for each of ``module.FUSED[group]`` the module
    has: one product when the module holds them fused, else each module's own."""
    fused = getattr(module, group, None)
    if isinstance(fused, SharedInput):
        return fused(x)
    return {name: getattr(module, name)(x) for name in module.FUSED[group]
            if getattr(module, name, None) is not None}


def stacked(module: nnx.Module, group: str, *xs: jnp.ndarray) -> tuple[jnp.ndarray, ...]:
    """``module.FUSED[group][i](xs[i])`` for each i (the group's modules all present): one
    batched product when the module holds them fused, else each module's own."""
    fused = getattr(module, group, None)
    if isinstance(fused, Stacked):
        return fused(*xs)
    return tuple(getattr(module, name)(x)
                 for name, x in zip(module.FUSED[group], xs, strict=True))


def _fusable(parts: list, same_out: bool) -> bool:
    """Whether these Dense modules can be one product: all plain (not FP8: that product
    quantises each operand with its own scale), with one input shape (and with ``same_out`` one
    output shape), one compute dtype and one kernel dtype and leading shape."""
    if len(parts) < 2 or not all(isinstance(p, Dense) and not p.fp8 for p in parts):
        return False
    first = parts[0]
    key = lambda p: (p.in_shape, p.dtype, p.kernel.get_value().dtype, _lead(p),
                     p.out_shape if same_out else None)
    return all(key(p) == key(first) for p in parts)


# nnx.iter_modules(m) replaces the deprecated m.iter_modules() in newer flax; older flax has
# only the method.
_iter_modules = getattr(nnx, "iter_modules", None) or (lambda m: m.iter_modules())


def fuse_for_decoding(model: nnx.Module) -> None:
    """Replaces, in place, each group a module of ``model`` names in its ``FUSED`` by one fused
    weight (``Stacked`` for the groups in ``FUSED_STACKED``, ``SharedInput`` for the others),
    the separate Dense modules removed. Groups that cannot be fused (FP8 products, unlike
    shapes, fewer than two present) stay as they are."""
    for _, module in list(_iter_modules(model)):
        groups = getattr(type(module), "FUSED", None)
        if not groups:
            continue
        for group, wanted in groups.items():
            is_stacked = group in getattr(type(module), "FUSED_STACKED", ())
            names = [n for n in wanted if getattr(module, n, None) is not None]
            if is_stacked and len(names) != len(wanted):
                continue
            parts = [getattr(module, name) for name in names]
            if not _fusable(parts, same_out=is_stacked):
                continue
            setattr(module, group, (Stacked if is_stacked else SharedInput)(names, parts))
            for name in names:
                delattr(module, name)
