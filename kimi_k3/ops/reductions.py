"""Column sums for weight gradients: sum over every token of a [tokens, channels] array.

A per-channel weight (a norm's scale, a pseudo-query) has as gradient a sum over all B x T
tokens of an elementwise product. Left to XLA:GPU, that sum becomes one column reduction over
B T rows, fused with whatever else reads the same inputs; :func:`column_sum` takes it in two
stages that XLA cannot merge back: groups of ``group`` rows first (a reduction with
[rows / group, channels] outputs, many independent blocks, no atomics), then the few partial
sums. RMSNorm's backward pass uses it.

Not a cure for every such sum: where the first stage still fuses with large elementwise
outputs (the short convolutions' backward: XLA merged its first stage and seven [B, T, H, K]
gradient arrays of a KDA layer into one multi-output kernel), it is slower, so the
convolution keeps its one-stage sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROWS_PER_GROUP = 64


def column_sum(x_RxC: jax.Array, group: int = ROWS_PER_GROUP) -> jax.Array:
    """sum_r x[r, c] in float32: [R, C] -> [C].

    Rows are summed ``group`` at a time (the last group padded with zeros), then the partial
    sums; an optimisation barrier between the two keeps them two reductions.
    """
    if x_RxC.ndim != 2:
        raise ValueError(f"column_sum: expects [rows, channels], got shape {x_RxC.shape}")
    if group < 1:
        raise ValueError(f"column_sum: group must be >= 1, got {group}")
    R, C = x_RxC.shape
    x = x_RxC.astype(jnp.float32)
    if R <= group:
        return jnp.sum(x, axis=0)
    pad = -R % group
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    partial_GxC = jnp.sum(x.reshape(-1, group, C), axis=1)
    return jnp.sum(jax.lax.optimization_barrier(partial_GxC), axis=0)
