"""Gated multi-head latent attention (MLA) with no positional encoding.

With x [B, T, D], H heads, latent rank R (kv_lora_rank), head dims dn (keys/queries, per head),
ds (the shared key slice), dv (values):

    c   = RMSNorm(x W_dkv)                      [B, T, R]     the cached latent
    k_s = x W_ks                                [B, T, ds]    shared by every head, cached
    k_h = [c W_uk,h ; k_s]                      [B, T, H, dn + ds]
    v_h = c W_uv,h                              [B, T, H, dv]
    q_h = x W_q,h   or   RMSNorm(x W_dq) W_uq,h (q_lora_rank > 0)      [B, T, H, dn + ds]
    o_h = softmax(q_h k_h^T / sqrt(dn + ds) + causal/segment mask) v_h
    o_h <- o_h * sigmoid(x W_g)_h               elementwise output gate (optional)
    out = W_o [o_1 ... o_H]                     [B, T, D]

No RoPE or any other position signal: order comes from the KDA layers. Training attention runs
blockwise (see layers/attention.py), so no T x T matrix is built.

Decoding and prefill in pieces cache [c ; k_s] per token (R + ds numbers, whatever H) and attend
in the latent space ("absorption"): q'_h = [q_nope,h W_uk,h^T ; q_s,h] against keys [c ; k_s],
values c, then o_h = o'_h W_uv,h. That is multi-query attention with head dims R + ds / R; the
scores equal the ones above because q_nope,h . (c W_uk,h) = (q_nope,h W_uk,h^T) . c.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_k3.config import MlaSpec
from kimi_k3.layers.attention import attention
from kimi_k3.layers.dense import Dense
from kimi_k3.layers.norms import RMSNorm
from kimi_k3.sharding import BTHK, constrain


class GatedMLA(nnx.Module):
    """x [B, T, D] -> [B, T, D], optionally continuing from and returning a latent cache.

    The mixer interface (shared with KDALayer): ``Mixer(d_model, spec, *, rngs, dtype,
    param_dtype)``, ``init_cache(batch_size, max_len)``, ``__call__(x, segment_ids, cache, pos)
    -> (out, cache)``. ``spec`` is checked and resolved already (kimi_k3/config.py).
    """

    def __init__(self, d_model: int, spec: MlaSpec, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        H, R, dn = spec.num_heads, spec.kv_lora_rank, spec.qk_nope_head_dim
        ds, dv, q_lora_rank = spec.shared_head_dim, spec.v_head_dim, spec.q_lora_rank
        self.spec, self.dtype = spec, dtype
        self.scale = (dn + ds) ** -0.5
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if q_lora_rank > 0:
            self.q_down = Dense(d_model, q_lora_rank, names=("embed", "q_lora"), **kw)
            self.q_norm = RMSNorm(q_lora_rank, name="q_lora", dtype=dtype, param_dtype=param_dtype)
            self.q_up = Dense(q_lora_rank, (H, dn + ds), names=("q_lora", "heads", "kv"), **kw)
        else:
            self.q_proj = Dense(d_model, (H, dn + ds), names=("embed", "heads", "kv"), **kw)
        self.kv_down = Dense(d_model, R, names=("embed", "kv_lora"), **kw)
        self.kv_norm = RMSNorm(R, name="kv_lora", dtype=dtype, param_dtype=param_dtype)
        self.k_shared = Dense(d_model, ds, names=("embed", "kv"), **kw)
        self.k_up = Dense(R, (H, dn), names=("kv_lora", "heads", "kv"), **kw)
        self.v_up = Dense(R, (H, dv), names=("kv_lora", "heads", "kv"), **kw)
        if spec.output_gate:
            self.g_proj = Dense(d_model, (H, dv), names=("embed", "heads", "kv"), **kw)
        self.o_proj = Dense((H, dv), d_model, names=("heads", "kv", "embed"), **kw)

    def init_cache(self, batch_size: int, max_len: int) -> dict[str, jax.Array]:
        """Zero cache: ``latent_kv`` [B, max_len, R + ds] = [c ; k_s] per position."""
        R, ds = self.spec.kv_lora_rank, self.spec.shared_head_dim
        return {"latent_kv": jnp.zeros((batch_size, max_len, R + ds), self.dtype)}

    def _queries(self, x_BxTxD):
        if self.spec.q_lora_rank > 0:
            return self.q_up(self.q_norm(self.q_down(x_BxTxD)))
        return self.q_proj(x_BxTxD)

    def __call__(
        self,
        x_BxTxD: jax.Array,
        segment_ids_BxT: jax.Array | None = None,
        cache: dict[str, jax.Array] | None = None,
        pos: jax.Array | int = 0,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """Returns (out [B, T, D], updated cache or None).

        Without a cache: causal attention over these T tokens, masked by ``segment_ids``.
        With a cache: the T tokens sit at positions pos .. pos+T-1 of the cached sequence (one
        document per row); their latents are written there and they attend to positions <= their
        own. pos + T must not exceed the cache's max_len.
        """
        H, R, dn = self.spec.num_heads, self.spec.kv_lora_rank, self.spec.qk_nope_head_dim
        with jax.named_scope("mla_proj"):
            q_BxTxHxQ = constrain(self._queries(x_BxTxD), BTHK)
            c_BxTxR = self.kv_norm(self.kv_down(x_BxTxD))
            ks_BxTxS = self.k_shared(x_BxTxD)
        if cache is None:
            with jax.named_scope("mla_proj"):
                k_nope = self.k_up(c_BxTxR)  # [B, T, H, dn]
                ks_b = jnp.broadcast_to(ks_BxTxS[:, :, None, :],
                                        (*ks_BxTxS.shape[:2], H, ks_BxTxS.shape[-1]))
                k_BxTxHxQ = constrain(jnp.concatenate([k_nope, ks_b.astype(k_nope.dtype)], -1),
                                      BTHK)
                v_BxTxHxV = constrain(self.v_up(c_BxTxR), BTHK)
            with jax.named_scope("mla_attention"):
                o_BxTxHxV = attention(
                    q_BxTxHxQ, k_BxTxHxQ, v_BxTxHxV, scale=self.scale,
                    segment_ids=segment_ids_BxT, impl=self.spec.attn_impl,
                    block_size=self.spec.attn_block_size,
                )
            new_cache = None
        else:
            if segment_ids_BxT is not None:
                raise ValueError("GatedMLA: segment_ids must be None when continuing from a cache")
            new_kv = jnp.concatenate([c_BxTxR, ks_BxTxS.astype(c_BxTxR.dtype)], -1)
            kv_BxSxL = jax.lax.dynamic_update_slice_in_dim(
                cache["latent_kv"], new_kv.astype(cache["latent_kv"].dtype), pos, axis=1
            )
            # Absorb W_uk into the query: q'_h = q_nope,h W_uk,h^T  (latent space, [B, T, H, R]).
            W_uk = self.k_up.kernel[...].astype(self.dtype)  # [R, H, dn]
            q_lat = jnp.einsum("bthn,rhn->bthr", q_BxTxHxQ[..., :dn], W_uk,
                               preferred_element_type=jnp.float32).astype(self.dtype)
            q_abs = jnp.concatenate([q_lat, q_BxTxHxQ[..., dn:]], -1)  # [B, T, H, R + ds]
            kv = kv_BxSxL.astype(self.dtype)[:, :, None, :]  # one key/value head
            o_lat = attention(
                q_abs, kv, kv[..., :R], scale=self.scale, q_offset=pos, impl="xla",
                block_size=self.spec.attn_block_size,
            )  # [B, T, H, R]
            W_uv = self.v_up.kernel[...].astype(self.dtype)  # [R, H, dv]
            o_BxTxHxV = jnp.einsum("bthr,rhv->bthv", o_lat, W_uv,
                                   preferred_element_type=jnp.float32).astype(self.dtype)
            new_cache = {"latent_kv": kv_BxSxL}
        with jax.named_scope("mla_out"):
            if self.spec.output_gate:
                gate = jax.nn.sigmoid(self.g_proj(x_BxTxD).astype(jnp.float32))
                o_BxTxHxV = (o_BxTxHxV.astype(jnp.float32) * gate).astype(self.dtype)
            return self.o_proj(constrain(o_BxTxHxV, BTHK)), new_cache
