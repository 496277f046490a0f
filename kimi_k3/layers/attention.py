"""Causal softmax attention over packed documents, without ever forming a T x S matrix.

For query i (at position ``q_offset + i``) and key j (at position j):

    o_i = sum_j softmax_j(scale * q_i . k_j + mask_ij) v_j,
    mask_ij = 0 if j <= q_offset + i and segment(i) == segment(j) and j < S, else -inf

Shapes: q [B, T, H, D], k [B, S, KH, D], v [B, S, KH, Dv] with KH dividing H (query heads
h*G .. h*G+G-1 share key/value head h, G = H / KH: multi-query attention when KH = 1, which is
how MLA decodes over its latent cache).

Implementations (``impl=``), one equation:
    "reference"  the T x S softmax, the definition (tests only).
    "xla"        blockwise (flash) attention in plain JAX with a custom VJP: online softmax over
                 key blocks, only the key blocks a query block can see, O(T) memory for forward
                 and backward. Any backend, any shapes. (When T and S fit in one block each,
                 that block is computed directly.)
    "cudnn"      cuDNN flash attention: GPU, bf16/fp16, T == S. Packed documents go through
                 cuDNN's packed layout on Hopper (each row's documents as runs: their offsets
                 and lengths, ``packed_layout``), so no mask exists and blocks across documents
                 are skipped. The layout has room for a fixed number of documents per row, the
                 smallest of ``PACKED_RUNS_PER_ROW`` that the batch's fullest row fits; a row
                 with more than the largest, or a GPU without the packed layout, takes a
                 boolean [B, 1, T, T] mask instead (B T^2 bytes).
    "pallas"     Pallas kernels with segment ids: splash attention on TPU, the Triton flash
                 attention (``jax.experimental.pallas.ops.gpu.attention``) on GPU; T == S.
                 On CPU, splash in interpret mode (checks the TPU path's semantics).
    "auto"       GPU, bf16/fp16: cudnn (with packed documents while the mask stays small,
                 else pallas when T % 128 == 0);
                 TPU: pallas (T % 128 == 0); otherwise, and whenever q_offset != 0 or S != T
                 (prefill, decoding), xla. Decided in kimi_k3/dispatch.py; an explicit impl
                 runs or raises.

Against a cache (prefill in pieces, evaluation at long context), ``cache_attention`` reads the
cache block by block with ``attention_lse`` (each block's output and log-sum-exp, from cuDNN on
GPU, splash on TPU, the blockwise loop elsewhere) and merges the blocks by log-sum-exp.

Value heads narrower than key heads (MLA: 192 vs 128) are zero-padded where a kernel wants
equal head dims, and the padding is sliced off. Under a mesh of several devices the Pallas
kernels run on each device's rows and heads (``sharding.per_device``): the compiler cannot
partition a kernel itself.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kimi_k3.dispatch import attention_fallback, choose_attention_impl, cudnn_fused_attention
from kimi_k3.sharding import ROWS_HEADS, per_device
from pallas_kernels import device, latent_decode

# Finite "minus infinity": masked scores never turn into NaN, even in fully masked blocks.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def _masks(q_seg_BxT, kv_seg_BxS, q_pos_T, kv_pos_S, S):
    """bool [B, T, S]: key visible to query."""
    causal = kv_pos_S[None, :] <= q_pos_T[:, None]
    valid = (kv_pos_S < S)[None, :]
    same = q_seg_BxT[:, :, None] == kv_seg_BxS[:, None, :]
    return same & (causal & valid)[None]


def reference_attention(q, k, v, *, scale, q_segment_ids=None, kv_segment_ids=None, q_offset=0):
    """The definition: materialises the [B, H, T, S] scores. Tests and tiny shapes only."""
    B, T, H, D = q.shape
    S, KH = k.shape[1], k.shape[2]
    G = H // KH
    q_seg, kv_seg = _default_segments(q_segment_ids, kv_segment_ids, B, T, S)
    mask = _masks(q_seg, kv_seg, q_offset + jnp.arange(T), jnp.arange(S), S)
    qg = q.reshape(B, T, KH, G, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskv->btkgv", p, v.astype(jnp.float32))
    return o.reshape(B, T, H, v.shape[-1]).astype(v.dtype)


def _default_segments(q_seg, kv_seg, B, T, S):
    if q_seg is None and kv_seg is None:
        return jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    if q_seg is None or kv_seg is None:
        raise ValueError("attention: give both q_segment_ids and kv_segment_ids, or neither")
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Blockwise attention in plain JAX (the "xla" implementation)
# ----------------------------------------------------------------------------------------------


def _blocks(q, k, v, q_seg, kv_seg, bq, bk):
    """Pads T to a multiple of bq and S of bk; returns blocked arrays (block axis first)."""
    B, T, KH, G, D = q.shape
    S = k.shape[1]
    nq, nk = -(-T // bq), -(-S // bk)
    pq, pk = nq * bq - T, nk * bk - S
    q = jnp.pad(q, ((0, 0), (0, pq), (0, 0), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, pk), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pk), (0, 0), (0, 0)))
    q_seg = jnp.pad(q_seg, ((0, 0), (0, pq)), mode="edge")
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pk)), mode="edge")
    qb = q.reshape(B, nq, bq, KH, G, D).swapaxes(0, 1)  # [nq, B, bq, KH, G, D]
    kb = k.reshape(B, nk, bk, KH, D).swapaxes(0, 1)  # [nk, B, bk, KH, D]
    vb = v.reshape(B, nk, bk, KH, v.shape[-1]).swapaxes(0, 1)
    qsb = q_seg.reshape(B, nq, bq).swapaxes(0, 1)
    ksb = kv_seg.reshape(B, nk, bk).swapaxes(0, 1)
    return qb, kb, vb, qsb, ksb


def _block_scores(q_blk, k_blk, qs_blk, ks_blk, i, j, bq, bk, q_offset, S, scale):
    """Masked scores [B, KH, G, bq, bk] (f32) and the mask [B, 1, 1, bq, bk]."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    q_pos = q_offset + i * bq + jnp.arange(bq)
    kv_pos = j * bk + jnp.arange(bk)
    mask = _masks(qs_blk, ks_blk, q_pos, kv_pos, S)[:, None, None]
    return jnp.where(mask, s, _NEG), mask


def _num_kv_blocks(i, bq, bk, nk, q_offset):
    """Key blocks query block i can see: those starting at or before its last position."""
    last = q_offset + (i + 1) * bq - 1
    return jnp.minimum(nk, last // bk + 1)


def _first_q_block(j, bq, bk, nq, q_offset):
    """First query block that can see key block j (its last query position >= j * bk)."""
    # Smallest i with q_offset + (i + 1) * bq - 1 >= j * bk.
    return jnp.clip((j * bk - q_offset) // bq, 0, nq)


def _flash_fwd_impl(q, k, v, q_seg, kv_seg, q_offset, scale, bq, bk):
    B, T, KH, G, D = q.shape
    S, Dv = k.shape[1], v.shape[-1]
    qb, kb, vb, qsb, ksb = _blocks(q, k, v, q_seg, kv_seg, bq, bk)
    nq, nk = qb.shape[0], kb.shape[0]

    def q_block(args):
        i, q_blk, qs_blk = args

        def kv_step(j, carry):
            m, l, acc = carry
            s, _ = _block_scores(q_blk, kb[j], qs_blk, ksb[j], i, j, bq, bk, q_offset, S, scale)
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            l = alpha * l + p.sum(-1)
            pv = jnp.einsum("bkgqs,bskv->bkgqv", p.astype(vb.dtype), vb[j],
                            preferred_element_type=jnp.float32)
            return m_new, l, alpha[..., None] * acc + pv

        init = (jnp.full((B, KH, G, bq), _NEG, jnp.float32), jnp.zeros((B, KH, G, bq), jnp.float32),
                jnp.zeros((B, KH, G, bq, Dv), jnp.float32))
        m, l, acc = lax.fori_loop(0, _num_kv_blocks(i, bq, bk, nk, q_offset), kv_step, init)
        l = jnp.maximum(l, 1e-30)  # rows of padding only
        return acc / l[..., None], m + jnp.log(l)

    o_blk, lse_blk = lax.map(q_block, (jnp.arange(nq), qb, qsb))
    # [nq, B, KH, G, bq, *] -> [B, T, KH, G, *]
    o = jnp.moveaxis(o_blk, 4, 1).reshape(nq * bq, B, KH, G, Dv)
    o = jnp.moveaxis(o, 0, 1)[:, :T]
    lse = jnp.moveaxis(lse_blk, 4, 1).reshape(nq * bq, B, KH, G)
    lse = jnp.moveaxis(lse, 0, 1)[:, :T]
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_seg, kv_seg, q_offset, scale, bq, bk):
    return _flash_fwd_impl(q, k, v, q_seg, kv_seg, q_offset, scale, bq, bk)[0].astype(v.dtype)


def _flash_fwd(q, k, v, q_seg, kv_seg, q_offset, scale, bq, bk):
    o, lse = _flash_fwd_impl(q, k, v, q_seg, kv_seg, q_offset, scale, bq, bk)
    o = o.astype(v.dtype)
    return o, (q, k, v, q_seg, kv_seg, q_offset, o, lse)


def _flash_bwd(scale, bq, bk, res, do):
    q, k, v, q_seg, kv_seg, q_offset, o, lse = res
    B, T, KH, G, D = q.shape
    S, Dv = k.shape[1], v.shape[-1]
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)  # [B, T, KH, G]
    qb, kb, vb, qsb, ksb = _blocks(q, k, v, q_seg, kv_seg, bq, bk)
    nq, nk = qb.shape[0], kb.shape[0]
    pad_t = nq * bq - T

    def block_q_axis(x):  # [B, T, KH, G, *] -> [nq, B, KH, G, bq, *]
        x = jnp.pad(x, [(0, 0), (0, pad_t)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, nq, bq, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 4)

    dob = block_q_axis(do.astype(jnp.float32))  # [nq, B, KH, G, bq, Dv]
    lseb = block_q_axis(lse[..., None])[..., 0]  # [nq, B, KH, G, bq]
    deltab = block_q_axis(delta[..., None])[..., 0]

    def probs(i, j):
        s, mask = _block_scores(qb[i], kb[j], qsb[i], ksb[j], i, j, bq, bk, q_offset, S, scale)
        return jnp.where(mask, jnp.exp(s - lseb[i][..., None]), 0.0)  # [B, KH, G, bq, bk]

    def dscores(i, j, p):
        dp = jnp.einsum("bkgqv,bskv->bkgqs", dob[i], vb[j].astype(jnp.float32))
        return p * (dp - deltab[i][..., None])

    def dq_block(i):
        def step(j, dq):
            p = probs(i, j)
            ds = dscores(i, j, p)
            return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb[j].astype(jnp.float32)) * scale

        zero = jnp.zeros((B, bq, KH, G, D), jnp.float32)
        return lax.fori_loop(0, _num_kv_blocks(i, bq, bk, nk, q_offset), step, zero)

    def dkv_block(j):
        def step(i, carry):
            dk, dv = carry
            p = probs(i, j)
            ds = dscores(i, j, p)
            dv = dv + jnp.einsum("bkgqs,bkgqv->bskv", p, dob[i])
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb[i].astype(jnp.float32)) * scale
            return dk, dv

        zero = (jnp.zeros((B, bk, KH, D), jnp.float32), jnp.zeros((B, bk, KH, Dv), jnp.float32))
        return lax.fori_loop(_first_q_block(j, bq, bk, nq, q_offset), nq, step, zero)

    dq = lax.map(dq_block, jnp.arange(nq))  # [nq, B, bq, KH, G, D]
    dq = jnp.moveaxis(dq, 0, 1).reshape(B, nq * bq, KH, G, D)[:, :T]
    dk, dv = lax.map(dkv_block, jnp.arange(nk))
    dk = jnp.moveaxis(dk, 0, 1).reshape(B, nk * bk, KH, D)[:, :S]
    dv = jnp.moveaxis(dv, 0, 1).reshape(B, nk * bk, KH, Dv)[:, :S]
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q, k, v, *, scale, q_segment_ids=None, kv_segment_ids=None, q_offset=0,
                        block_q=512, block_k=512):
    """The "xla" implementation (see the module docstring); q_offset may be a traced scalar."""
    B, T, H, D = q.shape
    S, KH = k.shape[1], k.shape[2]
    q_seg, kv_seg = _default_segments(q_segment_ids, kv_segment_ids, B, T, S)
    bq = min(block_q, _round_up(T, 8))
    bk = min(block_k, _round_up(S, 8))
    if T <= bq and S <= bk:
        # One block each way: the block itself is the whole score matrix, so the direct form
        # (plain autodiff, no loops) is as small and compiles much faster.
        return reference_attention(q, k, v, scale=scale, q_segment_ids=q_seg,
                                   kv_segment_ids=kv_seg, q_offset=q_offset)
    qg = q.reshape(B, T, KH, H // KH, D)
    q_offset = jnp.asarray(q_offset, jnp.int32)
    o = _flash(qg, k, v, q_seg, kv_seg, q_offset, float(scale), bq, bk)
    return o.reshape(B, T, H, v.shape[-1])


def _round_up(n, m):
    return -(-n // m) * m


# ----------------------------------------------------------------------------------------------
# Kernels: cuDNN (GPU), splash (TPU), Triton flash attention (GPU)
# ----------------------------------------------------------------------------------------------


def _pad_last(x, size):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _cudnn_call(q, k, v, *, scale, mask_type, mask=None, q_len=None, kv_len=None,
                residual=False):
    """cuDNN flash attention: ``mask_type`` one of "causal", "none", "padding" (keys j <
    kv_len [B] visible). Returns o [B, T, H, Dv] (and the log-sum-exp [B, T, H], float32, with
    ``residual``). Uses the MLA-capable entry point where it takes these head dims, else pads v
    to q's head dim."""
    D, Dv = q.shape[-1], v.shape[-1]
    fa = cudnn_fused_attention()
    if fa is not None:
        kind = {"causal": fa.MaskType.CAUSAL, "none": fa.MaskType.NO_MASK,
                "padding": fa.MaskType.PADDING}[mask_type]
        for v_in in (v, _pad_last(v, D)) if Dv != D else (v,):
            try:
                out = fa.dot_product_attention(
                    q, k, v_in, mask=mask, q_seqlen=q_len, kv_seqlen=kv_len, scale=scale,
                    mask_type=kind, return_residual=residual)
            except NotImplementedError:
                continue  # this cuDNN takes no narrower value heads: pad them
            if not residual:
                return out[..., :Dv]
            o, lse_BxHxT = out
            return o[..., :Dv], jnp.swapaxes(lse_BxHxT.astype(jnp.float32), 1, 2)
    out = jax.nn.dot_product_attention(
        q, k, _pad_last(v, D), mask=None if mask is None else mask.astype(bool), scale=scale,
        is_causal=mask_type == "causal", query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
        implementation="cudnn", return_residual=residual)
    if not residual:
        return out[..., :Dv]
    # dispatch.choose_cache_attention_impl never picks cuDNN without that entry point.
    raise ValueError("attention: this JAX has no cuDNN entry point that returns the log-sum-exp "
                     "in float32 (jax.nn's casts it to the output dtype); use impl='xla'")


def _cudnn_packed_call(q, k, v, *, scale, lengths, offsets):
    """cuDNN flash attention over packed documents (Hopper): causal inside each run of
    ``packed_layout`` (``lengths`` and ``offsets``, its starts), no mask in memory. Needs
    jax._src.cudnn's entry point (``cudnn_fused_attention``). Returns o [B, T, H, Dv].

    JAX's packed entry point scales the key offsets by q's per-token stride (heads x D) and
    uses them for v too, so v is always padded to q's head dim here (narrower value heads would
    be read out of bounds)."""
    fa = cudnn_fused_attention()
    out = fa.dot_product_attention(
        q, k, _pad_last(v, q.shape[-1]), q_seqlen=lengths, kv_seqlen=lengths, scale=scale,
        mask_type=getattr(fa.MaskType, PACKED_MASK_TYPE), q_offsets=offsets, kv_offsets=offsets)
    return out[..., :v.shape[-1]]


# Documents per row that cuDNN's packed layout makes room for, smallest first: a batch takes
# the smallest room its fullest row fits, and a batch with a fuller row than the largest runs
# through the mask (every program is compiled, one runs). () turns the packed layout off.
# The room costs time even when empty: cuDNN's backward keeps a float32 dq accumulator for
# B x room sequences of T tokens (B x 32 x T x H x D x 4 bytes at a room of 32), so the small
# room serves the common rows (the stdlib rows hold one or two documents, rarely more than four)
# and the large one the rest; benchmarks/attention_bench.py times the rooms.
PACKED_RUNS_PER_ROW = (8, 32)


# cuDNN's mask type for packed runs: causal inside each run, the run lengths read (padding).
PACKED_MASK_TYPE = "PADDING_CAUSAL"


def _run_starts(segment_ids_BxT: jax.Array) -> jax.Array:
    """[B, T] bool: the tokens that start a run of equal ids (a document)."""
    seg = segment_ids_BxT
    first_Bx1 = jnp.ones((seg.shape[0], 1), bool)
    return jnp.concatenate([first_Bx1, seg[:, 1:] != seg[:, :-1]], axis=1)


def documents_per_row(segment_ids_BxT: jax.Array) -> jax.Array:
    """[B] int32: the runs of equal ids (documents) in each row."""
    return jnp.sum(_run_starts(segment_ids_BxT), axis=1, dtype=jnp.int32)


def packed_layout(segment_ids_BxT: jax.Array, max_runs: int):
    """Each row's documents as cuDNN's packed layout. A document is a run of equal ids.

    Returns (lengths [B, M] int32, offsets [B, M + 1] int32, runs [B] int32) with M =
    ``max_runs``: run r of row b starts at offsets[b, r] and has lengths[b, r] tokens; entries
    past the row's runs are -1 (as cuDNN's entry point wants them). Valid while runs <= M.
    """
    B, T = segment_ids_BxT.shape
    start_BxT = _run_starts(segment_ids_BxT)
    run_BxT = jnp.cumsum(start_BxT, axis=1, dtype=jnp.int32) - 1
    runs_B = run_BxT[:, -1] + 1
    t_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    b_BxT = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    # Run r's first token writes its position into column r; other tokens write nowhere.
    offsets_BxM1 = jnp.full((B, max_runs + 1), -1, jnp.int32).at[
        b_BxT, jnp.where(start_BxT, run_BxT, max_runs + 1)].set(t_BxT, mode="drop")
    r_M = jnp.arange(max_runs, dtype=jnp.int32)
    ends_BxM = jnp.where(r_M + 1 < runs_B[:, None], offsets_BxM1[:, 1:], T)
    lengths_BxM = jnp.where(r_M < runs_B[:, None], ends_BxM - offsets_BxM1[:, :-1], -1)
    return lengths_BxM, offsets_BxM1, runs_B


def _cudnn_attention(q, k, v, *, scale, segment_ids=None):
    """cuDNN flash attention, causal. A batch whose rows each hold one document: plain causal
    attention, as with no ids. Packed documents: cuDNN's packed layout (Hopper), each document
    attended on its own with no mask in memory; a batch whose fullest row has more documents
    than the largest room in PACKED_RUNS_PER_ROW, and other batches on GPUs without the
    layout, use a [B, 1, T, T] mask (cuDNN reads it as an additive bias, one tile per block:
    memory B T^2, so dispatch keeps it to short rows)."""
    def plain(q, k, v):
        return _cudnn_call(q, k, v, scale=scale, mask_type="causal")

    if segment_ids is None:
        return plain(q, k, v)

    def masked(q, k, v):
        mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
        return _cudnn_call(q, k, v, scale=scale, mask_type="causal", mask=mask)

    runs = jnp.max(documents_per_row(segment_ids))  # documents in the fullest row

    def plain_or_masked():
        return lax.switch(jnp.where(runs == 1, 0, 1), [plain, masked], q, k, v)

    rooms = sorted({min(q.shape[1], m) for m in PACKED_RUNS_PER_ROW if m > 0})
    if not rooms or cudnn_fused_attention() is None:
        return plain_or_masked()  # the layout turned off, or a JAX without its entry point

    def packed(M):
        lengths, offsets, _ = packed_layout(segment_ids, M)
        return lambda q, k, v: _cudnn_packed_call(q, k, v, scale=scale, lengths=lengths,
                                                  offsets=offsets)

    # Runs are documents only when ids never come back (the data pipeline numbers them 1, 2, ..
    # along a row); otherwise, or with too many documents in a row, the mask is the definition.
    ordered = jnp.all(segment_ids[:, 1:] >= segment_ids[:, :-1])
    # Branch 0: every row is one document, so plain causal attention is exact. It is worth its
    # own branch: the packed layout pads v to q's head dim and its backward keeps a dq
    # accumulator per room, so plain attention is markedly faster for such rows
    # (benchmarks/attention_bench.py). Branch 1 + i: the
    # i-th room is the smallest that fits; the last branch: the mask.
    branch = jnp.where(runs == 1, 0,
                       jnp.where(ordered, 1 + jnp.sum(runs > jnp.asarray(rooms)), 1 + len(rooms)))
    try:
        return lax.switch(branch, [plain] + [packed(M) for M in rooms] + [masked], q, k, v)
    except NotImplementedError:  # JAX's entry point: no packed layout on this GPU / cuDNN
        return plain_or_masked()


def _splash_inputs(q, k, v, scale):
    """q, k, v [B, T|S, H|KH, D|Dv] -> splash's [B, H, T|S, *]: key/value heads repeated to H,
    head dims padded to lane multiples (128), the scale folded into q (splash does not scale)."""
    H, KH = q.shape[2], k.shape[2]
    if KH != H:
        k, v = jnp.repeat(k, H // KH, axis=2), jnp.repeat(v, H // KH, axis=2)
    Dp, Dvp = _round_up(q.shape[-1], 128), _round_up(v.shape[-1], 128)
    qh = jnp.swapaxes(_pad_last(q * jnp.asarray(scale, q.dtype), Dp), 1, 2)
    return qh, jnp.swapaxes(_pad_last(k, Dp), 1, 2), jnp.swapaxes(_pad_last(v, Dvp), 1, 2)


def _splash_attention(q, k, v, *, scale, segment_ids):
    """TPU splash attention, causal, with segment ids. Head dims padded to lane multiples (128)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, H, _ = q.shape
    Dv = v.shape[-1]
    qh, kh, vh = _splash_inputs(q, k, v, scale)
    if T % 128:
        raise ValueError(f"attention: splash needs T to be a multiple of 128, got T={T}")
    block = next(b for b in (512, 256, 128) if T % b == 0)
    mask = splash.MultiHeadMask([splash.CausalMask((T, T)) for _ in range(H)])
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                    interpret=device.target_platform() != "tpu")
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    o = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=splash.SegmentIds(q=s, kv=s)))(
        qh, kh, vh, seg
    )
    return jnp.swapaxes(o, 1, 2)[..., :Dv]


def _triton_attention(q, k, v, *, scale, segment_ids, interpret=False):
    """GPU flash attention through Pallas' Triton lowering (jax.experimental), with segment ids.

    ``interpret=True`` runs the same kernel on CPU (tests)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    H, KH = q.shape[2], k.shape[2]
    D, Dv = q.shape[-1], v.shape[-1]
    if KH != H:
        k, v = jnp.repeat(k, H // KH, axis=2), jnp.repeat(v, H // KH, axis=2)
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    # Tiles hold the head dim padded to a power of two; past 128 (MLA's 192 -> 256) the default
    # 128 x 128 forward tiles exceed a Hopper card's shared memory, so they are halved.
    block = 128 if pl_next_pow2(D) <= 128 else 64
    sizes = gpu_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=32,
                                      block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
    o = gpu_attention.mha(q, k, _pad_last(v, D), seg, sm_scale=scale, causal=True,
                          block_sizes=sizes, interpret=interpret)
    return o[..., :Dv]


def pl_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def attention(q, k, v, *, scale=None, segment_ids=None, kv_segment_ids=None, q_offset=0,
              impl="auto", block_size=512):
    """Causal attention; see the module docstring.

    Args:
      q [B, T, H, D], k [B, S, KH, D], v [B, S, KH, Dv]; KH divides H.
      scale: multiplies q.k; default D ** -0.5.
      segment_ids: [B, T] int for the queries (and the keys too when ``kv_segment_ids`` is None
        and S == T): a key is visible only from its own document.
      q_offset: position of query 0 among the keys (int, or a traced scalar for "xla"/"reference").
      impl: "auto" | "reference" | "xla" | "cudnn" | "pallas".
      block_size: query and key block length of the "xla" path.

    Returns o [B, T, H, Dv] in v's dtype.
    """
    B, T, H, D = q.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[-1] != D or H % k.shape[2] != 0:
        raise ValueError(f"attention: k {k.shape} must be [B={B}, S, KH, D={D}] with KH dividing H={H}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention: v {v.shape} must match k {k.shape} in [B, S, KH]")
    S = k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if segment_ids is not None and kv_segment_ids is None:
        if S != T:
            raise ValueError("attention: kv_segment_ids is needed when S != T")
        kv_segment_ids = segment_ids
    continues_cache = not (isinstance(q_offset, int) and q_offset == 0)
    chosen = choose_attention_impl(impl, dtype=jnp.dtype(q.dtype).name, T=T, S=S,
                                   packed=segment_ids is not None,
                                   continues_cache=continues_cache, batch=B)
    if chosen == "reference":
        return reference_attention(q, k, v, scale=scale, q_segment_ids=segment_ids,
                                   kv_segment_ids=kv_segment_ids, q_offset=q_offset)
    if chosen == "cudnn":
        try:
            return _cudnn_attention(q, k, v, scale=scale, segment_ids=segment_ids)
        except (NotImplementedError, RuntimeError) as err:
            attention_fallback(impl, chosen, err)
    elif chosen == "pallas":
        kernel = _triton_attention if device.target_platform() == "gpu" else _splash_attention
        run = lambda q, k, v, seg: kernel(q, k, v, scale=scale, segment_ids=seg)
        try:
            # Under a mesh, on each device's rows and heads: the compiler cannot partition it.
            return per_device(run, (q, k, v, segment_ids),
                              (ROWS_HEADS, ROWS_HEADS, ROWS_HEADS, ("activation_batch", None)),
                              ROWS_HEADS)
        except (ImportError, NotImplementedError, RuntimeError) as err:
            attention_fallback(impl, chosen, err)
    return blockwise_attention(q, k, v, scale=scale, q_segment_ids=segment_ids,
                               kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                               block_q=block_size, block_k=block_size)


# ----------------------------------------------------------------------------------------------
# Attention against a cache, block by block (prefill in pieces, decoding)
# ----------------------------------------------------------------------------------------------

# Scores one call of the "xla" blocks may hold at once (float32): decoding (a few queries)
# takes the whole cache as one key block instead of looping over thousands of small ones.
_SCORE_BYTES = 256 << 20


def attention_lse(q, k, v, *, scale, causal, kv_len=None, impl="xla"):
    """One block of keys: ``(o, lse)`` with o [B, T, H, Dv] (float32) and lse [B, T, H] (float32),

        lse_i = log sum_{j visible} exp(scale q_i . k_j)
        o_i   = sum_{j visible} exp(scale q_i . k_j - lse_i) v_j

    ``causal``: T == S, key j visible to query i iff j <= i (the piece against itself).
    Otherwise every key j < ``kv_len`` (a traced scalar; None = all S) is visible (an earlier
    block of the cache). q [B, T, H, D], k [B, S, KH, D], v [B, S, KH, Dv], KH dividing H.
    ``impl``: "xla" | "reference" | "cudnn" | "pallas" (splash), as chosen by
    ``dispatch.choose_cache_attention_impl``. Every visible set must be non-empty.
    """
    B, T, H, D = q.shape
    S, KH, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if causal and S != T:
        raise ValueError(f"attention_lse: causal needs S == T, got T={T}, S={S}")
    if impl == "cudnn":
        if causal or kv_len is None:
            o, lse = _cudnn_call(q, k, v, scale=scale, mask_type="causal" if causal else "none",
                                 residual=True)
        else:
            o, lse = _cudnn_call(q, k, v, scale=scale, mask_type="padding", residual=True,
                                 q_len=jnp.full((B,), T, jnp.int32),
                                 kv_len=jnp.full((B,), kv_len, jnp.int32))
        return o.astype(jnp.float32), lse
    if impl == "pallas":  # under a mesh, on each device's rows and heads (per_device)
        run = lambda q, k, v, kv_len: _splash_lse(q, k, v, scale=scale, causal=causal,
                                                  kv_len=kv_len)
        kv_len = None if kv_len is None else jnp.asarray(kv_len, jnp.int32)
        return per_device(run, (q, k, v, kv_len), (ROWS_HEADS, ROWS_HEADS, ROWS_HEADS, ()),
                          (ROWS_HEADS, ("activation_batch", None, "activation_heads")))
    kv_pos = jnp.arange(S)
    kv_seg_BxS = jnp.zeros((B, S), jnp.int32)
    if kv_len is not None:  # keys at or past kv_len: another segment than the queries' 0
        kv_seg_BxS = jnp.broadcast_to((kv_pos >= kv_len).astype(jnp.int32), (B, S))
    q_seg_BxT = jnp.zeros((B, T), jnp.int32)
    q_offset = jnp.int32(0 if causal else S)  # non-causal: every key precedes every query
    if impl == "reference":
        mask = _masks(q_seg_BxT, kv_seg_BxS, q_offset + jnp.arange(T), kv_pos, S)  # [B, T, S]
        qg = q.reshape(B, T, KH, H // KH, D)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)  # [B, KH, G, T]
        o = jnp.einsum("bkgts,bskv->btkgv", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
        return o.reshape(B, T, H, Dv), jnp.moveaxis(lse, 3, 1).reshape(B, T, H)
    bq = min(512, _round_up(T, 8))
    bk = min(_round_up(S, 8), max(512, _round_up(_SCORE_BYTES // (4 * B * H * bq), 512)))
    qg = q.reshape(B, T, KH, H // KH, D)
    o, lse = _flash_fwd_impl(qg, k, v, q_seg_BxT, kv_seg_BxS, q_offset, scale, bq, bk)
    return o.reshape(B, T, H, Dv), lse.reshape(B, T, H)


def _splash_lse(q, k, v, *, scale, causal, kv_len):
    """attention_lse through TPU splash attention (save_residuals), interpreted off TPU."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    T, H, S, Dv = q.shape[1], q.shape[2], k.shape[1], v.shape[-1]
    if T % 128 or S % 128:
        raise ValueError(f"attention: splash needs T and S multiples of 128, got T={T}, S={S}")
    qh, kh, vh = _splash_inputs(q, k, v, scale)
    one = splash.CausalMask((T, S)) if causal else splash.FullMask((T, S))
    bq = next(b for b in (512, 256, 128) if T % b == 0)
    bk = next(b for b in (512, 256, 128) if S % b == 0)
    sizes = splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk)
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([one] * H), head_shards=1, q_seq_shards=1, block_sizes=sizes,
        save_residuals=True, interpret=device.target_platform() != "tpu")
    kv_seg = jnp.zeros((S,), jnp.int32)
    if kv_len is not None:
        kv_seg = (jnp.arange(S) >= kv_len).astype(jnp.int32)
    seg = splash.SegmentIds(q=jnp.zeros((T,), jnp.int32), kv=kv_seg)
    o, (lse,) = jax.vmap(lambda a, b, c: kernel(a, b, c, segment_ids=seg))(qh, kh, vh)
    o = jnp.swapaxes(o, 1, 2)[..., :Dv].astype(jnp.float32)  # [B, T, H, Dv]
    return o, jnp.swapaxes(lse, 1, 2).astype(jnp.float32)  # lse [B, H, T] -> [B, T, H]


def merge_lse(o_a, lse_a, o_b, lse_b):
    """Two partial attentions over disjoint key sets -> the attention over their union:
    weights exp(lse - lse_union), lse_union = logaddexp(lse_a, lse_b). o [B, T, H, Dv] and
    lse [B, T, H], float32."""
    lse = jnp.logaddexp(lse_a, lse_b)
    w_a, w_b = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
    return w_a * o_a + w_b * o_b, lse


def cache_attention(q_BxTxHxD, cache_BxSxL, pos, expand, *, scale, impl="xla"):
    """The T queries at positions pos .. pos+T-1 against a cache that already holds their own
    entries: o [B, T, H, Dv] in float32, equal to ``attention(q, k, v, q_offset=pos)`` over
    the expanded cache, without ever expanding more than T cache entries at a time or holding
    more than one block of scores.

    The keys are read in blocks of T entries: blocks 0 .. pos // T - 1 are wholly visible (no
    mask: the kernels' fastest form); when pos is not a multiple of T, the block that it cuts
    is read with the keys at or past pos masked; the piece's own block [pos, pos + T) is
    causal. Each block returns (o, lse) and the blocks are merged by their log-sum-exps
    (:func:`merge_lse`), in a loop whose trip count follows the traced ``pos``.

    ``expand(entries [B, n, L]) -> (k [B, n, KH, D], v [B, n, KH, Dv])`` turns cache entries
    into keys and values (MLA: decompress the latent). pos + T must not exceed S; ``pos`` may be
    traced.
    """
    T = q_BxTxHxD.shape[1]
    pos = jnp.asarray(pos, jnp.int32)

    def block(start, kv_len, causal):
        entries = lax.dynamic_slice_in_dim(cache_BxSxL, start, T, axis=1)
        k, v = expand(entries)
        return attention_lse(q_BxTxHxD, k, v, scale=scale, causal=causal, kv_len=kv_len,
                             impl=impl)

    def whole(j, carry):  # block j lies wholly before the piece: no mask at all
        return merge_lse(*carry, *block(j * T, None, causal=False))

    def partial(carry):  # the block that pos cuts: its keys before pos
        start = pos // T * T
        return merge_lse(*carry, *block(start, pos - start, causal=False))

    carry = block(pos, None, causal=True)
    carry = lax.fori_loop(0, pos // T, whole, carry)
    o, _ = lax.cond(pos % T > 0, partial, lambda c: c, carry)
    return o


# ----------------------------------------------------------------------------------------------
# Decoding: one new token per row against MLA's latent cache
# ----------------------------------------------------------------------------------------------


def _latent_partial(q_BxHxL, kv_BxNxL, first, length, scale):
    """Softmax partial of the positions first .. first + N - 1 (those below ``length``
    visible): (o [B, H, L] float32, not normalised, m [B, H], l [B, H]). The values are the
    whole entries (the caller keeps their first R numbers): slicing the cache for them would
    copy it."""
    s_BxHxN = jnp.einsum("bhl,bnl->bhn", q_BxHxL, kv_BxNxL,
                         preferred_element_type=jnp.float32) * scale
    visible_N = first + jnp.arange(kv_BxNxL.shape[1]) < length
    s_BxHxN = jnp.where(visible_N, s_BxHxN, _NEG)
    m_BxH = jnp.max(s_BxHxN, axis=-1)
    p_BxHxN = jnp.exp(s_BxHxN - m_BxH[..., None])
    o_BxHxL = jnp.einsum("bhn,bnl->bhl", p_BxHxN.astype(kv_BxNxL.dtype), kv_BxNxL,
                         preferred_element_type=jnp.float32)
    return o_BxHxL, m_BxH, jnp.sum(p_BxHxN, axis=-1)


def latent_decode_attention(q_BxHxL, kv, length, *, scale, value_dim, impl="xla", layer=None):
    """One query per row and head against the latent cache: o [B, H, value_dim] float32,

        o_h = sum_{t < length} softmax_t(scale q_h . kv_t) kv_t[:value_dim]

    the multi-query attention MLA decodes with (keys: whole entries [c ; k_s], values: their
    first ``value_dim`` = R numbers; ``layers/mla.py``). ``kv``: [B, S, L] in the cache's
    dtype, or a stack of layers' caches [N, B, S, L] read at ``layer`` (static). ``length``:
    the visible positions, 1 <= length <= S (traced).

    ``impl`` (``dispatch.choose_decode_attention_impl``): "pallas" reads each entry once in one
    kernel pass split over the positions (``pallas_kernels.latent_decode``; the few positions
    past its last whole block here) and merges the partials by their maxima; "xla" is the
    direct form: the scores [B, H, S] in float32, their softmax, the weighted sum (a stacked
    cache's layer is sliced out for it, which XLA may copy; the kernel reads it in place).
    """
    R = value_dim
    if impl == "pallas":
        parts = latent_decode.latent_decode_partials(
            q_BxHxL[..., :R], q_BxHxL[..., R:], kv, length, scale=scale, layer=layer)
        o_BxPxHxR, m_BxPxH, l_BxPxH, S_main = parts
        kv_tail = (kv if layer is None else kv[layer])[:, S_main:]
        if kv_tail.shape[1]:
            o, m, l = _latent_partial(q_BxHxL, kv_tail, S_main, length, scale)
            tail = (o[..., None, :, :R], m[:, None], l[:, None])
            if o_BxPxHxR is None:
                o_BxPxHxR, m_BxPxH, l_BxPxH = tail
            else:
                o_BxPxHxR, m_BxPxH, l_BxPxH = (jnp.concatenate([a, b], axis=1) for a, b in
                                               zip((o_BxPxHxR, m_BxPxH, l_BxPxH), tail,
                                                   strict=True))
        m_BxH = jnp.max(m_BxPxH, axis=1)
        w_BxPxH = jnp.exp(m_BxPxH - m_BxH[:, None])
        l_BxH = jnp.sum(w_BxPxH * l_BxPxH, axis=1)
        return jnp.sum(w_BxPxH[..., None] * o_BxPxHxR, axis=1) / l_BxH[..., None]
    o_BxHxL, _, l_BxH = _latent_partial(q_BxHxL, kv if layer is None else kv[layer], 0, length,
                                        scale)
    return o_BxHxL[..., :R] / l_BxH[..., None]
