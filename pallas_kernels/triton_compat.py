"""Pallas-Triton where this JAX has it, and its launch parameters, for the GPU kernels of the
layers (short_conv.py, depth_read.py).

Pallas-Triton is deprecated in JAX 0.11 and may disappear; ``pl_triton`` is then None and the
layers run their XLA forms (each kernel module's ``available()``).
"""

from __future__ import annotations

try:
    from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover - depends on the installed JAX
    pl_triton = None


def compiler_params(warps: int, stages: int = 1):
    """Triton's launch parameters under either of the names JAX has given them."""
    cls = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return cls(num_warps=warps, num_stages=stages)
