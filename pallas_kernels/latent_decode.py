"""Decoding attention over MLA's latent cache in one Pallas (Triton) pass: each cache entry is
read once, in its own dtype, by one program (GPU; interpret mode elsewhere), for
``kimi_k3.layers.attention.latent_decode_attention``.

One new token per row b attends to the cache entries e_t = [c_t ; k_t] (R + D numbers: the
latent and the shared key slice) at positions t < n, with its absorbed query per head
q_h = [q'_h ; q_s,h] (R + D):

    s_ht = scale q_h . e_t,     o_h = sum_{t < n} softmax_t(s_h)_t c_t       [R]

Split over the positions ("flash decoding"), so that one row uses every SM: the grid is
(B, P), program (b, p) walks positions [p C, (p + 1) C) below min(n, S_main) in blocks of
``block_k``, keeping the online softmax of every head at once (the heads share the entries:
a block is loaded once for all of them), and writes its partial

    o_bp [H, R] (float32, not normalised),  m_bp [H] (the running max),  l_bp [H] (the sum)

which the caller merges by their maxima. S_main is the cache length rounded down to whole
blocks: the < ``block_k`` positions past it are the caller's (a few rows in XLA), so no load
ever reaches past the cache. Heads are padded to 16 (the matrix units' smallest tile) and
must be at most ``MAX_HEADS``; R and D must be powers of two >= 16 (``unsupported``).

Bytes: the kernel reads n (R + D) entries once and writes B P H (R + 2) float32 partials;
``DecodeTiles.min_chunk`` keeps the partials a few percent of the entries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import device

f32 = jnp.float32
MAX_HEADS = 64  # a program holds [heads, R] float32 accumulators in registers
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a masked score never makes a NaN


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """Launch parameters: positions per block (a power of two >= 16), Triton warps and
    pipeline stages, the programs to aim for over (rows x splits), and the fewest positions
    one program takes (its partials stay small beside the entries it reads)."""

    block_k: int = 32
    warps: int = 4
    stages: int = 2
    programs: int = 512
    min_chunk: int = 512


# 32 positions x (512 + 64) bf16 = 36 KiB a block, two in flight per program: room on a Hopper
# SM for several programs. 512 programs: about four per SM of an H100 (132) for one row.
DEFAULT_TILES = DecodeTiles()


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def unsupported(num_heads: int, R: int, D: int) -> str | None:
    """None when the compiled kernel takes ``num_heads`` heads, latent rank R and shared key
    width D, else why not (one line). Interpret mode takes any."""
    if num_heads > MAX_HEADS:
        return f"{num_heads} heads, more than the kernel's {MAX_HEADS}"
    for name, n in (("kv_lora_rank", R), ("shared_head_dim", D)):
        if not _pow2(n) or n < 16:
            return f"{name} = {n} is not a power of two >= 16 (the kernel's tiles)"
    return None


def split_plan(S: int, B: int, tiles: DecodeTiles) -> tuple[int, int, int]:
    """(S_main, C, P): positions the kernel reads (S rounded down to whole blocks), positions
    per program (whole blocks) and programs per row, for a cache of S positions and B rows."""
    bk = tiles.block_k
    S_main = S // bk * bk
    if S_main == 0:
        return 0, 0, 0
    blocks = S_main // bk
    P = max(1, min(-(-S_main // tiles.min_chunk), -(-tiles.programs // B)))
    C = -(-blocks // P) * bk
    return S_main, C, -(-S_main // C)


def latent_decode_partials(q_lat_BxHxR, q_rope_BxHxD, kv, length, *, scale: float,
                           layer: int | None = None, tiles: DecodeTiles | None = None,
                           interpret: bool | None = None):
    """The kernel's partials for the positions below min(``length``, S_main):
    (o [B, P, H, R] float32, m [B, P, H] float32, l [B, P, H] float32, S_main).

    q_lat [B, H, R], q_rope [B, H, D] (the cache's dtype); ``kv`` [B, S, R + D], or a stack of
    layers' caches [N, B, S, R + D] read at ``layer`` (static), so a scanned model's stacked
    cache is read where it lies; ``length``: int32 scalar, the positions visible (traced).
    S_main = 0 (a cache shorter than one block): no partials, (None, None, None, 0).
    """
    tiles = tiles or DEFAULT_TILES
    if not _pow2(tiles.block_k) or tiles.block_k < 16:
        raise ValueError(f"DecodeTiles: block_k must be a power of two >= 16, got {tiles}")
    B, H, R = q_lat_BxHxR.shape
    D = q_rope_BxHxD.shape[-1]
    if (layer is None) != (kv.ndim == 3) or kv.shape[-3:] != (B, kv.shape[-2], R + D):
        raise ValueError(f"latent_decode_partials: kv {kv.shape} must be [B={B}, S, {R + D}], "
                         f"or [layers, B, S, {R + D}] with a layer given (got {layer})")
    S_main, C, P = split_plan(kv.shape[-2], B, tiles)
    if S_main == 0:
        return None, None, None, 0
    Hp = max(16, 1 << (H - 1).bit_length())
    pad = ((0, 0), (0, Hp - H), (0, 0))
    q_lat, q_rope = jnp.pad(q_lat_BxHxR, pad), jnp.pad(q_rope_BxHxD, pad)
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    params = None if interpret else device.triton_compiler_params(tiles.warps, tiles.stages)
    bk = tiles.block_k
    lead = () if layer is None else (layer,)

    def kernel(len_ref, qn_ref, qr_ref, kv_ref, o_ref, m_ref, l_ref):
        b, p = pl.program_id(0), pl.program_id(1)
        n = jnp.minimum(len_ref[0], S_main)
        start = p * C
        stop = jnp.minimum(start + C, n)
        blocks = (jnp.maximum(stop - start, 0) + bk - 1) // bk
        qn, qr = qn_ref[...], qr_ref[...]
        dims = (((1,), (1,)), ((), ()))  # a [rows, X] times b [cols, X]: contract X

        def body(i, carry):
            acc, m, l = carry
            t0 = start + i * bk
            kn = kv_ref[(*lead, b, pl.ds(t0, bk), pl.ds(0, R))]  # [bk, R]
            kr = kv_ref[(*lead, b, pl.ds(t0, bk), pl.ds(R, D))]  # [bk, D]
            s = (lax.dot_general(qn, kn, dims, preferred_element_type=f32)
                 + lax.dot_general(qr, kr, dims, preferred_element_type=f32)) * scale
            visible = (t0 + jnp.arange(bk)) < n
            s = jnp.where(visible[None, :], s, _NEG)  # [Hp, bk]
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            pr = jnp.exp(s - m_new[:, None])
            l = alpha * l + jnp.sum(pr, axis=1)
            acc = alpha[:, None] * acc + jnp.dot(pr.astype(kn.dtype), kn,
                                                 preferred_element_type=f32)
            return acc, m_new, l

        init = (jnp.zeros((Hp, R), f32), jnp.full((Hp,), _NEG, f32), jnp.zeros((Hp,), f32))
        acc, m, l = lax.fori_loop(0, blocks, body, init)
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l

    row = lambda *shape: pl.BlockSpec((None, *shape), lambda b, p: (b,) + (0,) * len(shape))
    part = lambda *shape: pl.BlockSpec((None, None, *shape),
                                       lambda b, p: (b, p) + (0,) * len(shape))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, P),
        # length and the cache whole (the kernel indexes them); q and the partials by block
        in_specs=[pl.BlockSpec(), row(Hp, R), row(Hp, D), pl.BlockSpec()],
        out_specs=[part(Hp, R), part(Hp), part(Hp)],
        out_shape=[jax.ShapeDtypeStruct((B, P, Hp, R), f32),
                   jax.ShapeDtypeStruct((B, P, Hp), f32), jax.ShapeDtypeStruct((B, P, Hp), f32)],
        interpret=interpret,
        compiler_params=params,
        name="latent_decode_attention",
    )(jnp.reshape(length, (1,)).astype(jnp.int32), q_lat, q_rope, kv)
    return o[:, :, :H], m[:, :, :H], l[:, :, :H], S_main
