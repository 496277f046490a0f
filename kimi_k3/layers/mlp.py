"""SwiGLU MLP.

    MLP(x) = W_o ( SiLU(x W_gate) * (x W_up) )      W_gate, W_up [D, F] (fused as [D, 2, F]),
                                                    W_o [F, D]

With ``impl="pallas"`` the activation's backward pass is a kernel that writes the gate's and
the up projection's gradients straight into the fused [B, T, 2, F] layout
(``pallas_kernels.swiglu``); the forward pass and the equation are the same either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_k3.layers.dense import Dense
from kimi_k3.sharding import BTF, constrain
from pallas_kernels import device
from pallas_kernels import swiglu as swiglu_kernel


class SwiGLU(nnx.Module):
    """x [B, T, D] -> [B, T, D]. ``impl``: "xla" or "pallas" (resolved already:
    ``dispatch.choose_mlp_impl``); ``fp8``: both projections multiply in FP8
    (``layers/dense.py``)."""

    def __init__(self, d_model: int, mlp_dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, impl: str = "xla", fp8: bool = False):
        if impl not in ("xla", "pallas"):
            raise ValueError(f"SwiGLU: impl must be 'xla' or 'pallas', got {impl!r}")
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, fp8=fp8)
        self.impl = impl
        # One matmul for both input projections; axis 1 is (gate, up).
        self.wi = Dense(d_model, (2, mlp_dim), names=("embed", None, "mlp"), **kw)
        self.wo = Dense(mlp_dim, d_model, names=("mlp", "embed"), **kw)

    @jax.named_scope("mlp")
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        h_BxTx2xF = self.wi(x_BxTxD)
        if self.impl == "pallas" and _kernel_fits(h_BxTx2xF):
            h_BxTxF = _swiglu_kernel_vjp(h_BxTx2xF)
        else:
            h_BxTxF = swiglu_kernel.swiglu_reference(h_BxTx2xF)
        return self.wo(constrain(h_BxTxF, BTF))


def _kernel_fits(h_BxTx2xF: jax.Array) -> bool:
    """Whether the backward kernel takes h: a width with a column tile, Pallas-Triton present,
    and no mesh splitting the array (the kernel sees whole arrays)."""
    if swiglu_kernel.columns_for(h_BxTx2xF.shape[-1]) is None or device.pallas_triton() is None:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


@jax.custom_vjp
def _swiglu_kernel_vjp(h_BxTx2xF: jax.Array) -> jax.Array:
    """``swiglu_reference`` whose backward pass is ``pallas_kernels.swiglu.swiglu_backward``."""
    return swiglu_kernel.swiglu_reference(h_BxTx2xF)


def _swiglu_fwd(h_BxTx2xF):
    return swiglu_kernel.swiglu_reference(h_BxTx2xF), h_BxTx2xF


def _swiglu_bwd(h_BxTx2xF, dy_BxTxF):
    *lead, two, F = h_BxTx2xF.shape
    dh_Nx2xF = swiglu_kernel.swiglu_backward(h_BxTx2xF.reshape(-1, two, F),
                                             dy_BxTxF.astype(h_BxTx2xF.dtype).reshape(-1, F))
    return (dh_Nx2xF.reshape(h_BxTx2xF.shape),)


_swiglu_kernel_vjp.defvjp(_swiglu_fwd, _swiglu_bwd)
