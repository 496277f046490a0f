"""What KDA's Hopper (sm_90) kernels in Pallas' Mosaic GPU backend share: the backward's
``kda_mgpu_bwd.intra_bwd_scores`` and the state passes of ``kda_mgpu_state``.

Those kernels take whole [C, K] / [C, V] operands: C = CHUNK rows (one wgmma M tile) and K, V
in WHOLE_DIMS (64 or 128 columns: one or two 128-byte swizzle rows of bf16). ``kda_calls``
dispatches to them as ``KernelTuning.hopper`` says (``kda_calls.mosaic_gpu_mode``: compiled on a
card where ``pallas_kernels.device.probe`` finds Mosaic GPU, or in Mosaic GPU interpret mode).
"""

from __future__ import annotations

import jax.numpy as jnp

try:  # Pallas-Mosaic GPU (absent from some JAX builds)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed JAX
    plgpu = None

CHUNK = 64  # rows: one wgmma M tile
# K and V of the kernels, whose tiles are whole [C, K] / [C, V] operands: at 64 each is one
# swizzle row (configs/small.py's heads), at 128 two
WHOLE_DIMS = (64, 128)


def interpret_params():
    """Mosaic GPU interpret-mode parameters (runs the kernel on CPU), or None if unavailable."""
    cls = getattr(plgpu, "InterpretGPUParams", None) if plgpu is not None else None
    if cls is None:
        try:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
        except ImportError:  # pragma: no cover
            return None
    return cls()


def _swizzled(shape, dtype):
    """SMEM tiled (8 rows x one 128-byte swizzle row) and swizzled: the layout wgmma operands
    need, and the conflict-free one for WGMMA-layout loads and stores."""
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128)))
