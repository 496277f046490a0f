"""KDA's backward intra_bwd_scores on Hopper (sm_90) in Pallas' Mosaic GPU backend: a drop-in
for ``kda_calls.intra_bwd_scores`` (described in its docstring) for the calls
``unsupported_reason`` accepts; ``kda_calls`` dispatches to it as ``KernelTuning.hopper`` says.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda_body import KdaConfig, pow2_scales, stores_scaled_blocks
from pallas_kernels.kda_mgpu import CHUNK, WHOLE_DIMS, _swizzled, plgpu

f32, bf16 = jnp.float32, jnp.bfloat16


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


def unsupported_reason(cfg: KdaConfig, k, v, G, beta, dv_dtype) -> str | None:
    """None when ``intra_bwd_scores`` here computes this call (the arguments of
    ``kda_calls.intra_bwd_scores``, arrays or ``jax.ShapeDtypeStruct``), else why not.
    Supported: a bounded gate (given or in the kernel: this kernel reads only the forward's G),
    packed segments or not, C = 64, K and V of 64 or 128 (after padding), bf16 k, v and
    intermediates, bf16 or float32 G and beta, and dv written in bf16."""
    checks = [
        (plgpu is None, "no Mosaic GPU Pallas in this JAX"),
        (not cfg.bounded, "unbounded gate (exact diagonal blocks)"),
        (cfg.C != CHUNK, f"chunk {cfg.C} != {CHUNK}"),
        (cfg.K not in WHOLE_DIMS or cfg.V not in WHOLE_DIMS,
         f"K, V = {cfg.K}, {cfg.V} (want {WHOLE_DIMS})"),
        (CHUNK % cfg.sub != 0 or cfg.sub < 16, f"sub-chunk {cfg.sub}"),
        (cfg.cd != "bfloat16", f"compute dtype {cfg.cd}"),
        (any(x.dtype != bf16 for x in (k, v)), "k, v not both bfloat16"),
        (jnp.dtype(G.dtype) not in (jnp.dtype(bf16), jnp.dtype(f32)), f"G dtype {G.dtype}"),
        (jnp.dtype(beta.dtype) not in (jnp.dtype(bf16), jnp.dtype(f32)),
         f"beta dtype {beta.dtype}"),
        (jnp.dtype(dv_dtype) != jnp.dtype(bf16), f"dv dtype {jnp.dtype(dv_dtype)} (bf16 here)"),
    ]
    for bad, why in checks:
        if bad:
            return why
    return None


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
    bytes), dAqk, dAkk, dAqkT, dAkkT [B*HV, N, C, C] bf16, with cfg.bwd_rows' blocks the
    diagonal blocks of their rows scaled and their scales [B*HV, N, C, 1] float32 after them
    (``kda_body.scale_diagonal_blocks``, on the bf16 values; each transpose is taken before the
    scaling).

    SMEM: the bf16 dRv, dRk live throughout; St, dO, V', v, k, G, Tinv and dV' are scoped to
    the first part, Akk (float32), U, W and the output staging to the second, which loads them
    (Akk under dL's wgmma): at K = V = 64 two CTAs then share an SM (tests/test_kda_mgpu.py
    checks Pallas' estimate), at 128 one. The float32 G and Akk are tiled and swizzled like the
    bf16 operands: untiled, the 8 rows a warp reads of a WGMMA-layout load start on one bank
    (rows of 256 or 512 bytes), a many-way bank conflict.
    """
    B, HV = cfg.B, cfg.HV
    C, K, V, N = cfg.C, cfg.K, cfg.V, cfg.N
    assert C == CHUNK and jnp.dtype(dv_dtype) == jnp.dtype(bf16)
    BHV, Tp = B * HV, N * C
    beta_BHVxTp = jnp.transpose(beta[..., 0].astype(f32), (0, 2, 1)).reshape(BHV, Tp)
    # a and the segment ids per token, [B, Tp] float32 (ids compare exactly below 2^24)
    seg_in = (segs[0].reshape(B, Tp).astype(f32), segs[2].reshape(B, Tp).astype(f32)
              ) if cfg.has_seg else ()
    # cfg.bwd_rows' blocks: the four matrices with the diagonal blocks of their rows
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
        bar_of, waited = {}, set()  # loads: one barrier each, waited at first use (``need``)

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
