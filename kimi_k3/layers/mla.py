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

Decoding and prefill in pieces cache [c ; k_s] per token (R + ds numbers, whatever H) and read
the cache in one of two forms, whichever costs fewer FLOPs for a piece of T queries
(``cache_form``):

- "absorbed" (short pieces: decoding): attend in the latent space, q'_h = [q_nope,h W_uk,h^T ;
  q_s,h] against keys [c ; k_s], values c, then o_h = o'_h W_uv,h. That is multi-query attention
  with head dims R + ds / R and no decompression; the scores equal the ones above because
  q_nope,h . (c W_uk,h) = (q_nope,h W_uk,h^T) . c.
- "expanded" (long pieces: prefill, evaluation): the cache is decompressed block by block, T
  entries at a time, into the per-head keys and values above, and the piece attends to each
  block with a flash kernel that returns its log-sum-exp (cuDNN on GPU, splash on TPU); the
  blocks are merged by log-sum-exp (``attention.cache_attention``). Per piece this costs
  2 S R H (dn + dv) FLOPs of decompression against 2 T S H (R + ds + R) of absorbed attention
  over (dn + ds + dv) of expanded, so it wins from T of about R (dn + dv) / (2R - dn - dv).

Context parallelism (tokens split over a "context" mesh axis, ``sharding.context_layout``):
every device all-gathers the latents [c ; k_s] of the whole sequence (R + ds numbers per token,
the smallest thing to move), decompresses the keys and values, and attends with its own
queries at their global positions (shard i's queries sit at i T/n .. (i+1) T/n - 1) under the
causal and segment masks, with the blockwise attention, which skips the key blocks past a
query block. The causal work is not balanced across shards (the last shard does n times the
first one's work; a zig-zag token order would even it out): left for later.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from kimi_k3.config import MlaSpec
from kimi_k3.dispatch import choose_cache_attention_impl, choose_decode_attention_impl
from kimi_k3.layers.attention import (
    attention,
    blockwise_attention,
    cache_attention,
    latent_decode_attention,
)
from kimi_k3.layers.capture import keep
from kimi_k3.layers.dense import Dense
from kimi_k3.layers.fused import shared_input
from kimi_k3.layers.norms import RMSNorm
from kimi_k3.sharding import BTHK, ContextLayout, constrain, context_layout
from pallas_kernels import latent_decode


class GatedMLA(nnx.Module):
    """x [B, T, D] -> [B, T, D], optionally continuing from and returning a latent cache.

    The mixer interface (shared with KDALayer): ``Mixer(d_model, spec, *, rngs, dtype,
    param_dtype, fp8)``, ``init_cache(batch_size, max_len)``, ``__call__(x, segment_ids, cache,
    pos) -> (out, cache)``. ``spec`` is checked and resolved already (kimi_k3/config.py).
    ``fp8``: every projection but the shared key slice's (ds columns: nothing to gain) multiplies
    in FP8 (``layers/dense.py``); the attention itself stays in ``dtype``.
    """

    # Set by kimi_k3/internals.py on its copy of a model: a forward without a cache then keeps
    # the queries and keys (kimi_k3/layers/capture.py).
    capture_internals = False

    # The products that read x, which a decoder holds as one (kimi_k3/layers/fused.py): the
    # query's (q_down with a query bottleneck, else q_proj), the latent's, the shared key's and
    # the output gate's (when the layer has one).
    FUSED = {"x_in": ("q_down", "q_proj", "kv_down", "k_shared", "g_proj")}

    def __init__(self, d_model: int, spec: MlaSpec, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, fp8: bool = False):
        H, R, dn = spec.num_heads, spec.kv_lora_rank, spec.qk_nope_head_dim
        ds, dv, q_lora_rank = spec.shared_head_dim, spec.v_head_dim, spec.q_lora_rank
        self.spec, self.dtype = spec, dtype
        self.scale = (dn + ds) ** -0.5
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        wide = dict(kw, fp8=fp8)
        if q_lora_rank > 0:
            self.q_down = Dense(d_model, q_lora_rank, names=("embed", "q_lora"), **wide)
            self.q_norm = RMSNorm(q_lora_rank, name="q_lora", dtype=dtype, param_dtype=param_dtype)
            self.q_up = Dense(q_lora_rank, (H, dn + ds), names=("q_lora", "heads", "kv"), **wide)
        else:
            self.q_proj = Dense(d_model, (H, dn + ds), names=("embed", "heads", "kv"), **wide)
        self.kv_down = Dense(d_model, R, names=("embed", "kv_lora"), **wide)
        self.kv_norm = RMSNorm(R, name="kv_lora", dtype=dtype, param_dtype=param_dtype)
        self.k_shared = Dense(d_model, ds, names=("embed", "kv"), **kw)
        self.k_up = Dense(R, (H, dn), names=("kv_lora", "heads", "kv"), **wide)
        self.v_up = Dense(R, (H, dv), names=("kv_lora", "heads", "kv"), **wide)
        if spec.output_gate:
            self.g_proj = Dense(d_model, (H, dv), names=("embed", "heads", "kv"), **wide)
        self.o_proj = Dense((H, dv), d_model, names=("heads", "kv", "embed"), **wide)

    def init_cache(self, batch_size: int, max_len: int) -> dict[str, jax.Array]:
        """Zero cache: ``latent_kv`` [B, max_len, R + ds] = [c ; k_s] per position."""
        R, ds = self.spec.kv_lora_rank, self.spec.shared_head_dim
        return {"latent_kv": jnp.zeros((batch_size, max_len, R + ds), self.dtype)}

    def cache_form(self, T: int) -> str:
        """"expanded" or "absorbed": the cheaper way for a piece of T queries to read the cache
        (the module docstring gives the two FLOP counts; per cache entry, the expanded form adds
        the decompression once, the absorbed form pays wider heads per query)."""
        R, dn = self.spec.kv_lora_rank, self.spec.qk_nope_head_dim
        ds, dv = self.spec.shared_head_dim, self.spec.v_head_dim
        expanded = R * (dn + dv) + T * (dn + ds + dv)
        absorbed = T * (2 * R + ds)
        return "expanded" if expanded < absorbed else "absorbed"

    def _keys_values(self, c_BxNxR, ks_BxNxS, names=BTHK):
        """Per-head keys [B, N, H, dn + ds] = [c W_uk,h ; k_s] and values [B, N, H, dv],
        constrained to the logical ``names`` (None: not constrained)."""
        H = self.spec.num_heads
        k_nope = self.k_up(c_BxNxR)  # [B, N, H, dn]
        ks_b = jnp.broadcast_to(ks_BxNxS[:, :, None, :], (*ks_BxNxS.shape[:2], H,
                                                          ks_BxNxS.shape[-1]))
        k_BxNxHxQ = jnp.concatenate([k_nope, ks_b.astype(k_nope.dtype)], -1)
        v_BxNxHxV = self.v_up(c_BxNxR)
        if names is None:  # inside shard_map: nothing to constrain
            return k_BxNxHxQ, v_BxNxHxV
        return constrain(k_BxNxHxQ, names), constrain(v_BxNxHxV, names)

    def _expand(self, latent_BxNxL, names=BTHK):
        """Cache entries [c ; k_s] -> (keys, values) as the whole-sequence path builds them."""
        R = self.spec.kv_lora_rank
        latent_BxNxL = latent_BxNxL.astype(self.dtype)
        return self._keys_values(latent_BxNxL[..., :R], latent_BxNxL[..., R:], names)

    def _attend_expanded(self, q_BxTxHxQ, kv_BxSxL, pos, names=BTHK):
        impl = choose_cache_attention_impl(self.spec.attn_impl, dtype=jnp.dtype(self.dtype).name,
                                           T=q_BxTxHxQ.shape[1])
        expand = lambda e: self._expand(e, names)
        o = cache_attention(q_BxTxHxQ, kv_BxSxL, pos, expand, scale=self.scale, impl=impl)
        return o.astype(self.dtype)

    def _attend_absorbed(self, q_BxTxHxQ, kv_BxSxL, pos, names=BTHK):
        del names  # nothing is constrained here
        R, dn = self.spec.kv_lora_rank, self.spec.qk_nope_head_dim
        # Absorb W_uk into the query: q'_h = q_nope,h W_uk,h^T  (latent space, [B, T, H, R]).
        W_uk = self.k_up.kernel[...].astype(self.dtype)  # [R, H, dn]
        q_lat = jnp.einsum("bthn,rhn->bthr", q_BxTxHxQ[..., :dn], W_uk,
                           preferred_element_type=jnp.float32).astype(self.dtype)
        q_abs = jnp.concatenate([q_lat, q_BxTxHxQ[..., dn:]], -1)  # [B, T, H, R + ds]
        kv = kv_BxSxL.astype(self.dtype)[:, :, None, :]  # one key/value head
        B, T, H = q_abs.shape[:3]
        # Few queries: large key blocks (at most 64M float32 scores per block), not thousands of
        # small steps.
        block_k = max(512, (64 << 20) // (B * H * max(T, 8)) // 512 * 512)
        o_lat = blockwise_attention(q_abs, kv, kv[..., :R], scale=self.scale, q_offset=pos,
                                    block_q=self.spec.attn_block_size, block_k=block_k)
        W_uv = self.v_up.kernel[...].astype(self.dtype)  # [R, H, dv]
        return jnp.einsum("bthr,rhv->bthv", o_lat, W_uv,
                          preferred_element_type=jnp.float32).astype(self.dtype)

    def _attend_context_parallel(self, q_BxTxHxQ, c_BxTxR, ks_BxTxS, segment_ids_BxT,
                                 layout: ContextLayout):
        """Attention with the tokens split over ``layout.axes`` (module docstring): the
        latents gathered, each shard's queries at their global positions."""
        B, T = c_BxTxR.shape[:2]
        whole = ("activation_batch", None, None)  # not split along the tokens: all-gathered
        with jax.named_scope("mla_gather"):
            c_all, ks_all = constrain(c_BxTxR, whole), constrain(ks_BxTxS, whole)
        with jax.named_scope("mla_proj"):
            k_BxTxHxQ, v_BxTxHxV = self._keys_values(
                c_all, ks_all, names=("activation_batch", None, "activation_heads", "activation_kv"))
        if segment_ids_BxT is None:
            segment_ids_BxT = jnp.zeros((B, T), jnp.int32)
        mine = PartitionSpec(layout.batch, layout.axes, layout.heads, None)
        every = PartitionSpec(layout.batch, None, layout.heads, None)
        axes, scale, block = layout.axes, self.scale, self.spec.attn_block_size

        def shard(q, k, v, seg_mine, seg_all):
            offset = lax.axis_index(axes) * q.shape[1]
            return blockwise_attention(q, k, v, scale=scale, q_segment_ids=seg_mine,
                                       kv_segment_ids=seg_all, q_offset=offset,
                                       block_q=block, block_k=block)

        seg = segment_ids_BxT.astype(jnp.int32)
        with jax.named_scope("mla_attention"):
            # check_vma=False: the blockwise attention's loops start from constants, which
            # shard_map's type check would want marked per device; the transposes are the
            # same (the keys' and values' cotangents are summed over the context axis), and
            # tests/context_parallel_check.py holds the gradients to one device's.
            o = jax.shard_map(shard, mesh=layout.mesh, check_vma=False,
                              in_specs=(mine, every, every, layout.tokens,
                                        PartitionSpec(layout.batch, None)),
                              out_specs=mine)(q_BxTxHxQ, k_BxTxHxQ, v_BxTxHxV, seg, seg)
        return o.astype(self.dtype)

    def _attend_cache_context_parallel(self, q_BxTxHxQ, kv_BxSxL, pos, layout: ContextLayout):
        """A piece split over ``layout.axes`` against the cache (prefill in pieces, evaluation):
        every device holds the whole cache, each shard's queries read it at their positions
        pos + i T/n .., in the cheaper of the two forms for a shard."""
        kv_all = constrain(kv_BxSxL, ("activation_batch", None, None))
        n = layout.num_shards
        form = self.cache_form(q_BxTxHxQ.shape[1] // n)
        attend = self._attend_expanded if form == "expanded" else self._attend_absorbed
        axes = layout.axes

        def shard(q, kv, pos):
            return attend(q, kv, pos + lax.axis_index(axes) * q.shape[1], names=None)

        # Heads whole on every device: the decompression inside reads the whole weights.
        mine = PartitionSpec(layout.batch, layout.axes, None, None)
        # check_vma=False: as in _attend_context_parallel (loops starting from constants).
        o = jax.shard_map(shard, mesh=layout.mesh, check_vma=False,
                          in_specs=(mine, PartitionSpec(layout.batch, None, None),
                                    PartitionSpec()),
                          out_specs=mine)(q_BxTxHxQ, kv_all, jnp.asarray(pos, jnp.int32))
        return o.astype(self.dtype)

    def _from_x(self, x_BxTxD):
        """The products that read x (one product in a decoder's fused model,
        kimi_k3/layers/fused.py): (queries [B, T, H, dn + ds], the normed latent c [B, T, R],
        the shared key k_s [B, T, ds], the output gate's pre-activation [B, T, H, dv] or None
        without the gate)."""
        y = shared_input(self, "x_in", x_BxTxD)
        q_BxTxHxQ = (self.q_up(self.q_norm(y["q_down"])) if "q_down" in y else y["q_proj"])
        return q_BxTxHxQ, self.kv_norm(y["kv_down"]), y["k_shared"], y.get("g_proj")

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
        with jax.named_scope("mla_proj"):
            q_BxTxHxQ, c_BxTxR, ks_BxTxS, g_BxTxHxV = self._from_x(x_BxTxD)
            q_BxTxHxQ = constrain(q_BxTxHxQ, BTHK)
        if self.capture_internals and cache is None:
            # What kimi_k3/internals.py reads (its attention probabilities come from these, in
            # plain JAX: the kernels are left alone): q and k [B, T, H, dn + ds].
            keep(self, "q", q_BxTxHxQ)
            keep(self, "k", self._keys_values(c_BxTxR, ks_BxTxS)[0])
        layout = context_layout() if cache is None else None
        if layout is not None:
            o_BxTxHxV = self._attend_context_parallel(q_BxTxHxQ, c_BxTxR, ks_BxTxS,
                                                      segment_ids_BxT, layout)
            new_cache = None
        elif cache is None:
            with jax.named_scope("mla_proj"):
                k_BxTxHxQ, v_BxTxHxV = self._keys_values(c_BxTxR, ks_BxTxS)
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
            layout = context_layout()
            with jax.named_scope("mla_attention"):
                if layout is not None and layout.splits(x_BxTxD.shape[1]):
                    o_BxTxHxV = self._attend_cache_context_parallel(q_BxTxHxQ, kv_BxSxL, pos,
                                                                    layout)
                elif self.cache_form(x_BxTxD.shape[1]) == "expanded":
                    o_BxTxHxV = self._attend_expanded(q_BxTxHxQ, kv_BxSxL, pos)
                else:
                    o_BxTxHxV = self._attend_absorbed(q_BxTxHxQ, kv_BxSxL, pos)
            new_cache = {"latent_kv": kv_BxSxL}
        with jax.named_scope("mla_out"):
            if g_BxTxHxV is not None:
                gate = jax.nn.sigmoid(g_BxTxHxV.astype(jnp.float32))
                o_BxTxHxV = (o_BxTxHxV.astype(jnp.float32) * gate).astype(self.dtype)
            return self.o_proj(constrain(o_BxTxHxV, BTHK)), new_cache

    def step(self, x_Bx1xD: jax.Array, cache: dict[str, jax.Array], pos: jax.Array,
             layer: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One decoding step: (out [B, 1, D], the cache with this token's entry written), the
        numbers of ``__call__`` with a cache for a single token.

        The token at position ``pos`` (traced) writes its entry [c ; k_s] at ``pos`` of the
        cache in place, then attends to positions 0 .. pos in the absorbed form (module
        docstring): q'_h = [q_nope,h W_uk,h^T ; q_s,h] against the entries, one pass over
        them (``latent_decode_attention``), then o_h = o'_h W_uv,h. ``layer``: the cache holds
        a stack of layers' caches [N, B, S, R + ds] (a scanned model's) and this layer's is
        number ``layer`` (static); it is written and read where it lies, never sliced out
        (which would copy it).
        """
        H, R, dn = self.spec.num_heads, self.spec.kv_lora_rank, self.spec.qk_nope_head_dim
        with jax.named_scope("mla_proj"):
            q_Bx1xHxQ, c_Bx1xR, ks_Bx1xS, g_Bx1xHxV = self._from_x(x_Bx1xD)
            q_BxHxQ = q_Bx1xHxQ[:, 0]
            kv = cache["latent_kv"]
            new_Bx1xL = jnp.concatenate([c_Bx1xR, ks_Bx1xS.astype(c_Bx1xR.dtype)], -1)
            new_Bx1xL = new_Bx1xL.astype(kv.dtype)
            if layer is None:
                kv = lax.dynamic_update_slice(kv, new_Bx1xL, (0, pos, 0))
            else:
                kv = lax.dynamic_update_slice(kv, new_Bx1xL[None], (layer, 0, pos, 0))
            # The written cache is the step's output and the attention's input: without the
            # barrier XLA may fuse the write into both, each on its own copy of the cache.
            kv = lax.optimization_barrier(kv)
            W_uk = self.k_up.kernel[...].astype(self.dtype)  # [R, H, dn]
            q_lat_BxHxR = jnp.einsum("bhn,rhn->bhr", q_BxHxQ[..., :dn], W_uk,
                                     preferred_element_type=jnp.float32).astype(self.dtype)
            q_BxHxL = jnp.concatenate([q_lat_BxHxR, q_BxHxQ[..., dn:]], -1).astype(kv.dtype)
        with jax.named_scope("mla_attention"):
            impl = choose_decode_attention_impl(
                self.spec.decode_impl, dtype=jnp.dtype(kv.dtype).name,
                unsupported=latent_decode.unsupported(H, R, self.spec.shared_head_dim))
            o_lat_BxHxR = latent_decode_attention(q_BxHxL, kv, pos + 1, scale=self.scale,
                                                  value_dim=R, impl=impl, layer=layer)
            # rounded as the cache's attention rounds its output, before W_uv
            o_lat_BxHxR = o_lat_BxHxR.astype(kv.dtype).astype(self.dtype)
        with jax.named_scope("mla_out"):
            W_uv = self.v_up.kernel[...].astype(self.dtype)  # [R, H, dv]
            o_Bx1xHxV = jnp.einsum("bhr,rhv->bhv", o_lat_BxHxR, W_uv,
                                   preferred_element_type=jnp.float32).astype(self.dtype)[:, None]
            if g_Bx1xHxV is not None:
                gate = jax.nn.sigmoid(g_Bx1xHxV.astype(jnp.float32))
                o_Bx1xHxV = (o_Bx1xHxV.astype(jnp.float32) * gate).astype(self.dtype)
            return self.o_proj(o_Bx1xHxV), {"latent_kv": kv}
