"""KDA's intra_fwd on Hopper (sm_90) in Pallas' Mosaic GPU backend: a drop-in for
``kda_calls.intra_fwd`` in the case that matters (see ``supports``).

One CTA of one warpgroup per (value head row bh, chunk n): grid (B*HV, N). Per chunk of C = 64
rows (i, j, r = 0..C-1) and channels d (K = V = 128), with the notation of ``kda_body``:

    G_i   = sum_{r<=i} g_r                  (float32)
    Aqk   = tril(sum_d qs_id k_jd e^(G_id - G_jd)),   Akk = strict tril(same with k for qs)
    T     = (I + Diag(beta) Akk)^-1
    W     = T (beta * k * e^G),   U = T (beta * v)
    QG    = qs * e^G,   Kg = k * e^(G_last - G),   gam = e^(G_last)

Every exponent is a tensor-core product of a constant 0/+-1 matrix M [C, C] (built from iota
compares) with the chunk's g [C, K] in bf16: M has exact bf16 entries and each g_r enters with
weight +-1, so the float32 accumulation gives the exponent to float32 rounding, with no
cancellation between two large cumulative sums (an exact difference of partial sums instead of
G_i - G_a). The matrices, with a(i) = s * floor(i / s) the anchor of row i's sub-chunk of s rows:

    Ltri [i, r] = [r <= i]                        -> G                          (QG, W, G, gam)
    Dloc [i, r] = [a(i) < r <= i]                 -> G_i - G_a(i)   <= 0        (row factors)
    Dcol_b[j, r] = [j < r <= b] - [b < r <= j]    -> G_b - G_j                  (column factors)
    Dend [i, r] = [r > i]                         -> G_last - G_i   <= 0        (Kg)

The scores use the factored form of ``kda_body.decayed_scores`` (bounded gates only): for rows
i of sub-chunk ib with anchor b = ib * s,

    A[i, j] = sum_d [x_id e^(G_id - G_bd)] [y_jd e^(G_bd - G_jd)],   j < (ib + 1) s,

one [C, K] x [K, C] wgmma per sub-chunk over all rows (the rows of other sub-chunks are dropped
by a row select afterwards: cheaper than re-staging a masked left operand). Within a sub-chunk
the column factor is at most e^((s-1)|lower_bound|) <= e^80 (``kda._sub_rows`` picks s so).

The inverse follows ``kda_body.tril_inverse`` (8-row diagonal blocks by repeated squaring, then
2 x 2 block merges 8 -> 16 -> 32 -> 64), each [C, C] product as three bf16 wgmmas on a hi + lo
split of both operands (hi*hi + hi*lo + lo*hi: ~16 mantissa bits, at least Triton's tf32).
W and U are single bf16 wgmmas with T rounded to bf16, as in the Triton kernel.

Shapes (HBM): inputs as ``kda_calls.intra_fwd`` (token-major q, k [B, Tp, H, K], v [B, Tp, HV,
V], g [B, Tp, HV, K], beta [B, Tp, HV, 1]); beta is transposed here to [B*HV, Tp] float32 (a
TMA box needs >= 16 contiguous bytes). Outputs W, U, QG, Kg [B*HV, N, C, X] bf16, Aqk [B*HV,
N, C, C] bf16, gam [B*HV, N, 1, K] f32; residuals G [B*HV, N, C, K] f32, Akk [B*HV, N, C, C]
f32, Tinv [B*HV, N, C, C] bf16.

g may be bf16 (one plane) or float32, split exactly into three bf16 planes hi + mid + lo (8
significand bits each) that each exponent product sums, so G is float32-exact either way.

SMEM, as Pallas estimates it: 189 KB with bf16 g, 222 KB with float32 g (of sm_90's 227 KB):
q, k, v, the g planes, beta k e^G (then W), the exponent matrix, Tinv and a float32 [C, K]
staging buffer (g, then G, then e^G) live throughout; the score operands (Xq, Xk, Y) and then
the inverse's operands with the Aqk/Akk staging are scoped in turn. One CTA per SM: no
overlap of one chunk's loads with another's math yet (the next step if it is load-bound).
Outputs are written in place of inputs no longer read (QG over q, W over beta k e^G, U over
beta v, Kg over k) to fit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda_body import KdaConfig

try:  # Pallas-Mosaic GPU (absent from some JAX builds)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed JAX
    plgpu = None

f32, bf16 = jnp.float32, jnp.bfloat16
CHUNK = 64  # rows: one wgmma M tile
DIM = 128  # K and V: one swizzled 128-byte row of bf16 per 64 columns, two wgmma N tiles
INVERSE_BLOCK = 8  # as kda_body.INVERSE_BLOCK


def available() -> bool:
    """Whether this JAX has the Mosaic GPU Pallas API the kernel uses."""
    return plgpu is not None and all(
        hasattr(plgpu, n) for n in ("kernel", "wgmma", "SMEM", "ACC", "Barrier", "load"))


def interpret_params():
    """Mosaic GPU interpret-mode parameters (runs the kernel on CPU), or None if unavailable."""
    cls = getattr(plgpu, "InterpretGPUParams", None) if plgpu is not None else None
    if cls is None:
        try:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
        except ImportError:  # pragma: no cover
            return None
    return cls()


def unsupported_reason(cfg: KdaConfig, q, k, v, g, beta) -> str | None:
    """None when ``intra_fwd`` here computes this call, else why not (the caller falls back to
    the Triton kernel). Supported: no packed segments, the log-decay given (no gate in the
    kernel), a bounded gate, C = 64, K = V = 128 (after padding), bf16 q, k, v and bf16 or
    float32 g and beta."""
    if not available():
        return "no Mosaic GPU Pallas in this JAX"
    checks = [
        (cfg.has_seg, "packed segments"),
        (cfg.gate != "given", f"gate in the kernel ({cfg.gate})"),
        (not cfg.bounded, "unbounded gate (exact diagonal blocks)"),
        (cfg.C != CHUNK, f"chunk {cfg.C} != {CHUNK}"),
        (cfg.K != DIM or cfg.V != DIM, f"K, V = {cfg.K}, {cfg.V} (want {DIM})"),
        (CHUNK % cfg.sub != 0 or cfg.sub < 16, f"sub-chunk {cfg.sub}"),
        (cfg.cd != "bfloat16", f"compute dtype {cfg.cd}"),
        (any(x.dtype != bf16 for x in (q, k, v)), "q, k, v not all bfloat16"),
        (jnp.dtype(g.dtype) not in (jnp.dtype(bf16), jnp.dtype(f32)), f"g dtype {g.dtype}"),
        (jnp.dtype(beta.dtype) not in (jnp.dtype(bf16), jnp.dtype(f32)), "beta dtype"),
    ]
    for bad, why in checks:
        if bad:
            return why
    return None


def _swizzled(shape, dtype):
    """SMEM tiled (8 rows x one 128-byte swizzle row) and swizzled: the layout wgmma operands
    need, and the conflict-free one for WGMMA-layout loads and stores."""
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128)))


def intra_fwd(cfg: KdaConfig, q, k, v, g, beta, segs=(), gate_params=(), *,
              residuals: bool = False, interpret=None):
    """``kda_calls.intra_fwd`` on Mosaic GPU (same arguments and outputs; ``unsupported_reason``
    must be None). ``interpret``: Mosaic GPU interpret params (CPU), None compiles for sm_90.
    ``cfg.poison`` is moot here: every element of every output is written."""
    del segs, gate_params  # unsupported here (see unsupported_reason)
    B, HV, G = cfg.B, cfg.HV, cfg.G
    C, K, V, N, s = cfg.C, cfg.K, cfg.V, cfg.N, cfg.sub
    BHV, Tp, nb = B * HV, cfg.N * cfg.C, cfg.C // cfg.sub
    scale = cfg.scale
    # beta [B, Tp, HV, 1] -> [B*HV, Tp] float32: the chunk's C values contiguous for TMA.
    beta_BHVxTp = jnp.transpose(beta[..., 0].astype(f32), (0, 2, 1)).reshape(BHV, Tp)

    out_shape = [jax.ShapeDtypeStruct((BHV, N, C, x), bf16) for x in (K, V, K, K, C)]
    out_shape.append(jax.ShapeDtypeStruct((BHV, N, 1, K), f32))
    if residuals:
        out_shape += [jax.ShapeDtypeStruct((BHV, N, C, K), f32),
                      jax.ShapeDtypeStruct((BHV, N, C, C), f32),
                      jax.ShapeDtypeStruct((BHV, N, C, C), bf16)]
    n_planes = 1 if g.dtype == bf16 else 3  # bf16 planes of g: see ``expo``

    def g_dst(planes, G_s):  # where TMA puts g: the bf16 plane, or float32 G_s to be split
        return planes[0] if n_planes == 1 else G_s

    WG = plgpu.Layout.WGMMA
    ROW = WG.reduce(1)  # one value per row of a WGMMA-layout array

    def iota(shape, dim):  # compiled: in the WGMMA layout (the interpreter has no layouts)
        if interpret is not None:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WG)

    def div(x, d: int):
        return lax.div(x, jnp.int32(d))

    def dot(pairs, shape):
        """sum(a @ b for a, b in pairs) on the tensor cores, float32 (a, b SMEM refs; reading
        the accumulator waits for the wgmmas, so their operands may be overwritten after)."""
        def scoped(acc):
            for a, b in pairs:
                plgpu.wgmma(acc, a, b)
            return acc[...]
        return pl.run_scoped(scoped, plgpu.ACC(shape, f32))

    def kernel(q_g, k_g, v_g, g_g, beta_g, *refs):
        n_out = len(out_shape)
        outs, (q_s, k_s, v_s, planes, beta_s, b1_s, m_s, t_s, G_s, bars) = (
            refs[:n_out], refs[n_out:])
        W_g, U_g, QG_g, Kg_g, Aqk_g, gam_g, *res_g = outs
        bh, n = lax.axis_index("bh"), lax.axis_index("n")
        b, hv = div(bh, HV), lax.rem(bh, jnp.int32(HV))
        h = div(hv, G)
        tok = pl.ds(n * C, C)

        loads = [(q_g.at[b, tok, h], q_s), (k_g.at[b, tok, h], k_s), (v_g.at[b, tok, hv], v_s),
                 (g_g.at[b, tok, hv], g_dst(planes, G_s)), (beta_g.at[bh, tok], beta_s)]
        for i, (src, dst) in enumerate(loads):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        for i in range(5):
            plgpu.barrier_wait(bars.at[i])
        if len(planes) == 3:
            # float32 g = hi + mid + lo, three bf16 planes, exactly (8 + 8 + 8 significand bits)
            g_CxK = G_s[...] if interpret is not None else plgpu.load(
                G_s, (), layout=WG, optimized=False)
            hi_CxK = g_CxK.astype(bf16)
            r_CxK = g_CxK - hi_CxK.astype(f32)
            mid_CxK = r_CxK.astype(bf16)
            planes[0][...] = hi_CxK
            planes[1][...] = mid_CxK
            planes[2][...] = (r_CxK - mid_CxK.astype(f32)).astype(bf16)

        def store_out(src_s, dst_g):
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(src_s, dst_g.at[bh, n])

        def expo(m_CxC):
            """m [C, C] (0/+-1, float32, WGMMA layout) @ g [C, K]: exact exponents, float32."""
            m_s[...] = m_CxC.astype(bf16)
            plgpu.commit_smem()
            return dot([(m_s, p) for p in planes], (C, K))

        def one(cond):
            return jnp.where(cond, 1.0, 0.0).astype(f32)

        ri, rr = iota((C, C), 0), iota((C, C), 1)  # [C, C] row / column indices
        rows_CxK = iota((C, K), 0)
        # The interpreter has no plgpu.load (and no layouts): a plain load there.
        beta_C = beta_s[...] if interpret is not None else plgpu.load(beta_s, (), layout=ROW)

        def by_row(x_C, shape):  # a per-row vector broadcast along the columns
            return lax.broadcast_in_dim(x_C, shape, [0])

        def scores(xq_s, xk_s, y_s):
            """Phase 1 and 2: QG, gam, G, the score operands, then Aqk and Akk [C, C]."""
            # Row factors e^(G_i - G_a(i)) <= 1: x operands qs e^(...) and k e^(...).
            anchor = div(ri, s) * s
            eR_CxK = jnp.exp(expo(one((anchor < rr) & (rr <= ri))))
            xq_s[...] = (q_s[...].astype(f32) * (scale * eR_CxK)).astype(bf16)
            xk_s[...] = (k_s[...].astype(f32) * eR_CxK).astype(bf16)
            # G, QG (in place of q), beta k e^G (W's right operand), G and gam.
            G_CxK = expo(one(rr <= ri))
            eG_CxK = jnp.exp(G_CxK)
            q_s[...] = (q_s[...].astype(f32) * (scale * eG_CxK)).astype(bf16)
            store_out(q_s, QG_g)
            b1_s[...] = (k_s[...].astype(f32) * eG_CxK * by_row(beta_C, (C, K))).astype(bf16)
            if residuals:
                G_s[...] = G_CxK
                store_out(G_s, res_g[0])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            G_s[...] = eG_CxK  # gam = e^(G_last): row C-1 of e^G
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(G_s.at[pl.ds(C - 1, 1)], gam_g.at[bh, n])

            Aqk_CxC = Akk_CxC = jnp.zeros((C, C), f32)
            for ib in range(nb):
                bidx, jlim = ib * s, (ib + 1) * s
                # column factors e^(G_b - G_j) for j < jlim (at most e^80 inside the sub-chunk)
                E_CxK = expo(one((ri < rr) & (rr <= bidx)) - one((bidx < rr) & (rr <= ri)))
                ok = rows_CxK < jlim
                y_CxK = jnp.where(
                    ok, k_s[...].astype(f32) * jnp.exp(jnp.where(ok, E_CxK, 0.0)), 0.0)
                if interpret is None:
                    y_s[...] = y_CxK.astype(bf16)
                    y_T = plgpu.transpose_ref(y_s, (1, 0))
                else:  # the interpreter's wgmma takes no transposed view: store y^T [K, C]
                    y_s[...] = y_CxK.T.astype(bf16)
                    y_T = y_s
                plgpu.commit_smem()
                Sq_CxC = dot([(xq_s, y_T)], (C, C))
                Sk_CxC = dot([(xk_s, y_T)], (C, C))
                mine = div(ri, s) == ib
                Aqk_CxC = jnp.where(mine, Sq_CxC, Aqk_CxC)
                Akk_CxC = jnp.where(mine, Sk_CxC, Akk_CxC)
            return Aqk_CxC, Akk_CxC

        y_shape = (C, K) if interpret is None else (K, C)
        Aqk_CxC, Akk_CxC = pl.run_scoped(scores, _swizzled((C, K), bf16),
                                         _swizzled((C, K), bf16), _swizzled(y_shape, bf16))
        Akk_CxC = jnp.where(rr < ri, Akk_CxC, 0.0)

        def inverse(ahi_s, alo_s, bhi_s, blo_s, a_s, akk_s):
            """Phase 3: Aqk and Akk out, then (I + L)^-1, L = Diag(beta) Akk, as
            kda_body.tril_inverse."""
            a_s[...] = jnp.where(rr <= ri, Aqk_CxC, 0.0).astype(bf16)
            store_out(a_s, Aqk_g)
            if residuals:
                akk_s[...] = Akk_CxC
                store_out(akk_s, res_g[1])

            def mm(A_CxC, B_CxC):  # A @ B to ~16 mantissa bits: bf16 hi + lo of both operands
                Ahi_CxC, Bhi_CxC = A_CxC.astype(bf16), B_CxC.astype(bf16)
                ahi_s[...] = Ahi_CxC
                alo_s[...] = (A_CxC - Ahi_CxC.astype(f32)).astype(bf16)
                bhi_s[...] = Bhi_CxC
                blo_s[...] = (B_CxC - Bhi_CxC.astype(f32)).astype(bf16)
                plgpu.commit_smem()
                return dot([(ahi_s, bhi_s), (ahi_s, blo_s), (alo_s, bhi_s)], (C, C))

            L_CxC = Akk_CxC * by_row(beta_C, (C, C))
            hb = INVERSE_BLOCK
            P_CxC = -jnp.where(div(ri, hb) == div(rr, hb), L_CxC, 0.0)
            Tinv_CxC = one(ri == rr) + P_CxC
            m = 1
            while 2 * m < hb:
                P_CxC = mm(P_CxC, P_CxC)
                Tinv_CxC = Tinv_CxC + mm(Tinv_CxC, P_CxC)
                m *= 2
            while hb < C:  # merge pairs of hb-blocks: T <- T - T P T, P = L's lower-left block
                pair = ((div(ri, 2 * hb) == div(rr, 2 * hb)) & (lax.rem(div(ri, hb), 2) == 1)
                        & (lax.rem(div(rr, hb), 2) == 0))
                X_CxC = mm(Tinv_CxC, jnp.where(pair, L_CxC, 0.0))
                Tinv_CxC = Tinv_CxC - mm(X_CxC, Tinv_CxC)
                hb *= 2
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a_s, akk_s are freed next
            return Tinv_CxC

        Tinv_CxC = pl.run_scoped(inverse, *[_swizzled((C, C), bf16)] * 5, _swizzled((C, C), f32))
        t_s[...] = Tinv_CxC.astype(bf16)
        plgpu.commit_smem()
        if residuals:
            plgpu.copy_smem_to_gmem(t_s, res_g[2].at[bh, n])
        # Phase 4: W = T (beta k e^G) and U = T (beta v), each written over its right operand.
        W_CxK = dot([(t_s, b1_s)], (C, K))
        b1_s[...] = W_CxK.astype(bf16)
        store_out(b1_s, W_g)
        v_s[...] = (v_s[...].astype(f32) * by_row(beta_C, (C, V))).astype(bf16)
        plgpu.commit_smem()
        U_CxV = dot([(t_s, v_s)], (C, V))
        v_s[...] = U_CxV.astype(bf16)
        store_out(v_s, U_g)
        # Kg = k e^(G_last - G) in place of k (no longer read).
        eD_CxK = jnp.exp(expo(one(rr > ri)))
        k_s[...] = (k_s[...].astype(f32) * eD_CxK).astype(bf16)
        store_out(k_s, Kg_g)
        plgpu.wait_smem_to_gmem(0)

    scratch = (
        _swizzled((C, K), bf16), _swizzled((C, K), bf16), _swizzled((C, V), bf16),  # q k v
        [_swizzled((C, K), bf16)] * n_planes,  # g as bf16 planes (g = their sum)
        plgpu.SMEM((C,), f32),  # beta
        _swizzled((C, K), bf16),  # beta k e^G, then W
        _swizzled((C, C), bf16),  # the exponent matrix
        _swizzled((C, C), bf16),  # Tinv
        # float32 g as loaded, then G, then e^G (untiled: gam is one row of it)
        plgpu.SMEM((C, K), f32),
        plgpu.Barrier(num_barriers=5),
    )
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    fn = plgpu.kernel(kernel, out_type=out_shape, grid=(BHV, N), grid_names=("bh", "n"),
                      scratch_types=scratch, compiler_params=params, interpret=interpret)
    return fn(q, k, v, g, beta_BHVxTp)


@functools.cache
def is_hopper() -> bool:
    """Whether the default device is an NVIDIA GPU of compute capability 9.x: wgmma exists on
    sm_90a only (Blackwell, sm_100, has tcgen05 instead, a different kernel)."""
    try:
        dev = jax.devices()[0]
        if dev.platform != "gpu":
            return False
        return str(getattr(dev, "compute_capability", "0")).split(".")[0] == "9"
    except Exception:  # any failure means "not Hopper"
        return False
