"""Dense: a matmul from some trailing input axes to some output axes, with logical axis names.

    y[..., o1, o2, ...] = sum_{i1, i2, ...} x[..., i1, i2, ...] W[i1, i2, ..., o1, o2, ...]

One module covers D -> D', D -> (H, K) (per-head projections) and (H, V) -> D (output
projections), so no reshapes hide which axis is which. No bias: none of the layers here uses one.
Parameters live in ``param_dtype``; the product runs in ``dtype`` with float32 accumulation.
With float32 parameters and bf16 compute the weight's gradient comes out of its matmul in
float32 (``low_precision_einsum``): dW = x^T dy is never rounded to bf16. The training step
rounds the weights to bf16 once per step and hands Dense both (``precast``, ``Precast``), so
the micro-batches of gradient accumulation do not each convert every weight again.

With ``fp8=True`` (``model.matmul_format = "fp8"``) the product runs in FP8 (:func:`fp8_einsum`,
Qwix's quantisation): e4m3 operands forward, an e5m2 gradient backward, one float32 scale per
tensor taken from its current absolute maximum, each product accumulated in float32:

    s_a = max|a| / 448 (e4m3) or max|a| / 57344 (e5m2);  1 where that is below sqrt(tiny f32)
    q(a) = round_e4m3(clip(a / s_a, -448, 448))            (q5: e5m2, +-57344, its own scale)
    y  = (q(x) . q(W))      s_x s_W                         in the compute dtype
    dx = (q5(dy) . q(W)^T)  s_dy s_W                        in x's dtype
    dW = (q(x)^T . q5(dy))  s_x s_dy                        in W's dtype (float32: never bf16)

No state: the scales are computed from the tensors of the step (current scaling), so a model
has the same parameters, optimizer state and checkpoints in either format.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_k3.ops.kda_context import vary_like
from kimi_k3.sharding import param


class Dense(nnx.Module):
    """x [..., *in_shape] -> y [..., *out_shape]; W [*in_shape, *out_shape].

    Init: normal with std = init_scale / sqrt(prod(in_shape)) (fan-in scaling). ``fp8``: the
    product in FP8 (the module docstring), else in ``dtype``; the parameters are the same.
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
        fp8: bool = False,
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
        self.fp8 = fp8
        self._eq = _equation(len(self.in_shape), len(self.out_shape))

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[x.ndim - len(self.in_shape):] != self.in_shape:
            raise ValueError(f"Dense: input {x.shape} does not end in {self.in_shape}")
        # Operands and result in the compute dtype; the matrix units accumulate in float32
        # anyway. Asking for a float32 result instead would make the backward pass multiply a
        # float32 cotangent with bf16 operands, which XLA runs as a float32 GEMM (several times
        # slower); f32_logits below is the variant for the one product that wants float32 out.
        w, w_lo = master_and_copy(self.kernel)
        if self.fp8:
            return fp8_einsum(self._eq, x.astype(self.dtype), w, w_lo)
        if jnp.dtype(self.dtype).itemsize < jnp.dtype(w.dtype).itemsize:
            return low_precision_einsum(len(self.in_shape), len(self.out_shape), self.dtype,
                                        x, w, w_lo)
        return jnp.einsum(self._eq, x.astype(self.dtype), w.astype(self.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Precast:
    """A weight kept in float32 (``master``) with its copy in the compute dtype (``low``), made
    once per training step instead of once per micro-batch (``precast``).

    Dense multiplies by ``low`` and returns the weight's gradient to ``master`` in float32.
    Anything else that reads the variable (``kernel[...]``) sees ``master``: the copy is only
    a faster way to run Dense's own product.
    """

    master: jax.Array
    low: jax.Array

    def __getitem__(self, index):
        return self.master[index]


def master_and_copy(variable: nnx.Variable) -> tuple[jax.Array, jax.Array | None]:
    """(the parameter's value, its copy in the compute dtype or None): a Precast's two parts."""
    value = variable.get_value()
    if isinstance(value, Precast):
        return value.master, value.low
    return value, None


def precast(params, dtype, keys: Sequence[str] = ("kernel", "embedding")):
    """``params`` (a nested dict) with every floating leaf named in ``keys`` that is wider than
    ``dtype`` replaced by ``Precast(leaf, leaf.astype(dtype))``: the weights Dense and the output
    head multiply in ``dtype``.

    The gradient accumulation loop passes the copies into every micro-batch, so the parameters
    are rounded once per step: rounded inside the loop, every micro-batch would read each
    float32 weight and write its bf16 copy again. Not differentiated: the products take the
    copy through ``_copy_in``, which stops its gradient, so gradients flow to ``master`` only.
    """
    dtype = jnp.dtype(dtype)

    def one(path, leaf):
        name = getattr(path[-1], "key", None) if path else None
        if (name in keys and jnp.issubdtype(leaf.dtype, jnp.floating)
                and dtype.itemsize < jnp.dtype(leaf.dtype).itemsize):
            return Precast(leaf, leaf.astype(dtype))
        return leaf

    return jax.tree_util.tree_map_with_path(one, params)


# The weights whose gradients ``train.grad_accum_dtype = "bfloat16"`` takes and sums in the
# compute dtype: the matrices (Dense kernels, routed experts). The embedding's gradient, a
# scatter-add of every token's row, the vectors and the MoE router (it chooses experts in
# float32) stay float32.
LOW_GRAD_KEYS = ("kernel", "wi", "wo")
FULL_PRECISION_MODULES = ("router",)


def low_copies(params, dtype):
    """``params`` (a nested dict) with each floating matrix named in ``LOW_GRAD_KEYS`` outside
    ``FULL_PRECISION_MODULES`` rounded to ``dtype``, the rest as they are: what a
    bfloat16-accumulated micro-batch differentiates."""
    dtype = jnp.dtype(dtype)

    def one(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if (names and names[-1] in LOW_GRAD_KEYS and jnp.issubdtype(leaf.dtype, jnp.floating)
                and not set(names) & set(FULL_PRECISION_MODULES)
                and dtype.itemsize < jnp.dtype(leaf.dtype).itemsize):
            return leaf.astype(dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(one, params)


def with_copies(params, copies):
    """``params`` with each leaf that ``copies`` (``precast(params, ...)``, made outside the
    function being differentiated) holds as a Precast given that copy: the gradient with
    respect to ``params`` then flows to the float32 leaves, while Dense multiplies by the
    copies."""
    return jax.tree.map(lambda p, c: Precast(p, c.low) if isinstance(c, Precast) else p,
                        params, copies)


def _equation(n_in: int, n_out: int) -> str:
    """Dense's product y = x W for ``n_in`` input and ``n_out`` output axes (any leading axes)."""
    letters = string.ascii_letters
    ins, outs = letters[:n_in], letters[n_in:n_in + n_out]
    return f"...{ins},{ins}{outs}->...{outs}"


def _transposes(eq: str) -> tuple[str, str]:
    """The two transposes of the product ``eq`` = "x,w->y": dx = dy W^T and dW = x^T dy (summed
    over every axis of x and y that W lacks)."""
    ins, y = eq.split("->")
    x, w = ins.split(",")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


def _copy_in(w: jax.Array, w_lo: jax.Array | None, dtype) -> jax.Array:
    """``w`` in ``dtype``: the copy ``precast`` made when it is one, else rounded here. Never
    differentiated: the products below return the weight's gradient to ``w``."""
    if w_lo is not None and w_lo.shape != w.shape:
        raise ValueError(f"the weight's copy has shape {w_lo.shape}, the weight {w.shape}: "
                         "copies must come from precast of the same parameters")
    if w_lo is None or w_lo.dtype != jnp.dtype(dtype):
        w_lo = w.astype(dtype)
    return jax.lax.stop_gradient(w_lo)


def low_precision_einsum(n_in: int, n_out: int, dtype, x: jax.Array, w: jax.Array,
                         w_lo: jax.Array | None = None) -> jax.Array:
    """Dense's product with the operands rounded to ``dtype`` (bf16) and a ``dtype`` result,
    for a higher-precision (float32) parameter ``w``; ``w_lo``: ``w`` already rounded to
    ``dtype`` (``precast``), or None to round it here.

    The weight's gradient comes out of its matmul in ``w``'s dtype, summed in float32 and never
    rounded to ``dtype``: as autodiff writes it, the transpose of ``w.astype(dtype)`` rounds
    each micro-batch's dW to bf16 and converts it back, and the float32 sum over micro-batches
    is a separate pass over every parameter (read dW, read and write the sum). A float32 dW is
    a GEMM output that XLA can add into the running sum inside the GEMM itself (cuBLAS's
    beta = 1). No gradient flows through ``w_lo``: dW goes to ``w``."""
    return _rounded_einsum(_equation(n_in, n_out), None, x, w, _copy_in(w, w_lo, dtype))


def f32_out_einsum(eq: str, x: jax.Array, w: jax.Array, w_lo: jax.Array | None = None
                   ) -> jax.Array:
    """``einsum(eq, x, w)`` with a float32 result (the output head's logits) from ``x`` in the
    compute dtype and ``w`` rounded to it (``w_lo``: that copy made already, ``precast``).

    The backward pass multiplies in the compute dtype too: the float32 cotangent is rounded
    first, as the forward's operands were. The weight's gradient comes out of its matmul in
    ``w``'s dtype (float32 parameters: never rounded to bf16, as in Dense)."""
    return _rounded_einsum(eq, jnp.float32, x, w, _copy_in(w, w_lo, x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rounded_einsum(eq: str, out_dtype, x: jax.Array, w: jax.Array, w_lo: jax.Array
                    ) -> jax.Array:
    """einsum(eq, x, w) from x and w rounded to ``w_lo``'s dtype, the result in ``out_dtype``
    (None: that dtype); the backward multiplies in it too, and dW comes out in ``w``'s dtype."""
    return jnp.einsum(eq, x.astype(w_lo.dtype), w_lo, preferred_element_type=out_dtype)


def _rounded_fwd(eq, out_dtype, x, w, w_lo):
    x_lo = x.astype(w_lo.dtype)
    # Empty arrays carry x's and w's dtypes to the backward (residuals must be JAX values).
    return (jnp.einsum(eq, x_lo, w_lo, preferred_element_type=out_dtype),
            (x_lo, w_lo, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype)))


def _rounded_bwd(eq, out_dtype, residuals, dy):
    x_lo, w_lo, x_like, w_like = residuals
    eq_dx, eq_dw = _transposes(eq)
    dy = dy.astype(w_lo.dtype)
    dx = jnp.einsum(eq_dx, dy, w_lo).astype(x_like.dtype)
    dw = jnp.einsum(eq_dw, x_lo, dy, preferred_element_type=w_like.dtype)
    return dx, dw, None  # w_lo is a copy of w (stop_gradient): its gradient is w's


_rounded_einsum.defvjp(_rounded_fwd, _rounded_bwd)


# ---------------------------------------------------------------------------------------------
# FP8 products (model.matmul_format = "fp8"; the module docstring gives the equations)
# ---------------------------------------------------------------------------------------------

E4M3 = jnp.float8_e4m3fn  # the forward operands x and W: 3 mantissa bits, finite up to +-448
E5M2 = jnp.float8_e5m2  # the incoming gradient dy: 2 mantissa bits, up to +-57344


def _qwix():
    """Qwix, the FP8 products' quantisation library: an optional dependency (the ``fp8`` extra),
    imported where the first FP8 product is traced, so that a bf16 model never loads it."""
    try:
        import qwix  # optional backend: pip install 'kimi_k3[fp8]'
    except ImportError as err:
        raise ImportError(f"model.matmul_format='fp8' needs Qwix: pip install 'kimi_k3[fp8]' "
                          f"({err})") from err
    return qwix


def quantize(a: jax.Array, qtype):
    """``a`` as a Qwix ``QArray`` of ``qtype`` (E4M3 or E5M2) with one float32 scale for the
    whole tensor, from its absolute maximum now: s = max|a| / max(qtype) (1 where that is below
    sqrt(tiny float32)), qvalue = round_to_nearest_even(clip(a / s, -max, max)), all in
    float32."""
    return _qwix().quantize(a.astype(jnp.float32), qtype)


def fp8_einsum(eq: str, x: jax.Array, w: jax.Array, w_lo: jax.Array | None = None
               ) -> jax.Array:
    """``einsum(eq, x, w)`` (eq = "x,w->y") in FP8, the result in x's dtype: x and w quantised
    to E4M3 (w from its compute-dtype copy ``w_lo`` where ``precast`` made one), the backward's
    dy to E5M2; the two backward products reuse the forward's quantised x and w. dW comes out
    in w's dtype (float32 master weights: never rounded to bf16); none flows through w_lo.

    Inside ``jax.shard_map`` (the experts' dispatch) the operands are first marked as varying
    over the same mesh axes, as ``jnp.einsum`` does implicitly: the custom backward's dW then
    has w's type, and autodiff sums it over the axes w was shared along."""
    src = jax.lax.stop_gradient(w if w_lo is None else _copy_in(w, w_lo, w_lo.dtype))
    x, w, src = (vary_like(a, x, w, src) for a in (x, w, src))
    return _fp8_einsum(eq, x, w, src)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_einsum(eq: str, x: jax.Array, w: jax.Array, w_src: jax.Array) -> jax.Array:
    """``fp8_einsum`` from the weight's source ``w_src``; ``w`` gives the gradient's dtype."""
    return _fp8_fwd(eq, x, w, w_src)[0]


def _scaled_einsum(eq: str, a_q, b_q, out_dtype) -> jax.Array:
    """``einsum(eq)`` of two per-tensor ``QArray``s in ``out_dtype``: the dot of their FP8 values
    (float32 accumulation) times the product of their scales. Written as Flax's ``fp8_ops``
    write it for XLA's GPU compiler, which makes the dot of f8 operands a cuBLASLt FP8 GEMM (Ada,
    Hopper) and folds the multiply by a broadcast scalar into it. The dot's result is already
    in ``out_dtype``, so a remat policy that keeps matmul outputs keeps bf16 ones, as without
    FP8."""
    y = jnp.einsum(eq, a_q.qvalue, b_q.qvalue, preferred_element_type=out_dtype)
    return y * (a_q.scale * b_q.scale).reshape(()).astype(out_dtype)


def _fp8_fwd(eq, x, w, w_src):
    x_q, w_q = quantize(x, E4M3), quantize(w_src, E4M3)
    y = _scaled_einsum(eq, x_q, w_q, x.dtype)
    # Empty arrays carry x's and w's dtypes to the backward (residuals must be JAX values).
    return y, (x_q, w_q, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fp8_bwd(eq, residuals, dy):
    x_q, w_q, x_like, w_like = residuals
    eq_dx, eq_dw = _transposes(eq)
    dy_q = quantize(dy, E5M2)
    dx = _scaled_einsum(eq_dx, dy_q, w_q, x_like.dtype)
    dw = _scaled_einsum(eq_dw, x_q, dy_q, w_like.dtype)
    return dx, dw, None  # w_src is a copy of w (stop_gradient): its gradient is w's


_fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)
