"""Token embedding and the output head (tied to the embedding, or its own matrix).

    x_t = E[token_t]                         E [V, D], init N(0, 1)
    logits = h E^T / sqrt(D)   (tied)        the 1/sqrt(D) keeps initial logits O(1) with
    logits = h W                (untied)     unit-variance embedding rows; W [D, V] fan-in init
Logits are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kimi_k3.layers.dense import Dense, f32_out_einsum, master_and_copy
from kimi_k3.sharding import param


class Embed(nnx.Module):
    """tokens [B, T] int -> x [B, T, D] in ``dtype``; an id outside [0, V) gives NaN."""

    def __init__(self, vocab_size: int, d_model: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        table = jax.random.normal(rngs.params(), (vocab_size, d_model), jnp.float32)
        self.embedding = param(table.astype(param_dtype), ("vocab", "embed"))
        self.vocab_size = vocab_size
        self.dtype = dtype

    @jax.named_scope("embed")
    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        if not jnp.issubdtype(tokens_BxT.dtype, jnp.integer):
            raise ValueError(f"Embed: tokens must be integers, got {tokens_BxT.dtype}")
        # An id outside [0, V) gives a NaN row, never another token's row: jnp.take would
        # wrap a negative id to the end of the table. The NaN reaches the loss, and the
        # trainer refuses a non-finite step (callers check ids where tokens enter).
        valid_BxT = (tokens_BxT >= 0) & (tokens_BxT < self.vocab_size)
        x_BxTxD = jnp.take(self.embedding[...], jnp.where(valid_BxT, tokens_BxT, 0), axis=0)
        return jnp.where(valid_BxT[..., None], x_BxTxD, jnp.nan).astype(self.dtype)

    @jax.named_scope("head")
    def attend(self, h_BxTxD: jax.Array) -> jax.Array:
        """Tied output head: logits [B, T, V] float32 = h E^T / sqrt(D)."""
        E, E_lo = master_and_copy(self.embedding)
        logits = f32_out_einsum("btd,vd->btv", h_BxTxD.astype(self.dtype), E, E_lo)
        return logits * (E.shape[-1] ** -0.5)


class OutputHead(nnx.Module):
    """Untied output head: logits [B, T, V] float32 = h W."""

    def __init__(self, d_model: int, vocab_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.proj = Dense(d_model, vocab_size, names=("embed", "vocab"), rngs=rngs, dtype=dtype,
                          param_dtype=param_dtype)

    @jax.named_scope("head")
    def __call__(self, h_BxTxD: jax.Array) -> jax.Array:
        W, W_lo = master_and_copy(self.proj.kernel)
        return f32_out_einsum("btd,dv->btv", h_BxTxD.astype(self.proj.dtype), W, W_lo)


# Up to this many chunks, ``chunked_nll(keep_logits=True)`` unrolls its loop over the chunks.
MAX_UNROLLED_CHUNKS = 16


def chunked_nll(h_BxTxD: jax.Array, logits_fn, targets_BxT: jax.Array, chunk: int,
                keep_logits: bool = False) -> jax.Array:
    """Per-token NLL [B, T] float32 = logsumexp(logits) - logits[target], with
    ``logits_fn(h_BxCxD) -> [B, C, V]`` applied to ``chunk`` tokens of every row at a time.

    Only one chunk's float32 logits [B, chunk, V] exist at once in the forward: at long T the
    [B, T, V] logits would be the largest buffer of the model (1M tokens x 32K vocabulary x 4
    bytes = 128 GiB). For the backward each chunk's logits are recomputed (one more head
    matmul per chunk), or with ``keep_logits`` kept from the forward: B x T x V x 4 bytes of
    memory instead of the matmul (the models' remat policies that keep matmul outputs ask for
    this). Targets must lie in [0, V).

    With ``keep_logits`` and at most ``MAX_UNROLLED_CHUNKS`` chunks (training's rows) the
    chunks are a Python loop rather than a ``lax.map``: a map's kept logits are one stacked
    [n, B, chunk, V] buffer that XLA zero-fills, writes chunk by chunk and slices again for the
    backward (three passes over all the logits), where unrolled chunks keep their logits where
    the head wrote them.
    """
    B, T, _ = h_BxTxD.shape
    C = max(1, min(chunk, T))
    n = -(-T // C)
    pad = n * C - T
    h = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, C, -1).swapaxes(0, 1)
    t = jnp.pad(targets_BxT, ((0, 0), (0, pad))).reshape(B, n, C).swapaxes(0, 1)
    policy = jax.checkpoint_policies.save_only_these_names("head_logits") if keep_logits else None

    @functools.partial(jax.checkpoint, policy=policy)
    def one(h_BxCxD, t_BxC):
        logits_BxCxV = checkpoint_name(logits_fn(h_BxCxD).astype(jnp.float32), "head_logits")
        with jax.named_scope("loss"):
            picked = jnp.take_along_axis(logits_BxCxV, t_BxC[..., None], axis=-1)[..., 0]
            return jax.nn.logsumexp(logits_BxCxV, axis=-1) - picked

    if keep_logits and n <= MAX_UNROLLED_CHUNKS:
        nll_NxBxC = jnp.stack([one(h[i], t[i]) for i in range(n)])
    else:
        nll_NxBxC = jax.lax.map(lambda args: one(*args), (h, t))
    return nll_NxBxC.swapaxes(0, 1).reshape(B, n * C)[:, :T]
