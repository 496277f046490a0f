"""Per-chunk KDA math shared by every kernel layout (GPU-Triton, TPU-Mosaic, interpret mode).

Everything here works on *values* already loaded from refs, one chunk of C rows of one value
head, and uses only operations that lower on both Pallas backends: 2-D dots (NN, NT, TN),
elementwise math, iota masks, reductions and power-of-two reshapes. No slicing of values and
no concatenation (Triton lowers neither); rows are picked with masks instead.

Notation (per chunk, rows i, j = 0..C-1, channels d; all float32 unless said):

    G_i     = sum_{r<=i} g_r                     chunk-local cumulative log-decay, Gam = exp(G)
    E_ijd   = exp(G_id - G_jd)                   pairwise decay, <= 1 for j <= i
    Aqk_ij  = sum_d qs_id k_jd E_ijd             j <= i, same segment   (qs = scale * q)
    Akk_ij  = sum_d k_id  k_jd E_ijd             j <  i, same segment
    L       = Diag(beta) Akk,  T = (I + L)^-1    (unit lower triangular)
    W       = T Diag(beta) (Gam * K * a),  U = T Diag(beta) V
    QG      = qs * Gam * a,  Kg = k * exp(G_last - G) * lm,  gam = exp(G_last) * a_last

with ``a`` = row still in the segment of the incoming state and ``lm`` = row in the segment of
the chunk's last row (both 1 without packed segments). With the state S (kept transposed,
St = S^T of shape [BV, K]) entering the chunk:

    V' = U - W S,   O = QG S + Aqk V',   S <- Diag(gam) S + Kg^T V'

With the gate in the kernel (``KdaConfig.gate``), g itself is computed per chunk from the gate
logits (``gate_from_logits``) and the backward maps dg to df (``gate_logit_grads``).

Scores with the pairwise decay are matmuls by factoring E_ijd = exp(G_id - G_ad) exp(G_ad - G_jd)
around an anchor row a of each sub-chunk of ``sub`` rows (see ``decayed_scores``); the
forward's diagonal blocks, with a bounded gate, around the midpoint of G over each block
(``fwd_mid``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

f32 = jnp.float32

# Exponents of the factored decay stay below this (exp(88) overflows float32).
MAX_FACTORED_EXPONENT = 80.0

# A gate below this (-inf: "forget everything") is taken as this: exp(-120) = 0 in float32
# (below half the smallest denormal, 2^-150 = e^-103.97), so the channel forgets exactly as
# with -inf, while every G - G' stays a finite number (-inf - -inf would be NaN). It is in the
# same binade as e^-104, the least that would do: the cumulative G past it keeps the absolute
# precision of |G| < 128, the range bounded gates (64 tokens of >= -5 per chunk) reach anyway.
# Only without a lower bound (``KdaConfig.forget_gate``): with one, g >= lower_bound.
FORGET_GATE = -120.0


@dataclasses.dataclass(frozen=True)
class KdaConfig:
    """Static description of one kernel call (hashable: it keys jit caches)."""

    B: int
    T: int  # valid tokens per row (the kernel sees T rounded up to whole chunks)
    H: int  # q/k heads
    HV: int  # value heads, a multiple of H
    K: int  # key dim inside the kernels (padded to a power of two >= 16)
    V: int  # value dim inside the kernels (padded likewise)
    k_dim: int  # the caller's key dim (<= K)
    v_dim: int  # the caller's value dim (<= V)
    C: int  # chunk rows
    sub: int  # rows of one anchored sub-chunk
    scale: float
    bounded: bool  # gate bounded below: diagonal sub-blocks factored too
    has_seg: bool  # packed segments present
    cd: str  # dtype of fast dot operands and stored intermediates ("bfloat16" / "float32")
    platform: str  # "gpu" | "tpu" | "cpu": where the body runs (decides dot precision)
    mode: str  # "gpu" | "tpu" | "interpret" | "tpu_interpret"
    # Launch parameters, from pallas_kernels.tuning.KernelTuning (whose comments say why).
    bv_seq: int  # V tile of the sequential (state-carrying) kernels
    bv_intra: int  # V tile of the loops inside the intra-chunk kernels
    bk: int  # K slice of the backward's intra-chunk kernels
    bk_fwd: int  # of the forward's (kda_calls.intra_fwd runs the body with it as bk)
    warps_intra: int  # Triton warps of intra_fwd
    warps_seq: int  # of state_fwd and state_bwd
    warps_grad: int  # of intra_bwd_scores
    warps_chan: int  # of intra_bwd_channels
    stages_seq: int  # Triton pipeline stages of the state passes
    stages_intra: int  # of the intra-chunk kernels
    # Tests: every kernel output starts as NaN (an aliased NaN-filled buffer), so an element a
    # kernel never writes shows up downstream.
    poison: bool = False
    # What the kernels' g input holds: "given" the log-decay g itself; "bounded" or "softplus"
    # the gate logits f, turned into g by ``gate_from_logits`` inside intra_fwd (the gate in
    # the kernel: g never exists in memory, and the backward returns df instead of dg).
    gate: str = "given"
    gate_bound: float = 0.0  # the bounded form's lower_bound (< 0)
    # which kernels run on Mosaic GPU: -1 automatic, 0 none, 1 all that have a Mosaic GPU form
    # (KernelTuning.hopper; kda_calls.mosaic_gpu_mode)
    hopper: int = 0
    # The forward's decayed-score blocks (``decayed_scores``; kda.make_config says why): rows
    # per block, and 1 where their diagonal blocks are factored around the midpoint of G over
    # each block (0: ``sub``-row sub-chunks anchored at their first row).
    fwd_rows: int = 0
    fwd_mid: int = 0
    # The backward's pairwise-decay sums (``pair_grads``): rows per block, their diagonal
    # blocks around their midpoints; 0: ``sub``-row sub-chunks.
    bwd_rows: int = 0
    # the form of the Mosaic GPU state passes (KernelTuning.mgpu_state)
    mgpu_state: int = 0
    # no lower bound: a gate below FORGET_GATE (-inf) is taken as FORGET_GATE (``_fwd_slice``)
    forget_gate: bool = False

    @property
    def N(self) -> int:
        return -(-self.T // self.C)

    @property
    def G(self) -> int:
        return self.HV // self.H

    @property
    def dtype(self):
        return jnp.dtype(self.cd)


# ----------------------------------------------------------------------------- dots


def _fast_precision(cfg: KdaConfig):
    if cfg.dtype == f32 and cfg.platform != "gpu":
        return lax.Precision.HIGHEST
    return None  # bf16 operands, or tf32 on GPU for float32 operands


def _exact_precision(cfg: KdaConfig, cheap: bool = False):
    # The chunk cumsum and the triangular inverse need float32 accuracy. On GPU three tf32
    # passes give it on tensor cores (``cheap``: one pass); CPU and TPU take HIGHEST.
    if cfg.platform == "gpu":
        return None if cheap else lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.HIGHEST


def mm(a, b, cfg: KdaConfig, *, ta: bool = False, tb: bool = False, exact: bool = False,
       split_b: bool = False, cheap: bool = False):
    """a @ b (a^T if ta, b^T if tb) with float32 accumulation.

    Fast dots take operands in ``cfg.cd`` (bf16 tensor cores for bf16 inputs); exact ones stay
    float32. ``split_b`` carries b as bf16 hi + lo (two dots): the pairwise-decay gradients need
    it, because dG adds their row and column sides, which cancel up to rounding.
    """
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    if exact:
        a, b, prec = a.astype(f32), b.astype(f32), _exact_precision(cfg, cheap)
    elif split_b and cfg.dtype != f32:
        a, prec = a.astype(cfg.dtype), _fast_precision(cfg)
        b_hi = b.astype(cfg.dtype)
        b_lo = (b - b_hi.astype(f32)).astype(cfg.dtype)
        return (lax.dot_general(a, b_hi, dims, precision=prec, preferred_element_type=f32)
                + lax.dot_general(a, b_lo, dims, precision=prec, preferred_element_type=f32))
    else:
        a, b, prec = a.astype(cfg.dtype), b.astype(cfg.dtype), _fast_precision(cfg)
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=f32)


# ----------------------------------------------------------------------------- masks


def iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def row_at(x, r):
    """Row r (a traced or static scalar) of x [R, X] as [1, X], by a masked reduction."""
    return jnp.sum(jnp.where(iota(x.shape, 0) == r, x, 0.0), axis=0, keepdims=True)


def last_valid_row(n, cfg: KdaConfig):
    """Index inside chunk n of its last real token (later rows are padding)."""
    return jnp.minimum(cfg.C - 1, cfg.T - 1 - n * cfg.C)


def tril_ones(C, strict=False):
    ri, cj = iota((C, C), 0), iota((C, C), 1)
    return ((cj < ri) if strict else (cj <= ri)).astype(f32)


def pair_masks(segc, segr, cfg: KdaConfig):
    """(j <= i, j < i) masks [C, C], restricted to pairs of one segment."""
    C = cfg.C
    ri, cj = iota((C, C), 0), iota((C, C), 1)
    incl, strict = cj <= ri, cj < ri
    if cfg.has_seg:
        same = segc == segr  # [C, 1] == [1, C]
        incl, strict = incl & same, strict & same
    return incl, strict


def chunk_cumsum(g, cfg: KdaConfig):
    """G = inclusive cumsum over rows of g [C, K]: a scan where the backend lowers one
    (Triton), else an exact dot with a triangle of ones (Mosaic has no cumsum)."""
    if cfg.mode in ("tpu", "tpu_interpret"):
        return mm(tril_ones(cfg.C), g.astype(f32), cfg, exact=True)
    return jnp.cumsum(g.astype(f32), axis=0)


def reverse_cumsum(dG, cfg: KdaConfig):
    """dg_i = sum_{r >= i} dG_r: the transpose of ``chunk_cumsum``, a dot with the triangle of
    ones. Float32 inputs: exact in float32 (tf32x3 on GPU, HIGHEST elsewhere). bf16 inputs: two
    bf16 passes, dG as hi + lo (the ones are exact in bf16): 16 bits of dG, which already
    carries the bf16 error of the state dots that make it (dO S^T, V' dS^T, ...)."""
    if cfg.dtype != f32:
        return mm(tril_ones(cfg.C), dG, cfg, ta=True, split_b=True)
    return mm(tril_ones(cfg.C), dG, cfg, ta=True, exact=True)


# ----------------------------------------------------------------------------- gate


def _sigmoid(x):
    # 1 / (1 + e^-x) saturates to 0 or 1 without NaN (e^-x = inf gives 1/inf = 0), and is how
    # Triton lowers lax.logistic anyway; written out so every backend sees the same formula.
    return 1.0 / (1.0 + jnp.exp(-x))


def _softplus(x):
    # log(1 + e^x) = max(x, 0) + log1p(e^-|x|): no overflow for large x, no loss for small e^x.
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def gate_from_logits(f, A, b, rows_ok, cfg: KdaConfig):
    """The decay gate inside the kernel: g [C, BK] float32 from the gate logits f [C, BK],
    A = exp(A_log) and dt_bias [1, BK] of this value head:

        bounded:   g = lower_bound * sigmoid(A (f + dt_bias))      in [lower_bound, 0]
        softplus:  g = -A softplus(f + dt_bias)                    <= 0

    Rows past the last real token (``rows_ok`` False) get g = 0, as the padded g of the given
    path does: the chunk's last row G_{C-1} decays the state it hands on.
    """
    x = f.astype(f32) + b
    if cfg.gate == "bounded":
        g = cfg.gate_bound * _sigmoid(A * x)
    else:
        g = -A * _softplus(x)
    return jnp.where(rows_ok, g, 0.0)


def gate_logit_grads(dg, f, A, b, rows_ok, cfg: KdaConfig):
    """The chain rule through ``gate_from_logits``, from dg [C, BK] (dL/dg): returns df [C, BK]
    and this chunk's column sums d(dt_bias), dA [1, BK] (the caller adds them over chunks).

    With x = f + dt_bias (so dg/d dt_bias = dg/df):
        bounded, z = A x:  dg/dz = lower_bound sigmoid(z) sigmoid(-z)  (= g (1 - g/lower_bound),
                           but the product of two sigmoids keeps its accuracy where sigmoid(z)
                           rounds to 1);  dg/df = A dg/dz,  dg/dA = x dg/dz
        softplus:          dg/df = -A sigmoid(x),  dg/dA = -softplus(x)
    """
    x = f.astype(f32) + b
    if cfg.gate == "bounded":
        z = A * x
        dg_dz = cfg.gate_bound * _sigmoid(z) * _sigmoid(-z)
        df, dA = dg * A * dg_dz, dg * x * dg_dz
    else:
        df, dA = -dg * A * _sigmoid(x), -dg * _softplus(x)
    df, dA = jnp.where(rows_ok, df, 0.0), jnp.where(rows_ok, dA, 0.0)
    return df, jnp.sum(df, axis=0, keepdims=True), jnp.sum(dA, axis=0, keepdims=True)


# ----------------------------------------------------------------------------- scores


def _block_ids(cfg: KdaConfig, s: int | None = None):
    ri = iota((cfg.C, 1), 0)
    return ri, lax.div(ri, cfg.sub if s is None else s)


def _block_bcast_row(x, t, s):
    """For each sub-chunk of s rows, row t of that sub-chunk broadcast over its rows: [C, X]."""
    C, X = x.shape
    x3 = x.reshape(C // s, s, X)
    sel = jnp.sum(jnp.where(iota((C // s, s, 1), 1) == t, x3, 0.0), axis=1, keepdims=True)
    return jnp.broadcast_to(sel, (C // s, s, X)).reshape(C, X)


def _anchored_columns(y, G, Ga, jlim, cfg: KdaConfig):
    """y_j e^(G_a - G_j) [C, X] for the columns j < jlim of a factored dot, zero for the rest.
    Ga: G at the dot's anchor row a [1, X]; every factor is <= 1 for j <= a and at most
    e^((j - a)|lower_bound|) past it."""
    col_ok = iota((cfg.C, 1), 0) < jlim
    return jnp.where(col_ok, y * jnp.exp(jnp.where(col_ok, Ga - G, 0.0)), 0.0)


def decayed_scores(xs, y, G, lv, cfg: KdaConfig, acc=None):
    """For each x in xs: A[i, j] = sum_d x_id y_jd exp(G_id - G_jd) for j <= i (garbage above),
    added to acc (one [C, C] float32 running sum per x; None: zeros).

    Row sub-chunk ib (rows ib*s .. ib*s+s-1) uses the anchor a = min(ib*s, lv) (never a row past
    the chunk's last real token): A[i, j] = sum_d [x_id e^(G_id - G_ad)] [y_jd e^(G_ad - G_jd)].
    For j < a <= i both factors are <= 1 whatever the gates, so the off-diagonal sub-blocks are
    always one tensor-core matmul. For j inside the sub-chunk the second factor is up to
    e^((s-1)|lower_bound|): allowed only for a bounded gate (``cfg.bounded``); otherwise the
    diagonal sub-blocks are summed exactly by ``_diag_scores``. The sub-chunks are a loop, not
    unrolled, to keep one sub-chunk's temporaries live at a time.

    With ``cfg.fwd_mid`` (bounded gates; ``kda.make_config``) the blocks are
    ``cfg.fwd_rows`` tall: the loop above makes only their off-diagonal parts (j before i's
    block, anchored at the block's first row), and ``_mid_anchored_diagonal`` all diagonal
    blocks in one more dot.
    """
    C = cfg.C
    mid = bool(cfg.fwd_mid)  # make_config sets it for bounded gates only
    s = cfg.fwd_rows if mid else cfg.sub
    _, blk = _block_ids(cfg, s)
    whole_blocks = cfg.bounded and not mid  # the loop's dots take the diagonal blocks too

    def sub_chunk(ib, outs):
        Ga = row_at(G, jnp.minimum(ib * s, lv))  # [1, K]
        in_blk = blk == ib
        y_t = _anchored_columns(y, G, Ga, (ib + 1) * s if whole_blocks else ib * s, cfg)
        e_row = jnp.exp(jnp.where(in_blk, G - Ga, 0.0))
        # [C, K] x [K, C] with the rows outside the sub-chunk zeroed: values cannot be sliced
        # in Triton, and row-blocking the dot by a masked sum measured slower (BENCHMARKS.md)
        return tuple(o + mm(jnp.where(in_blk, x * e_row, 0.0), y_t, cfg, tb=True)
                     for o, x in zip(outs, xs, strict=True))

    outs = tuple(jnp.zeros((C, C), f32) for _ in xs) if acc is None else tuple(acc)
    if mid:
        # first, so that the loop accumulates into the same registers (the off-diagonal dots
        # are exactly zero inside the diagonal blocks); a select, since the diagonal dot is
        # garbage (and may be inf) outside them
        same_block = blk == lax.div(iota((1, C), 1), s)  # [C, C]
        outs = tuple(o + jnp.where(same_block, d, 0.0)
                     for o, d in zip(outs, _mid_anchored_diagonal(xs, y, G, cfg), strict=True))
    first = 0 if whole_blocks else 1  # block 0 has no off-diagonal part
    if C // s - first == 1:  # one block (two mid-anchored halves): static, its masks folded
        outs = sub_chunk(first, outs)
    else:
        outs = lax.fori_loop(first, C // s, sub_chunk, outs)
    if not cfg.bounded:
        diag = _diag_scores(xs, y, G, cfg)
        outs = [o + d for o, d in zip(outs, diag, strict=True)]
    return list(outs)


def _mid_anchored_diagonal(xs, y, G, cfg: KdaConfig):
    """The diagonal blocks of ``decayed_scores`` (blocks of s = cfg.fwd_rows rows), all in one
    dot per x, each block factored around the midpoint of G over it, per channel:

        A[i, j] = sum_d [x_id e^(G_id - M_d)] [y_jd e^(M_d - G_jd)],   i, j in one block,
        M = (G_first + G_last) / 2   (the block's first and last rows).

    Over a block G falls by at most (s-1)|lower_bound|, so every factor lies within
    e^(+-(s-1)|lower_bound|/2) (e^77.5 at lower_bound = -5; ``_mid_anchored_rows`` keeps it
    under MAX_FACTORED_EXPONENT), and for a pair j <= i of a block their product is
    e^(G_i - G_j) <= 1. A midpoint rather than a middle row balances the two sides: a term is
    lost to float32's smallest normal (flushed) only where an operand component is below
    e^(-87.3 + 77.5) ~ 6e-5 at the extreme, where an anchor row at e^80 would lose it below
    7e-4 (the first-row sub-chunks: 5e-6). Pairs j > i of a block reach e^155 (inf in
    float32), and pairs of two blocks are products of two midpoints: the caller drops both
    with a select. Rows past the chunk's last token have g = 0 (padding), so G there is G at
    the last token. Returns one [C, C] float32 array per x."""
    M = _block_midpoints(G, cfg.fwd_rows)
    y_m = y * jnp.exp(M - G)
    e_row = jnp.exp(G - M)
    return [mm(x * e_row, y_m, cfg, tb=True) for x in xs]


def _block_midpoints(G, s: int):
    """[C, K]: per channel, the midpoint (G_first + G_last) / 2 of G over each block of s rows,
    broadcast over the block's rows. One masked reduction: the two rows, each halved (exact)."""
    C, K = G.shape
    G3 = G.reshape(C // s, s, K)
    ends = iota((C // s, s, 1), 1) % (s - 1) == 0  # rows 0 and s-1 of each block
    M = jnp.sum(jnp.where(ends, 0.5 * G3, 0.0), axis=1, keepdims=True)
    return jnp.broadcast_to(M, (C // s, s, K)).reshape(C, K)


def _diag_scores(xs, y, G, cfg: KdaConfig):
    """Diagonal s x s sub-blocks of ``decayed_scores``, exact for any gate (elementwise, f32).

    Column offset t of every sub-chunk at once: A[i, b(i)+t] = sum_d x_id y_{b+t,d}
    exp(min(G_id - G_{b+t,d}, 0)), b(i) the first row of i's sub-chunk. The clamp only touches
    pairs above the diagonal, which the caller masks out.
    """
    C, s = cfg.C, cfg.sub
    ri = iota((C, 1), 0)
    cj = iota((1, C), 1)
    col0 = lax.div(ri, s) * s

    def body(t, outs):
        y_t = _block_bcast_row(y, t, s)
        e = jnp.exp(jnp.minimum(G - _block_bcast_row(G, t, s), 0.0))
        ye = y_t * e
        hit = cj == col0 + t  # [C, C]
        return tuple(
            o + jnp.where(hit, jnp.sum(x * ye, axis=1, keepdims=True), 0.0)
            for o, x in zip(outs, xs, strict=True)
        )

    return lax.fori_loop(0, s, body, tuple(jnp.zeros((C, C), f32) for _ in xs))


def _place_rows(r, ib, C: int):
    """[s, X] -> [C, X]: r in the rows of sub-chunk ib (ib*s .. ib*s+s-1), zeros elsewhere."""
    s, X = r.shape
    r3 = jnp.broadcast_to(r.reshape(1, s, X), (C // s, s, X))
    return jnp.where(iota((C // s, s, 1), 0) == ib, r3, 0.0).reshape(C, X)


def pair_grads(rows, cc, G_row, qs, kf, G, lv, cfg: KdaConfig):
    """The decayed-score gradients, all four at once, for dA in (dAqk, dAkk) zero outside j <= i:

        row side   R_i = sum_j dA_ij X_j exp(G_i - G_j)    rq (dAqk, X = k),  rk (dAkk, X = k)
        col side   R_j = sum_i dA_ij Y_i exp(G_i - G_j)    cq (dAqk, Y = qs), ck (dAkk, Y = k)

    returned as (rq, rk, c = cq + ck) [C, K]: the caller takes the column sides only summed.

    Each dot takes only the s rows of dA (or of dA^T) it needs: ``rows(name, ib)`` loads rows
    ib*s .. ib*s+s-1 of dAqk, dAkk, dAqkT, dAkkT as [s, C]; ``G_row(r)`` row r of G as [1, K].
    The b operands are split bf16 hi + lo (``mm(split_b=True)``): dG takes the difference of
    the two sides, which cancel up to rounding.

    Bounded gate: both sides of sub-chunk ib share the anchor a = min(ib*s, lv) of
    ``decayed_scores``, so two exponentials of D = G - G_a serve all four sums:

        e^(D_i)    rows i >= ib*s (else 0): <= 1        the row side's outer factor and the
                                                         column side's operand factor
        e^(-D_j)   rows j < (ib+1)*s (else 0): <= 1 before the anchor, <= e^((s-1)|lower_bound|)
                                                         in the sub-chunk; the row side's
                                                         operand factor, the column side's outer

    (the zeroed rows meet only zero entries of dA). With ``cfg.bwd_rows``
    (bounded gates; ``kda.make_config``): ``_mid_pair_grads``, in taller blocks from
    the whole matrices ``cc(name)``. Unbounded gate: row side anchor a as above,
    column side anchor b = min(ib*s + s - 1, lv), the sub-chunk's last real row; the factored
    dots cover only j < a (row side) and i > b (column side), and ``_diag_pair_grads`` adds the
    diagonal sub-blocks exactly from the whole matrices ``cc(name)`` for dAqk and dAkk.
    """
    if cfg.bounded and cfg.bwd_rows:
        return _mid_pair_grads(cc, G_row, qs, kf, G, lv, cfg)
    if cfg.bounded:
        return _bounded_pair_grads(rows, G_row, qs, kf, G, lv, cfg)
    C, s = cfg.C, cfg.sub
    ri, blk = _block_ids(cfg)

    def sub_chunk(ib, acc):
        rq, rk, cq, ck = acc
        in_blk = blk == ib
        # row side: the columns before the sub-chunk
        Ga = G_row(jnp.minimum(ib * s, lv))
        X_t = _anchored_columns(kf, G, Ga, ib * s, cfg)  # unbounded: before the sub-chunk
        e_i = jnp.where(in_blk, jnp.exp(jnp.where(in_blk, G - Ga, 0.0)), 0.0)
        rq = rq + e_i * _place_rows(mm(rows("dAqk", ib), X_t, cfg, split_b=True), ib, C)
        rk = rk + e_i * _place_rows(mm(rows("dAkk", ib), X_t, cfg, split_b=True), ib, C)
        # column side: the rows after the sub-chunk, factors e^(G_i - G_b) <= 1
        row_ok = ri >= (ib + 1) * s
        Gb = G_row(jnp.minimum(ib * s + s - 1, lv))
        e_b = jnp.where(row_ok, jnp.exp(jnp.where(row_ok, G - Gb, 0.0)), 0.0)
        e_j = jnp.where(in_blk, jnp.exp(jnp.where(in_blk, Gb - G, 0.0)), 0.0)
        cq = cq + e_j * _place_rows(mm(rows("dAqkT", ib), qs * e_b, cfg, split_b=True), ib, C)
        ck = ck + e_j * _place_rows(mm(rows("dAkkT", ib), kf * e_b, cfg, split_b=True), ib, C)
        return rq, rk, cq, ck

    zero = jnp.zeros(kf.shape, f32)
    out = lax.fori_loop(0, C // s, sub_chunk, (zero,) * 4)
    rq, rk, cq, ck = _diag_pair_grads(out, cc("dAqk"), cc("dAkk"), qs, kf, G, cfg)
    return rq, rk, cq + ck


def _bounded_pair_grads(rows, G_row, qs, kf, G, lv, cfg: KdaConfig):
    """``pair_grads`` for a bounded gate: one anchor per sub-chunk and two exponentials of
    [C, K] (the general form's four, each masked twice, were most of intra_bwd_channels'
    elementwise work); the two column sides share their outer factor, so they are summed
    before it and three accumulators suffice. Masks go into the exponent (e^-inf = 0): no
    masked value can overflow. Written in the order that keeps the fewest [C, K] tiles live,
    except the loads, which come first: the kernels keep program order, so a load placed
    right before its dot makes the dot wait for memory (the loads of one sub-chunk ahead gain
    no more)."""
    C, s = cfg.C, cfg.sub
    ri = iota((C, 1), 0)

    def sub_chunk(ib, acc):
        rq, rk, c = acc
        dAqk, dAkk, dAqkT, dAkkT = (rows(n, ib) for n in ("dAqk", "dAkk", "dAqkT", "dAkkT"))
        D = G - G_row(jnp.minimum(ib * s, lv))
        e_neg = jnp.exp(jnp.where(ri < (ib + 1) * s, -D, -jnp.inf))
        x = kf * e_neg
        r_q, r_k = mm(dAqk, x, cfg, split_b=True), mm(dAkk, x, cfg, split_b=True)
        e_pos = jnp.exp(jnp.where(ri >= ib * s, D, -jnp.inf))
        rq = rq + e_pos * _place_rows(r_q, ib, C)
        rk = rk + e_pos * _place_rows(r_k, ib, C)
        # The column side's outer factor reaches e^((s-1)|lower_bound|), so its inner products
        # go down to e^-75 times dA: small gradients (a mean loss's) would fall under float32's
        # smallest normal and be flushed. The dot takes the rows of dA^T scaled to O(1)
        # (exactly: powers of two), and they are scaled back after the outer factor. (Moving
        # the outer factor to the sub-chunk's last row instead, by e^(G_a - G_b) [1, K], also
        # keeps them, but its products reach e^75 dA, and it spilled more registers.)
        up, down = pow2_row_scales(dAqkT, dAkkT)
        c_sum = (mm(dAqkT * up, qs * e_pos, cfg, split_b=True)
                 + mm(dAkkT * up, kf * e_pos, cfg, split_b=True))
        c = c + e_neg * _place_rows(c_sum, ib, C) * _place_rows(down, ib, C)
        return rq, rk, c

    zero = jnp.zeros(kf.shape, f32)
    return lax.fori_loop(0, C // s, sub_chunk, (zero,) * 3)


def _mid_pair_grads(cc, G_row, qs, kf, G, lv, cfg: KdaConfig):
    """``pair_grads`` in blocks of r = cfg.bwd_rows rows (``kda.make_config``), from the
    whole [C, C] matrices ``cc(name)`` of dAqk, dAkk, dAqkT, dAkkT as ``bwd_intra_scores``
    stores them for these blocks: each row's diagonal block scaled by a power of two, which
    ``cc(name + "_down")`` [C, 1] undoes (``scale_diagonal_blocks``).

    The diagonal blocks, all in one dot per sum, factored around each block's midpoint M
    (``_block_midpoints``; factors within e^(+-(r-1)|lower_bound|/2), as in the forward):

        rq_i = e^(G_i - M) sum_j dAqk_ij k_j e^(M - G_j)      i, j in one block
        c_j  = e^(M - G_j) sum_i (dAqk_ij qs_i + dAkk_ij k_i) e^(G_i - M)

    The outer factors reach e^77.5 at lower_bound = -5, so the inner products must not be
    flushed: each dot takes dA's (or dA^T's) rows masked to the block and scaled to O(1), and
    is scaled back after the outer factor. The scaling is part 1's, once per chunk, rather
    than a masked [C, C] reduction and two casts per matrix for every K slice here. The
    blocks before block ib
    (rows of ib, columns before it) go through its first row a = min(ib*r, lv), both factors
    <= 1, one dot per sum on the whole matrices, whose entries there are not scaled: e^(D_i)
    zeroes the rows outside block ib, e^(-D_j) the columns from it on (so the scaled entries
    meet only zeros)."""
    C, r = cfg.C, cfg.bwd_rows
    ri = iota((C, 1), 0)
    blk = lax.div(ri, r)
    same = blk == lax.div(iota((1, C), 1), r)  # [C, C]: i and j in one block
    M = _block_midpoints(G, r)
    e_up, e_dn = jnp.exp(G - M), jnp.exp(M - G)

    dAqk, dAkk, dAqkT, dAkkT = (cc(name) for name in ("dAqk", "dAkk", "dAqkT", "dAkkT"))

    def diag(dA):  # the block-diagonal part, in its stored dtype: the dot's operand as loaded
        return jnp.where(same, dA, jnp.zeros((), dA.dtype))

    def down(name):
        return cc(name + "_down")

    x = kf * e_dn
    rq = e_up * mm(diag(dAqk), x, cfg, split_b=True) * down("dAqk")
    rk = e_up * mm(diag(dAkk), x, cfg, split_b=True) * down("dAkk")
    # each sum is brought back to size by its outer factor before its own scale: the other
    # order would make products of small gradients (down ~ 2^-24) and e^-77.5 that flush
    c = (e_dn * mm(diag(dAqkT), qs * e_up, cfg, split_b=True) * down("dAqkT")
         + e_dn * mm(diag(dAkkT), kf * e_up, cfg, split_b=True) * down("dAkkT"))
    for ib in range(1, C // r):
        D = G - G_row(jnp.minimum(ib * r, lv))
        e_neg = jnp.exp(jnp.where(ri < ib * r, -D, -jnp.inf))
        e_pos = jnp.exp(jnp.where(blk == ib, D, -jnp.inf))
        x = kf * e_neg
        rq = rq + e_pos * mm(dAqk, x, cfg, split_b=True)
        rk = rk + e_pos * mm(dAkk, x, cfg, split_b=True)
        c = c + e_neg * (mm(dAqkT, qs * e_pos, cfg, split_b=True)
                         + mm(dAkkT, kf * e_pos, cfg, split_b=True))
    return rq, rk, c


def stores_scaled_blocks(cfg: KdaConfig) -> bool:
    """Whether ``bwd_intra_scores`` stores dAqk, dAkk and their transposes with the diagonal
    blocks of their rows scaled, each followed by its scales ``name + "_down"``
    (``scale_diagonal_blocks``), for ``_mid_pair_grads``: a bounded gate with
    ``cfg.bwd_rows``' blocks."""
    return bool(cfg.bounded and cfg.bwd_rows)


def scale_diagonal_blocks(x, r: int):
    """(x', down) for x [R, R] float32: each row's entries inside its diagonal block of r rows
    times up = 1 / down, the power of two that brings the largest of them into [1, 2)
    (``pow2_scales``: exact), the other entries as they are; down [R, 1]."""
    R = x.shape[0]
    same = lax.div(iota((R, 1), 0), r) == lax.div(iota((1, R), 1), r)
    up, down = pow2_scales(jnp.max(jnp.where(same, jnp.abs(x), 0.0), axis=1, keepdims=True))
    return jnp.where(same, x * up, x), down


def pow2_row_scales(*xs):
    """``pow2_scales`` of the largest |x| of each row over all xs [R, X] (one shape)."""
    return pow2_scales(functools.reduce(jnp.maximum, [
        jnp.max(jnp.abs(x.astype(f32)), axis=1, keepdims=True) for x in xs]))


def pow2_scales(m):
    """(up, down) [R, 1] float32 for row maxima m [R, 1] >= 0: up = 2^-e and down = 2^e, 2^e the
    power of two at or below m (at least 2^-126), so a row whose entries are at most m in size
    is within [-2, 2] after scaling by up, and scaling by up, then by down, is exact. Built
    from the float32 bits: no rounding on any platform."""
    e_bits = jnp.maximum(lax.bitcast_convert_type(m.astype(f32), jnp.int32) & 0x7F800000,
                         0x00800000)
    up = lax.bitcast_convert_type(0x7F000000 - e_bits, f32)  # exponent field 254 - E
    return up, lax.bitcast_convert_type(e_bits, f32)


def _diag_pair_grads(acc, dAqk, dAkk, qs, kf, G, cfg: KdaConfig):
    """Adds the diagonal s x s sub-blocks of ``pair_grads`` exactly, for any gate (f32,
    elementwise): column offset t of every sub-chunk at once, as in ``_diag_scores``."""
    C, s = cfg.C, cfg.sub
    nb = C // s
    ri, cj = iota((C, 1), 0), iota((1, C), 1)
    col0 = lax.div(ri, s) * s
    t3 = iota((nb, s, 1), 1)
    dAqk, dAkk = dAqk.astype(f32), dAkk.astype(f32)

    def body(t, acc):
        rq, rk, cq, ck = acc
        e = jnp.exp(jnp.minimum(G - _block_bcast_row(G, t, s), 0.0))  # e^(G_i - G_{b+t}), i >= b+t
        k_t = _block_bcast_row(kf, t, s)

        def col_sum(z):  # sum over the rows of each sub-chunk, into row t of that sub-chunk
            z = z.reshape(nb, s, -1)
            z = jnp.broadcast_to(jnp.sum(z, axis=1, keepdims=True), z.shape)
            return jnp.where(t3 == t, z, 0.0).reshape(C, -1)

        dq_col = jnp.sum(jnp.where(cj == col0 + t, dAqk, 0.0), axis=1, keepdims=True)
        dk_col = jnp.sum(jnp.where(cj == col0 + t, dAkk, 0.0), axis=1, keepdims=True)
        return (rq + dq_col * k_t * e, rk + dk_col * k_t * e,
                cq + col_sum(dq_col * qs * e), ck + col_sum(dk_col * kf * e))

    return lax.fori_loop(0, s, body, acc)


# ----------------------------------------------------------------------------- WY pieces


INVERSE_BLOCK = 8  # rows of the diagonal blocks inverted by repeated squaring


def tril_inverse(L, cfg: KdaConfig):
    """(I + L)^-1 for strictly lower-triangular L [C, C], matmul only, numerically stable.

    Repeated squaring of the whole matrix, (I - N)^-1 = prod_m (I + N^(2^m)) with N = -L, is
    exact in theory but not in float32: for keys that agree and gates near 0, L is close to the
    all-ones triangle and N^32 has entries near C(63, 31) ~ 1e18 that must cancel to give an
    inverse of size ~1. So the squaring runs only inside diagonal blocks of INVERSE_BLOCK = 8 rows
    (powers up to N^4: growth at most C(7, 3) = 35), and the blocks are then merged pairwise,
    8 -> 16 -> 32 -> 64, with the 2 x 2 block inverse

        [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]],

    i.e. T <- T - T P T with P = L masked to the lower-left block of each merged pair: products
    of true inverses, no cancellation. Both stages together are as many dots as full squaring.

    On GPU the dots take one tf32 pass (``mm(cheap=True)``), not the three of float32 accuracy:
    the GPU tests hold with one, and three make intra_fwd markedly slower.
    """
    C = cfg.C
    ri, cj = iota((C, C), 0), iota((C, C), 1)
    eye = (ri == cj).astype(f32)
    h = min(INVERSE_BLOCK, C)
    P = -jnp.where(lax.div(ri, h) == lax.div(cj, h), L, 0.0)
    Tinv = eye + P
    m = 1
    while 2 * m < h:
        P = mm(P, P, cfg, exact=True, cheap=True)
        Tinv = Tinv + mm(Tinv, P, cfg, exact=True, cheap=True)
        m *= 2
    while h < C:  # merge pairs of h-blocks into 2h-blocks
        pair = (lax.div(ri, 2 * h) == lax.div(cj, 2 * h)) & (lax.rem(lax.div(ri, h), 2) == 1) & (
            lax.rem(lax.div(cj, h), 2) == 0)
        X = mm(Tinv, jnp.where(pair, L, 0.0), cfg, exact=True, cheap=True)
        Tinv = Tinv - mm(X, Tinv, cfg, exact=True, cheap=True)
        h *= 2
    return Tinv


class Slice:
    """Per-channel chunk quantities of one K slice [C, BK] (the math is separable in d).

    Computed on first use, so that each lives only from there to its last use (registers).
    The backward passes the forward's G (``G``) instead of g, and may pass ``G_row(r)`` -> row
    r of G as [1, BK] loaded from memory (else a masked reduction over the rows of G)."""

    def __init__(self, q, k, g, a, lm, cfg: KdaConfig, *, G=None, G_row=None):
        self._q, self._k, self._g, self.a, self.lm, self.cfg = q, k, g, a, lm, cfg
        self._G, self._G_row = G, G_row

    @functools.cached_property
    def G(self):
        return chunk_cumsum(self._g, self.cfg) if self._G is None else self._G.astype(f32)

    def G_row(self, r):
        return self._G_row(r) if self._G_row is not None else row_at(self.G, r)

    @functools.cached_property
    def qs(self):
        return self._q.astype(f32) * self.cfg.scale

    @functools.cached_property
    def kf(self):
        return self._k.astype(f32)

    @functools.cached_property
    def Gam(self):
        return jnp.exp(self.G)

    @functools.cached_property
    def gl(self):  # [1, BK]
        return self.G_row(self.cfg.C - 1)

    @functools.cached_property
    def decay_to_end(self):  # exponent <= 0
        return jnp.exp(self.gl - self.G)

    def _seg(self, x, mask):
        return x * mask if self.cfg.has_seg else x

    @functools.cached_property
    def QG(self):
        return self._seg(self.qs * self.Gam, self.a)

    @functools.cached_property
    def KGa(self):
        return self._seg(self.kf * self.Gam, self.a)

    @functools.cached_property
    def Kg(self):
        return self._seg(self.kf * self.decay_to_end, self.lm)

    @functools.cached_property
    def gam(self):
        gam = jnp.exp(self.gl)
        return gam * row_at(self.a, self.cfg.C - 1) if self.cfg.has_seg else gam


def _loop(n: int, fn, carry):
    """fori_loop over n K slices; a single slice stays a static Python call (static offsets)."""
    if n == 1:
        return fn(0, carry)
    return lax.fori_loop(0, n, fn, carry)


def _rowsum(x):
    return jnp.sum(x, axis=1, keepdims=True)


def fwd_intra(io, n, cfg: KdaConfig):
    """One chunk's state-independent work, K slice by K slice (registers hold [C, C] and
    [C, BK] tiles, never [C, K]): ``fwd_scores``, then ``fwd_wy``, in one kernel.

    ``io`` loads: qkg(s) -> q, k, g slices [C, BK] (g: the gate logits f when ``cfg.gate`` is
    not "given", with gate_params(s) -> A, dt_bias [1, BK]); v(t) -> v tile [C, BV];
    beta [C, 1]; seg = (a, lm, segc, segr) or Nones. ``io.put(name, index, value)`` stores QG, Kg, gam, W
    (by K slice), U (by V tile) and Aqk (masked); if ``io.residuals``, also G (by K slice), Akk
    (masked) and Tinv for the backward. With ``io.handoff`` = "W" (the GPU layout: Triton and
    interpret mode) W's operand goes through W's buffer: ``io.W_in(s)`` loads slice s back after
    ``io.sync()``, a barrier of the program's threads, instead of a second cumsum and
    exponential per K slice after the inverse (the same bf16 operand either way, so the same
    results). The TPU modes (``io.handoff`` None) recompute it.
    """
    Akk = fwd_scores(io, n, cfg)
    if io.residuals:  # for bwd_intra_scores: O(C^2) per chunk, cheaper than recomputing
        io.put("Akk", 0, Akk)
    if io.handoff == "W":
        # W's operand came through W's own buffer: every thread's stores must be visible
        # before any thread reads a slice back. Slice s is then overwritten with W's slice s,
        # which the dot computes only from all of slice s read (the operand is staged in
        # shared memory behind a barrier first).
        io.sync()
        bkga = io.W_in
    else:
        # W's operand beta k e^G is recomputed slice by slice rather than kept from the scores
        # loop: kept, it would hold [C, K] in registers across the inverse.
        lv, beta = last_valid_row(n, cfg), io.beta.astype(f32)
        bkga = lambda s: beta * _fwd_slice(io, lv, s, cfg).KGa
    fwd_wy(io, Akk, bkga, cfg)


def _fwd_slice(io, lv, s, cfg: KdaConfig) -> Slice:
    """K slice s of the chunk's q, k and gate (the gate computed from its logits when it is in
    the kernel); lv: the chunk's last real row."""
    q, k, g = io.qkg(s)
    if cfg.gate != "given":
        g = gate_from_logits(g, *io.gate_params(s), iota((cfg.C, 1), 0) <= lv, cfg)
    if cfg.forget_gate:  # -inf (forget everything) as a finite gate that decays to exactly 0
        g = g.astype(f32)
        g = jnp.where(g < FORGET_GATE, FORGET_GATE, g)  # a compare keeps NaN (max may not)
    a, lm, _, _ = io.seg
    return Slice(q, k, g, a, lm, cfg)


def fwd_scores(io, n, cfg: KdaConfig):
    """The decayed scores of chunk n, summed over the K slices: stores QG, Kg, gam (and G with
    ``io.residuals``) by K slice and Aqk (masked, whole); returns Akk [C, C] float32, masked to
    the strictly lower pairs of one segment. With ``io.handoff`` (an output name: "W", see
    ``fwd_intra``) it also stores beta k e^G there by K slice, W's operand in ``fwd_wy``.
    """
    C, nk = cfg.C, cfg.K // cfg.bk
    lv = last_valid_row(n, cfg)
    _, _, segc, segr = io.seg
    beta = io.beta.astype(f32)

    def scores(s, acc):
        p = _fwd_slice(io, lv, s, cfg)
        Aqk, Akk = decayed_scores([p.qs, p.kf], p.kf, p.G, lv, cfg, acc)
        io.put("QG", s, p.QG)
        io.put("Kg", s, p.Kg)
        io.put("gam", s, p.gam)
        if io.residuals:
            io.put("G", s, p.G)
        if io.handoff:
            io.put(io.handoff, s, beta * p.KGa)
        return Aqk, Akk

    zero = jnp.zeros((C, C), f32)
    Aqk, Akk = _loop(nk, scores, (zero, zero))
    # Masks are rebuilt where used (iota compares): kept live they cost registers.
    io.put("Aqk", 0, jnp.where(pair_masks(segc, segr, cfg)[0], Aqk, 0.0))
    return jnp.where(pair_masks(segc, segr, cfg)[1], Akk, 0.0)


def fwd_wy(io, Akk, bkga, cfg: KdaConfig):
    """Tinv = (I + Diag(beta) Akk)^-1 (stored with ``io.residuals``), W = Tinv (beta k e^G) by
    K slice and U = Tinv (beta v) by V tile; bkga(s) -> beta k e^G of K slice s [C, BK]."""
    nk, nv = cfg.K // cfg.bk, cfg.V // cfg.bv_intra
    beta = io.beta.astype(f32)
    Tinv = tril_inverse(Akk * beta, cfg)
    if io.residuals:
        io.put("Tinv", 0, Tinv)

    def w_slice(s, carry):
        io.put("W", s, mm(Tinv, bkga(s), cfg))
        return carry

    _loop(nk, w_slice, ())
    for t in range(nv):
        io.put("U", t, mm(Tinv, beta * io.v(t).astype(f32), cfg))


def state_step(St, W, U, QG, Kg, Aqk, gam, cfg: KdaConfig):
    """One chunk of the state pass for one V tile. St = S^T [BV, K] float32.

    Returns (St after the chunk, V' [C, BV], O [C, BV])."""
    Vp = U.astype(f32) - mm(W, St, cfg, tb=True)
    O = mm(QG, St, cfg, tb=True) + mm(Aqk, Vp, cfg)
    St_next = St * gam.astype(f32) + mm(Vp, Kg, cfg, ta=True)
    return St_next, Vp, O


def reverse_step(dSt, dO, W, QG, Kg, Aqk, gam, cfg: KdaConfig):
    """One chunk of the reverse (gradient) state pass for one V tile.

    dSt = (dL/dS after the chunk)^T [BV, K]. Returns (dSt before the chunk, dV' [C, BV])."""
    dO = dO.astype(f32)
    dVp = mm(Aqk, dO, cfg, ta=True) + mm(Kg, dSt, cfg, tb=True)
    dSt_prev = dSt * gam.astype(f32) + mm(dO, QG, cfg, ta=True) - mm(dVp, W, cfg, ta=True)
    return dSt_prev, dVp


def bwd_intra_scores(io, cfg: KdaConfig):
    """Backward, part 1 of one chunk: everything that needs all of K and V at once.

    ``io`` loads: qkg(s) (k only), G(s) [C, BK] (from ``fwd_intra``), beta, seg as in
    ``fwd_intra``; W(s) [C, BK]; cc(name) -> [C, C] for Akk (masked) and Tinv saved by
    ``fwd_intra``; vt(name, t) for name in v, U, Vp, dVp, dO -> [C, BV]; st("St", t, s) ->
    the state entering the chunk, transposed [BV, BK]. ``io.put`` stores dv (by V tile), dbeta,
    and for ``bwd_intra_channels`` the [C, C] matrices dAqk (masked), dAkk (masked) and their
    transposes dAqkT, dAkkT.

    Two sweeps: (A) over V tiles, the [C, C] gradients that need all of V; (B) over K slices,
    the W part of dL and dbeta.
    """
    C, nk, nv = cfg.C, cfg.K // cfg.bk, cfg.V // cfg.bv_intra
    a, lm, segc, segr = io.seg
    beta = io.beta.astype(f32)
    zero = jnp.zeros((C, C), f32)
    Tinv = io.cc("Tinv")

    # (A) dAqk = dO V'^T; dU = dV' -> dR_v = T^T dV', dL = -dR_v U^T, dv = beta dR_v.
    dAqk, dL, dbeta = zero, zero, jnp.zeros((C, 1), f32)
    for t in range(nv):
        dVp = io.vt("dVp", t).astype(f32)
        dAqk = dAqk + mm(io.vt("dO", t), io.vt("Vp", t), cfg, tb=True)
        dRv = mm(Tinv, dVp, cfg, ta=True)
        dL = dL - mm(dRv, io.vt("U", t), cfg, tb=True)
        dbeta = dbeta + _rowsum(dRv * io.vt("v", t).astype(f32))
        io.put("dv", t, beta * dRv)
    # With all of V in one tile, sweep (B) takes dR_k = T^T dW = -T^T dV' S^T = -dR_v S^T: one
    # dot per K slice instead of two, from dR_v as the dot's operand (cast as mm would). With
    # narrower V tiles it keeps the two dots: holding every tile of dR_v through the sweep
    # would undo what the narrower tile is for (fewer live registers).
    dRv_op = dRv.astype(cfg.dtype) if nv == 1 else None

    def dRk_slice(s):  # dR_k = T^T dW, dW = -dV' S^T: columns of slice s
        if dRv_op is not None:
            return -mm(dRv_op, io.st("St", 0, s), cfg)
        dW = jnp.zeros((C, cfg.bk), f32)
        for t in range(nv):
            dW = dW - mm(io.vt("dVp", t), io.st("St", t, s), cfg)
        return mm(Tinv, dW, cfg, ta=True)

    # (B) dR_k: dL -= dR_k W^T, dbeta += rowsum(dR_k * Gam K a).
    def sweep_b(s, carry):
        dL, dbeta = carry
        p = Slice(*io.qkg(s), a, lm, cfg, G=io.G(s))
        dRk = dRk_slice(s)
        return dL - mm(dRk, io.W(s), cfg, tb=True), dbeta + _rowsum(dRk * p.KGa)

    dL, dbeta = _loop(nk, sweep_b, (dL, dbeta))
    dL = jnp.where(pair_masks(segc, segr, cfg)[1], dL, 0.0)
    io.put("dbeta", 0, dbeta + _rowsum(dL * io.cc("Akk").astype(f32)))
    dAkk = beta * dL
    dAqk = jnp.where(pair_masks(segc, segr, cfg)[0], dAqk, 0.0)
    scaled = stores_scaled_blocks(cfg)
    dAs = {"dAqk": dAqk, "dAkk": dAkk}
    if scaled:  # for _mid_pair_grads, scaled from the values it would load (cfg.cd)
        dAs = {name: x.astype(cfg.dtype).astype(f32) for name, x in dAs.items()}
    dAs.update(dAqkT=dAs["dAqk"].T, dAkkT=dAs["dAkk"].T)  # channels reads row blocks of all
    for name, x in dAs.items():
        if scaled:
            x, down = scale_diagonal_blocks(x, cfg.bwd_rows)
            io.put(name + "_down", 0, down)
        io.put(name, 0, x)


def bwd_intra_channels(io, n, s, cfg: KdaConfig):
    """Backward, part 2: dq, dk, dg of one chunk in K slice s (the math is separable in d once
    part 1 has reduced over K and V).

    ``io`` loads: qkg(s) (q and k), G(s) and G_row(r) (see ``Slice``), seg as in ``fwd_intra``;
    rows(name, ib) -> rows ib*s .. ib*s+s-1 [s, C] of dAqk, dAkk and their transposes dAqkT,
    dAkkT (from ``bwd_intra_scores``); cc(name) -> [C, C] for the four score gradients whole
    (the unbounded gate's diagonal blocks, ``cfg.bwd_rows``' blocks); vt(name, t) for Vp, dO and
    dv (part 1's output);
    st(name, t, s) for St and dSt (the gradient of the state leaving the chunk) -> [BV, BK].
    ``io.put`` stores dq, dk, dg of slice s. With the gate in the kernel (``cfg.gate``), io also
    loads f() -> the gate logits [C, BK] and gate_params(s) -> A, dt_bias [1, BK], and "dg"
    receives df, with the chunk's d(dt_bias) and dA column sums put as "dbias" and "dA".
    """
    C, nv = cfg.C, cfg.V // cfg.bv_intra
    lv = last_valid_row(n, cfg)
    a, lm, _, _ = io.seg
    p = Slice(*io.qkg(s), a, lm, cfg, G=io.G(s), G_row=io.G_row)
    # The score gradients first: reduced at once to three accumulators, fewer tiles stay live
    # through the state dots below (fewer register spills).
    rq, rk, c = pair_grads(io.rows, io.cc, p.G_row, p.qs, p.kf, p.G, lv, cfg)
    dk = c + rk
    dG = p.qs * rq + p.kf * (rk - c)
    zk = jnp.zeros((C, cfg.bk), f32)
    dQG, dKg, dKGa, dgam = zk, zk, zk, jnp.zeros((1, cfg.bk), f32)
    for t in range(nv):
        # every load of the step first, so their latencies overlap (see _bounded_pair_grads)
        St, dSt = io.st("St", t, s), io.st("dSt", t, s)
        dO, Vp, dv = (io.vt(name, t) for name in ("dO", "Vp", "dv"))
        St, dSt = St.astype(f32), dSt.astype(f32)
        dQG = dQG + mm(dO, St, cfg)
        dKg = dKg + mm(Vp, dSt, cfg)
        # W = T Diag(beta) (k e^G a) and dW = -dV' S^T give dL/d(k e^G a) = Diag(beta) T^T dW
        # = -Diag(beta) T^T dV' S^T = -dv S^T: part 1's dv (= Diag(beta) T^T dV') already
        # holds the product with the inverse, so one dot replaces two and T is not loaded.
        dKGa = dKGa - mm(dv, St, cfg)
        dgam = dgam + jnp.sum(St * dSt, axis=0, keepdims=True)
    if cfg.has_seg:
        dqs = dQG * p.Gam * a
        dk = dk + dKGa * p.Gam * a + dKg * p.decay_to_end * lm
    else:
        dqs = dQG * p.Gam
        dk = dk + dKGa * p.Gam + dKg * p.decay_to_end
    dG = dG + dQG * p.QG + dKGa * p.KGa - dKg * p.Kg
    dG_last = jnp.sum(dKg * p.Kg, axis=0, keepdims=True) + dgam * p.gam
    dG = dG + jnp.where(iota((C, 1), 0) == C - 1, dG_last, 0.0)
    io.put("dq", s, (dqs + rq) * cfg.scale)
    io.put("dk", s, dk)
    dg = reverse_cumsum(dG, cfg)
    if cfg.gate == "given":
        io.put("dg", s, dg)
        return
    df, dbias, dA = gate_logit_grads(dg, io.f(), *io.gate_params(s), iota((C, 1), 0) <= lv, cfg)
    io.put("dg", s, df)
    io.put("dbias", s, dbias)
    io.put("dA", s, dA)
