"""KDA's backward intra-chunk kernels on Hopper (sm_90) in Pallas' Mosaic GPU backend: drop-ins
for ``kda_calls.intra_bwd_channels`` (``intra_bwd_channels``, described here) and
``kda_calls.intra_bwd_scores`` (``intra_bwd_scores``, described in its docstring) in the case
kda_mgpu.intra_fwd supports (given bounded gate, C = 64, K = V = 128, bf16;
``kda_mgpu.unsupported_reason``), and no packed segments for intra_bwd_channels
(intra_bwd_scores takes them, and K, V of 64 too). kda_calls dispatches to them with KernelTuning.hopper.

intra_bwd_channels: one CTA of one warpgroup per (value head row bh, chunk n, K slice s of
BK = 64 channels): grid (B*HV, N, K/BK). A slice of 64 bf16 channels is one 128-byte swizzle
row, and a [C, BK] float32 tile is 32 registers a thread (the three running accumulators and
a product stay well under the 255 a thread may hold; spills unchecked on a GPU). With the
notation of ``kda_body`` (rows i, j of the chunk; d a channel of the slice; qs = scale q):

State part (``kda_body.bwd_intra_channels``' V loop, one wgmma each over all of V = 128):

    dQG = dO St,   dKg = V' dSt,   dKGa = -dv St         [C, V] x [V, BK]
                                   (= Diag(beta) Tinv^T dW, dW = -dV' St: dv from part 1)
    dgam_d = sum_v St_vd dSt_vd                          (a wgmma by a ones [C, V] matrix on
                                                          the exact hi + lo bf16 split of St*dSt)

Score part (the sums of ``kda_body.pair_grads``, bounded gate), for each sub-chunk ib of s
rows with row anchor a = ib s and column anchor b = ib s + s - 1 (the Triton kernel now takes a
for both sides; this kernel keeps the second anchor):

    rq_i = e^(G_i - G_a) sum_j dAqk_ij  k_j e^(G_a - G_j)     rows i of sub-chunk ib, j < a + s
    rk_i = same with dAkk
    cq_j = e^(G_b - G_j) sum_i dAqkT_ji qs_i e^(G_i - G_b)     rows j of sub-chunk ib, i >= a
    ck_j = same with dAkkT and k

Each sum is one [C, C] x [C, BK] wgmma pair over all rows (the other sub-chunks' rows dropped
by a select after) on a bf16 hi + lo split of the right operand (``mm(split_b=True)``: dG takes
the difference of row and column sides, which cancel up to rounding). Padded rows past the
last token have g = 0, so G there equals G at the last token and the unclamped anchors give
the Triton kernel's min(anchor, last valid row).

Then, with Gam = e^G, eD = e^(G_last - G), gam = e^(G_last):

    dq  = scale (dQG Gam + rq)
    dk  = cq + rk + ck + dKGa Gam + dKg eD
    dG  = qs rq + k (rk - cq - ck) + dQG qs Gam + dKGa k Gam - P,    P = dKg k eD
    dG_last += sum_i P_i + dgam gam                       (added to row C-1 of dG)
    dg_i = sum_{r >= i} dG_r                              (Utri [C, C] @ dG)

The column sum of P (a ones [C, C] matrix) and the reverse cumsum are wgmmas on an exact
three-plane bf16 split (hi + mid + lo, 8 significand bits each) of the float32 operand.

Shapes (HBM): as ``kda_calls.intra_bwd_channels``: q, k [B, Tp, H, K] bf16; G [B*HV, N, C,
K] f32; dA = (dAqk, dAkk, dAqkT, dAkkT) [B*HV, N, C, C] bf16; h, dh [B*HV, N, V, K] bf16; Vp
[B*HV, N, C, V] bf16; dO, dv [B, Tp, HV, V] bf16. Outputs dq, dk [B, Tp, HV, K] (dqk_dtype)
and dg [B, Tp, HV, K] (dg_dtype), bf16 or float32.

SMEM: q, k, G, the four dA and four [C, BK] / [C, C] staging buffers live throughout
(~96 KB); the state operands St, dSt, V', dv, dO (80 KB) are scoped to the state part, the
output staging (<= 48 KB) to the end. All loads are issued at the start in the order of use
and waited at first use; no overlap of one CTA's loads with another CTA's math yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda_body import KdaConfig, pow2_scales, stores_scaled_blocks
from pallas_kernels.kda_mgpu import CHUNK, _swizzled, plgpu

f32, bf16 = jnp.float32, jnp.bfloat16
BK = 64  # channels per CTA: one 128-byte swizzle row of bf16


def _iota(shape, dim, *, compiled):
    """Indices along ``dim``: compiled, in the WGMMA layout (the interpreter has no layouts)."""
    if not compiled:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _one(cond):
    return jnp.where(cond, 1.0, 0.0).astype(f32)


def _dot(pairs, shape):
    """sum(a @ b for a, b in pairs), float32, on the tensor cores (reading the accumulator waits
    for the wgmmas: their operands may be overwritten after)."""
    def scoped(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(scoped, plgpu.ACC(shape, f32))


def unsupported_reason(cfg: KdaConfig, dqk_dtype, dg_dtype) -> str | None:
    """Beyond ``kda_mgpu.unsupported_reason`` (checked by the caller): the output dtypes."""
    for name, dt in (("dq/dk", dqk_dtype), ("dg", dg_dtype)):
        if jnp.dtype(dt) not in (jnp.dtype(bf16), jnp.dtype(f32)):
            return f"{name} dtype {dt}"
    if cfg.K % BK:
        return f"K = {cfg.K} not a multiple of {BK}"
    return None


def intra_bwd_channels(cfg: KdaConfig, q, k, G, segs, dA, h, dh, Vp, dO, dv, f=None,
                       gate_params=(), *, dqk_dtype, dg_dtype, interpret=None):
    """``kda_calls.intra_bwd_channels`` on Mosaic GPU (same arguments and outputs, for the
    configs ``kda_mgpu.unsupported_reason`` and ``unsupported_reason`` accept). ``interpret``:
    Mosaic GPU interpret params (CPU), None compiles for sm_90."""
    del segs, f, gate_params  # no packed segments, no gate in the kernel (unsupported here)
    B, HV, G_ = cfg.B, cfg.HV, cfg.G
    C, K, V, N, s = cfg.C, cfg.K, cfg.V, cfg.N, cfg.sub
    assert C == CHUNK
    BHV, Tp, nb, nk = B * HV, cfg.N * cfg.C, cfg.C // cfg.sub, cfg.K // BK
    scale = cfg.scale
    out_dts = (jnp.dtype(dqk_dtype), jnp.dtype(dqk_dtype), jnp.dtype(dg_dtype))
    out_shape = [jax.ShapeDtypeStruct((B, Tp, HV, K), dt) for dt in out_dts]

    WG = plgpu.Layout.WGMMA
    COL = WG.reduce(0)  # per-column vectors of a WGMMA array
    compiled = interpret is None

    iota = functools.partial(_iota, compiled=compiled)

    def planes(x, dsts):
        """Stores float32 x as len(dsts) bf16 planes summing to it (2: 16 significand bits, 3:
        exact), so a wgmma of each plane sums to a float32-accurate product."""
        r = x
        for i, d in enumerate(dsts):
            p = r.astype(bf16)
            d[...] = p
            if i + 1 < len(dsts):
                r = r - p.astype(f32)
        plgpu.commit_smem()

    def kernel(q_g, k_g, G_g, dAqk_g, dAkk_g, dAqkT_g, dAkkT_g, h_g, dh_g, Vp_g, dO_g, dv_g,
               dq_g, dk_g, dg_g,
               q_s, k_s, G_s, dAqk_s, dAkk_s, dAqkT_s, dAkkT_s, x1_s, x2_s, x3_s, m_s, bars):
        bh, n, sk = lax.axis_index("bh"), lax.axis_index("n"), lax.axis_index("s")
        b, hv = lax.div(bh, jnp.int32(HV)), lax.rem(bh, jnp.int32(HV))
        hq = lax.div(hv, jnp.int32(G_))
        tok, ch = pl.ds(n * C, C), pl.ds(sk * BK, BK)

        # Loads: one barrier each, waited at first use (``need``) so the math starts as soon
        # as its operands are in; issued in the order they are used.
        bar_of, waited = {}, set()

        def issue(name, src, dst):
            bar_of[name] = len(bar_of)
            plgpu.copy_gmem_to_smem(src, dst, bars.at[bar_of[name]])

        def need(*names):  # each barrier is waited exactly once (straight-line code)
            for name in names:
                if name not in waited:
                    plgpu.barrier_wait(bars.at[bar_of[name]])
                    waited.add(name)

        rows = iota((C, BK), 0)
        ri, rr = iota((C, C), 0), iota((C, C), 1)

        def G_row(r: int):
            """Row r of G broadcast over the rows: [C, BK]."""
            if not compiled:
                return jnp.broadcast_to(G_s[pl.ds(r, 1), :], (C, BK))
            g_BK = plgpu.load(G_s.at[r], (), layout=COL, optimized=False)
            return lax.broadcast_in_dim(g_BK, (C, BK), [1])

        def load_G():
            return G_s[...] if not compiled else plgpu.load(G_s, (), layout=WG, optimized=False)

        def state_part(h_s, dh_s, Vp_s, dv_s, dO_s):
            """dQG, dKg, dKGa, then the chunk's dq, dk, dG before the score part."""
            for name, src, dst in (
                    ("dv", dv_g.at[b, tok, hv], dv_s), ("h", h_g.at[bh, n, :, ch], h_s),
                    ("dO", dO_g.at[b, tok, hv], dO_s), ("Vp", Vp_g.at[bh, n], Vp_s),
                    ("dh", dh_g.at[bh, n, :, ch], dh_s), ("G", G_g.at[bh, n, :, ch], G_s),
                    ("q", q_g.at[b, tok, hq, ch], q_s), ("k", k_g.at[b, tok, hq, ch], k_s),
                    ("dAqk", dAqk_g.at[bh, n], dAqk_s), ("dAkk", dAkk_g.at[bh, n], dAkk_s),
                    ("dAqkT", dAqkT_g.at[bh, n], dAqkT_s),
                    ("dAkkT", dAkkT_g.at[bh, n], dAkkT_s)):
                issue(name, src, dst)
            need("dv", "h")
            dKGa_CxBK = -_dot([(dv_s, h_s)], (C, BK))
            need("dO")
            dQG_CxBK = _dot([(dO_s, h_s)], (C, BK))
            need("Vp", "dh")
            dKg_CxBK = _dot([(Vp_s, dh_s)], (C, BK))
            # dgam: St * dSt is exact in float32 and exactly hi + lo in bf16; over St, dSt
            # (their wgmmas are done) and a ones [C, V] over dO
            hd_VxBK = h_s[...].astype(f32) * dh_s[...].astype(f32)
            planes(hd_VxBK, (h_s, dh_s))
            dO_s[...] = _one(iota((C, V), 0) >= 0).astype(bf16)
            plgpu.commit_smem()
            dgam_CxBK = _dot([(dO_s, h_s), (dO_s, dh_s)], (C, BK))

            need("G", "q", "k")
            G_CxBK = load_G()
            Gl_CxBK = G_row(C - 1)
            Gam_CxBK = jnp.exp(G_CxBK)
            eD_CxBK = jnp.exp(Gl_CxBK - G_CxBK)
            qs_CxBK = q_s[...].astype(f32) * scale
            k_CxBK = k_s[...].astype(f32)
            P_CxBK = dKg_CxBK * k_CxBK * eD_CxBK  # dKg * Kg
            DQ_CxBK = dQG_CxBK * Gam_CxBK
            DK_CxBK = dKGa_CxBK * Gam_CxBK + dKg_CxBK * eD_CxBK
            DG_CxBK = (dQG_CxBK * qs_CxBK + dKGa_CxBK * k_CxBK) * Gam_CxBK - P_CxBK
            # dG_last += sum_i P_i + dgam gam: every row of Ones @ P holds the column sum
            planes(P_CxBK, (x1_s, x2_s, x3_s))
            m_s[...] = _one(ri >= 0).astype(bf16)
            plgpu.commit_smem()
            Psum_CxBK = _dot([(m_s, x) for x in (x1_s, x2_s, x3_s)], (C, BK))
            last = Psum_CxBK + dgam_CxBK * jnp.exp(Gl_CxBK)
            DG_CxBK = DG_CxBK + jnp.where(rows == C - 1, last, 0.0)
            return DQ_CxBK, DK_CxBK, DG_CxBK

        DQ_CxBK, DK_CxBK, DG_CxBK = pl.run_scoped(
            state_part, _swizzled((V, BK), bf16), _swizzled((V, BK), bf16),
            _swizzled((C, V), bf16), _swizzled((C, V), bf16), _swizzled((C, V), bf16))

        # Score part: one pass per sub-chunk ib (static: the anchors are static rows).
        need("dAqk", "dAkk", "dAqkT", "dAkkT")
        G_CxBK = load_G()
        qs_CxBK = q_s[...].astype(f32) * scale
        k_CxBK = k_s[...].astype(f32)
        blk = lax.div(rows, jnp.int32(s))
        for ib in range(nb):
            a, bb = ib * s, ib * s + s - 1
            mine = blk == ib
            Ga_CxBK = G_row(a)
            # row side: X_j = k_j e^(G_a - G_j), j < a + s (<= e^((s-1)|lower_bound|))
            ok = rows < a + s
            X_CxBK = jnp.where(ok, k_CxBK * jnp.exp(jnp.where(ok, Ga_CxBK - G_CxBK, 0.0)), 0.0)
            planes(X_CxBK, (x1_s, x2_s))
            Rq_CxBK = _dot([(dAqk_s, x1_s), (dAqk_s, x2_s)], (C, BK))
            Rk_CxBK = _dot([(dAkk_s, x1_s), (dAkk_s, x2_s)], (C, BK))
            eR_CxBK = jnp.where(mine, jnp.exp(jnp.where(mine, G_CxBK - Ga_CxBK, 0.0)), 0.0)
            rq_CxBK, rk_CxBK = eR_CxBK * Rq_CxBK, eR_CxBK * Rk_CxBK
            DQ_CxBK = DQ_CxBK + rq_CxBK
            DK_CxBK = DK_CxBK + rk_CxBK
            DG_CxBK = DG_CxBK + qs_CxBK * rq_CxBK + k_CxBK * rk_CxBK
            # column side: Y_i = x_i e^(G_i - G_b), i >= a (rows i < j of the block meet dA = 0)
            Gb_CxBK = G_row(bb)
            ok = rows >= a
            eB_CxBK = jnp.where(ok, jnp.exp(jnp.where(ok, G_CxBK - Gb_CxBK, 0.0)), 0.0)
            planes(qs_CxBK * eB_CxBK, (x1_s, x2_s))
            Cq_CxBK = _dot([(dAqkT_s, x1_s), (dAqkT_s, x2_s)], (C, BK))
            planes(k_CxBK * eB_CxBK, (x1_s, x2_s))
            Ck_CxBK = _dot([(dAkkT_s, x1_s), (dAkkT_s, x2_s)], (C, BK))
            eC_CxBK = jnp.where(mine, jnp.exp(jnp.where(mine, Gb_CxBK - G_CxBK, 0.0)), 0.0)
            c_CxBK = eC_CxBK * (Cq_CxBK + Ck_CxBK)
            DK_CxBK = DK_CxBK + c_CxBK
            DG_CxBK = DG_CxBK - k_CxBK * c_CxBK

        # dg_i = sum_{r >= i} dG_r: Utri @ dG on its exact three-plane split
        planes(DG_CxBK, (x1_s, x2_s, x3_s))
        m_s[...] = _one(rr >= ri).astype(bf16)
        plgpu.commit_smem()
        dg_CxBK = _dot([(m_s, x) for x in (x1_s, x2_s, x3_s)], (C, BK))

        def store(dq_s, dk_s, dg_s):
            for val, src, dst in ((DQ_CxBK * scale, dq_s, dq_g), (DK_CxBK, dk_s, dk_g),
                                  (dg_CxBK, dg_s, dg_g)):
                src[...] = val.astype(src.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(src, dst.at[b, tok, hv, ch])
            plgpu.wait_smem_to_gmem(0)

        def stage(dt):  # bf16: swizzled (conflict-free WGMMA-layout stores); float32: plain
            return _swizzled((C, BK), dt) if dt == jnp.dtype(bf16) else plgpu.SMEM((C, BK), dt)

        pl.run_scoped(store, *[stage(dt) for dt in out_dts])

    scratch = (
        _swizzled((C, BK), bf16), _swizzled((C, BK), bf16),  # q, k (this slice)
        plgpu.SMEM((C, BK), f32),  # G (untiled float32: rows are read one at a time)
        *[_swizzled((C, C), bf16)] * 4,  # dAqk, dAkk, dAqkT, dAkkT
        *[_swizzled((C, BK), bf16)] * 3,  # wgmma right operands: planes of X, Y, P, dG
        _swizzled((C, C), bf16),  # the constant ones / Utri matrix
        plgpu.Barrier(num_barriers=12),  # one a load
    )
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    fn = plgpu.kernel(kernel, out_type=out_shape, kernel_name="kda_intra_bwd_channels_mgpu",
                      grid=(BHV, N, nk), grid_names=("bh", "n", "s"),
                      scratch_types=scratch, compiler_params=params, interpret=interpret)
    return tuple(fn(q, k, G, *dA, h, dh, Vp, dO, dv))


def intra_bwd_scores(cfg: KdaConfig, k, v, G, beta, segs, W, U, Akk, Tinv, h, Vp, dVp, dO, *,
                     dv_dtype, interpret=None):
    """``kda_calls.intra_bwd_scores`` on Mosaic GPU: one CTA of one warpgroup per (bh, chunk n),
    grid (B*HV, N), all of K and V at once (each 64 or 128: whole swizzled operands). With
    ``kda_body.bwd_intra_scores``' notation:

        dAqk = tril(dO V'^T)                             [C, V] x [V, C]
        dRv  = Tinv^T dV',   dv = Diag(beta) dRv,   dbeta = rowsum(dRv * v)
        dRk  = Tinv^T dW = -dRv St     (dW = -dV' St)   [C, V] x [V, K]
        dL   = strict tril(-dRv U^T - dRk W^T)
        dbeta += rowsum(dRk * k e^G) + rowsum(dL * Akk),   dAkk = Diag(beta) dL

    Every product is one bf16 wgmma (dRv and dRk rounded to bf16 first, as the Triton kernel's
    ``mm`` does); transposed operands are transposed SMEM views. dAqk^T and dAkk^T are exact:
    a wgmma of the transposed view of the stored bf16 matrix with the identity.

    Packed segments (``segs`` = kda_body's a, lm, segc, segr): the k part of dbeta takes
    k e^G a (a: the row is still in the segment of the incoming state), and the tril masks of
    dAqk and dL keep only pairs of one segment, as ``kda_body.bwd_intra_scores`` does.

    Shapes (HBM) as ``kda_calls.intra_bwd_scores``: dv [B, Tp, HV, V] (dv_dtype: bf16 here),
    dbeta [B, Tp, HV, 1] float32 (written [B*HV, Tp] here: a TMA box needs >= 16 contiguous
    bytes), dAqk, dAkk, dAqkT, dAkkT [B*HV, N, C, C] bf16, with anchor_mid_bwd's blocks
    (cfg.bwd_rows) the diagonal blocks of their rows scaled and their scales [B*HV, N, C, 1]
    float32 after them (``kda_body.scale_diagonal_blocks``, on the bf16 values; each transpose
    is taken before the scaling). SMEM: the bf16 dRv, dRk live throughout; St, dO, V', v, k,
    G, Tinv and dV' are scoped to the first part, Akk (float32), U, W and the output staging to
    the second, which loads them (Akk under dL's wgmma). Pallas' estimate at the peak: 96 KB at
    K = V = 64, so two CTAs share an SM (with all of k, G, Akk, Tinv and dV' held throughout it
    was 136 KB, one per SM: session ad); 192 KB at 128, one per SM either way. The float32
    G and Akk are tiled and swizzled like the bf16 operands: untiled, the 8 rows a warp reads
    of a WGMMA-layout load start on one bank (rows of 256 or 512 bytes), which Nsight Compute
    read as 6.9-way conflicts on 66% of the kernel's shared loads (session ad). The kernel
    time did not move with it (H100: 0.628 against 0.632 ms, session ae).
    """
    B, HV = cfg.B, cfg.HV
    C, K, V, N = cfg.C, cfg.K, cfg.V, cfg.N
    assert C == CHUNK and jnp.dtype(dv_dtype) == jnp.dtype(bf16)
    BHV, Tp = B * HV, N * C
    beta_BHVxTp = jnp.transpose(beta[..., 0].astype(f32), (0, 2, 1)).reshape(BHV, Tp)
    # a and the segment ids per token, [B, Tp] float32 (ids compare exactly below 2^24)
    seg_in = (segs[0].reshape(B, Tp).astype(f32), segs[2].reshape(B, Tp).astype(f32)
              ) if cfg.has_seg else ()
    # anchor_mid_bwd's blocks: the four matrices with the diagonal blocks of their rows
    # scaled, and the powers of two that undo it ([B*HV, Tp] here, [B*HV, N, C, 1] out:
    # kda_body.scale_diagonal_blocks)
    scaled = stores_scaled_blocks(cfg)
    out_shape = [jax.ShapeDtypeStruct((B, Tp, HV, V), bf16),
                 jax.ShapeDtypeStruct((BHV, Tp), f32),
                 *[jax.ShapeDtypeStruct((BHV, N, C, C), bf16)] * 4,
                 *[jax.ShapeDtypeStruct((BHV, Tp), f32)] * (4 if scaled else 0)]
    WG = plgpu.Layout.WGMMA
    ROW, COL = WG.reduce(1), WG.reduce(0)  # per-row / per-column vectors of a WGMMA array
    compiled = interpret is None

    iota = functools.partial(_iota, compiled=compiled)

    def tview(ref, tbuf):
        """ref^T as a wgmma operand: a transposed view; the interpreter's wgmma takes none, so
        there ref^T is stored into tbuf (a buffer of the transposed shape)."""
        if compiled:
            return plgpu.transpose_ref(ref, (1, 0))
        tbuf[...] = ref[...].T
        return tbuf

    def rowsum(x):
        return jnp.sum(x, axis=1)

    def scale_diagonal_blocks(x_CxC):
        """kda_body.scale_diagonal_blocks in the WGMMA layout: (x', down [C]) for x [C, C]
        holding bf16 values."""
        r = jnp.int32(cfg.bwd_rows)
        same = lax.div(iota((C, C), 0), r) == lax.div(iota((C, C), 1), r)
        x_CxC = x_CxC.astype(f32)
        up_C, down_C = pow2_scales(jnp.max(jnp.where(same, jnp.abs(x_CxC), 0.0), axis=1))
        return jnp.where(same, x_CxC * lax.broadcast_in_dim(up_C, (C, C), [0]), x_CxC), down_C

    def kernel(*refs):
        if cfg.has_seg:
            a_g, sg_g, *refs = refs
        (k_g, v_g, G_g, beta_g, W_g, U_g, Akk_g, T_g, h_g, Vp_g, dVp_g, dO_g,
         dv_g, db_g, dAqk_g, dAkk_g, dAqkT_g, dAkkT_g, *refs) = refs
        dn = ()
        if scaled:  # (SMEM staging, HBM) of dAqk's, dAkk's, dAqkT's, dAkkT's scales
            dn_g, dn_s, refs = refs[:4], refs[4:8], refs[8:]
            dn = tuple(zip(dn_s, dn_g, strict=True))
        beta_s, dRv_s, dRk_s, vec_s, bars, *tbufs = refs
        if cfg.has_seg:
            a_s, sg_s, *tbufs = tbufs
        bh, n = lax.axis_index("bh"), lax.axis_index("n")
        b, hv = lax.div(bh, jnp.int32(HV)), lax.rem(bh, jnp.int32(HV))
        hq = lax.div(hv, jnp.int32(cfg.G))
        tok = pl.ds(n * C, C)
        bar_of, waited = {}, set()  # loads waited at first use, as in intra_bwd_channels

        def issue(name, src, dst):
            bar_of[name] = len(bar_of)
            plgpu.copy_gmem_to_smem(src, dst, bars.at[bar_of[name]])

        def need(*names):
            for name in names:
                if name not in waited:
                    plgpu.barrier_wait(bars.at[bar_of[name]])
                    waited.add(name)

        ri, rr = iota((C, C), 0), iota((C, C), 1)
        tb = dict(zip(("VpT", "UT", "WT"), tbufs, strict=True)) if tbufs else {}

        def vec(ref, layout):  # a float32 [C] SMEM vector: one value per row or per column
            return ref[...] if not compiled else plgpu.load(ref, (), layout=layout)

        def one_segment(keep_CxC):
            """keep_CxC, and with packed segments only where rows i and j share a segment."""
            if not cfg.has_seg:
                return keep_CxC
            need("seg")
            seg_i = lax.broadcast_in_dim(vec(sg_s, ROW), (C, C), [0])
            seg_j = lax.broadcast_in_dim(vec(sg_s, COL), (C, C), [1])
            return keep_CxC & (seg_i == seg_j)

        def part_a(h_s, dO_s, Vp_s, v_s, k_s, G_s, T_s, dVp_s):
            """dAqk, dv, the v and k parts of dbeta; dRv and dRk into SMEM (bf16)."""
            for name, src, dst in (
                    ("dO", dO_g.at[b, tok, hv], dO_s), ("Vp", Vp_g.at[bh, n], Vp_s),
                    ("T", T_g.at[bh, n], T_s), ("dVp", dVp_g.at[bh, n], dVp_s),
                    ("beta", beta_g.at[bh, tok], beta_s), ("v", v_g.at[b, tok, hv], v_s),
                    ("h", h_g.at[bh, n], h_s), ("k", k_g.at[b, tok, hq], k_s),
                    ("G", G_g.at[bh, n], G_s)):
                issue(name, src, dst)
            if cfg.has_seg:
                issue("a", a_g.at[b, tok], a_s)
                issue("seg", sg_g.at[b, tok], sg_s)
            need("dO", "Vp", "T", "dVp", "beta")
            beta_C = vec(beta_s, ROW)
            T_t = tview(T_s, T_s)  # interpreter: T^T in place (T is read only as T^T)
            dAqk_CxC = _dot([(dO_s, tview(Vp_s, tb.get("VpT")))], (C, C))
            dRv_CxV = _dot([(T_t, dVp_s)], (C, V))
            dRv_s[...] = dRv_CxV.astype(bf16)
            need("v")
            dbeta_C = rowsum(dRv_CxV * v_s[...].astype(f32))
            dO_s[...] = (dRv_CxV * lax.broadcast_in_dim(beta_C, (C, V), [0])).astype(bf16)
            plgpu.commit_smem()  # dv from dO's buffer (read above: dAqk's wgmma is done)
            plgpu.copy_smem_to_gmem(dO_s, dv_g.at[b, tok, hv])
            need("h")
            # dRk = Tinv^T dW = -Tinv^T dV' St = -dRv St: one wgmma from the stored dRv
            # (committed with dv above) instead of two with a store of dW between them
            dRk_CxK = -_dot([(dRv_s, h_s)], (C, K))
            dRk_s[...] = dRk_CxK.astype(bf16)
            plgpu.commit_smem()
            need("k", "G")
            KGa_CxK = k_s[...].astype(f32) * jnp.exp(G_s[...])
            if cfg.has_seg:  # rows past a segment start do not see the incoming state
                need("a")
                KGa_CxK = KGa_CxK * lax.broadcast_in_dim(vec(a_s, ROW), (C, K), [0])
            dbeta_C = dbeta_C + rowsum(dRk_CxK * KGa_CxK)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dv's staging is freed next
            return dAqk_CxC, dbeta_C, beta_C

        dAqk_CxC, dbeta_C, beta_C = pl.run_scoped(
            part_a, _swizzled((V, K), bf16), _swizzled((C, V), bf16), _swizzled((C, V), bf16),
            _swizzled((C, V), bf16), _swizzled((C, K), bf16), _swizzled((C, K), f32),
            _swizzled((C, C), bf16), _swizzled((C, V), bf16))

        def transposed(src, eye_s):  # (the stored bf16 src)^T, exactly: src^T @ I (float32)
            if compiled:
                return _dot([(plgpu.transpose_ref(src, (1, 0)), eye_s)], (C, C))
            return src[...].T.astype(f32)

        def put_scaled(x_CxC, x_s, t_s, x_g, t_g, dn, eye_s):
            """x [C, C] (bf16 values, also in x_s) and x^T, each with the diagonal blocks of its
            rows scaled, and their scales (kda_body.scale_diagonal_blocks): x^T first, from
            x_s, which then takes the scaled x. dn: (SMEM staging, HBM) of x's and of x^T's."""
            (xd_s, xd_g), (td_s, td_g) = dn
            xT_CxC, td_s[...] = scale_diagonal_blocks(transposed(x_s, eye_s))
            t_s[...] = xT_CxC.astype(bf16)
            x_CxC, xd_s[...] = scale_diagonal_blocks(x_CxC)
            x_s[...] = x_CxC.astype(bf16)  # the transpose's wgmma is waited: x_s is free
            plgpu.commit_smem()
            for src, dst in ((t_s, t_g.at[bh, n]), (x_s, x_g.at[bh, n]),
                             (td_s, td_g.at[bh, tok]), (xd_s, xd_g.at[bh, tok])):
                plgpu.copy_smem_to_gmem(src, dst)

        def part_b(U_s, W_s, Akk_s, eye_s, a1_s, a2_s, a3_s, a4_s, bbars):
            """dL, dbeta's Akk part, dAkk; the four [C, C] outputs (with ``scaled``, each
            stored as soon as it is known, with its scales) and dbeta."""
            plgpu.copy_gmem_to_smem(U_g.at[bh, n], U_s, bbars.at[0])
            plgpu.copy_gmem_to_smem(W_g.at[bh, n], W_s, bbars.at[1])
            plgpu.copy_gmem_to_smem(Akk_g.at[bh, n], Akk_s, bbars.at[2])
            eye_s[...] = _one(ri == rr).astype(bf16)
            aq_CxC = jnp.where(one_segment(rr <= ri), dAqk_CxC, 0.0).astype(bf16)
            a1_s[...] = aq_CxC
            plgpu.commit_smem()
            if scaled:  # dAqk's two outputs while U and W load
                put_scaled(aq_CxC, a1_s, a3_s, dAqk_g, dAqkT_g, (dn[0], dn[2]), eye_s)
            else:
                plgpu.copy_smem_to_gmem(a1_s, dAqk_g.at[bh, n])
            plgpu.barrier_wait(bbars.at[0])
            plgpu.barrier_wait(bbars.at[1])
            dL_CxC = -_dot([(dRv_s, tview(U_s, tb.get("UT"))), (dRk_s, tview(W_s, tb.get("WT")))],
                          (C, C))
            dL_CxC = jnp.where(one_segment(rr < ri), dL_CxC, 0.0)
            plgpu.barrier_wait(bbars.at[2])
            vec_s[...] = dbeta_C + rowsum(dL_CxC * Akk_s[...])
            ak_CxC = (dL_CxC * lax.broadcast_in_dim(beta_C, (C, C), [0])).astype(bf16)
            a2_s[...] = ak_CxC
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(vec_s, db_g.at[bh, tok])
            if scaled:
                put_scaled(ak_CxC, a2_s, a4_s, dAkk_g, dAkkT_g, (dn[1], dn[3]), eye_s)
            else:
                plgpu.copy_smem_to_gmem(a2_s, dAkk_g.at[bh, n])
                for src, dst, dst_g in ((a1_s, a3_s, dAqkT_g), (a2_s, a4_s, dAkkT_g)):
                    dst[...] = transposed(src, eye_s).astype(bf16)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dst, dst_g.at[bh, n])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(part_b, _swizzled((C, V), bf16), _swizzled((C, K), bf16),
                      _swizzled((C, C), f32), *[_swizzled((C, C), bf16)] * 5,
                      plgpu.Barrier(num_barriers=3))

    scratch = [
        plgpu.SMEM((C,), f32),  # beta
        _swizzled((C, V), bf16),  # dRv (bf16)
        _swizzled((C, K), bf16),  # dRk (bf16)
        plgpu.SMEM((C,), f32),  # dbeta staging
        plgpu.Barrier(num_barriers=11),  # one a load (a and the segment ids: 10, 11)
    ]
    if scaled:  # the staging of the four matrices' scales
        scratch = [*[plgpu.SMEM((C,), f32)] * 4, *scratch]
    if cfg.has_seg:
        scratch += [plgpu.SMEM((C,), f32), plgpu.SMEM((C,), f32)]  # a, segment ids
    if not compiled:  # explicit transposes for the interpreter: V'^T, U^T, W^T
        scratch += [_swizzled((V, C), bf16), _swizzled((V, C), bf16), _swizzled((K, C), bf16)]
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    fn = plgpu.kernel(kernel, out_type=out_shape, kernel_name="kda_intra_bwd_scores_mgpu",
                      grid=(BHV, N), grid_names=("bh", "n"),
                      scratch_types=tuple(scratch), compiler_params=params, interpret=interpret)
    dv, db_BHVxTp, *dA = fn(*seg_in, k, v, G, beta_BHVxTp, W, U, Akk, Tinv, h, Vp, dVp, dO)
    db = jnp.transpose(db_BHVxTp.reshape(B, HV, Tp), (0, 2, 1))[..., None]
    dA[4:] = [m_BHVxTp.reshape(BHV, N, C, 1) for m_BHVxTp in dA[4:]]
    return (dv, db, *dA)
