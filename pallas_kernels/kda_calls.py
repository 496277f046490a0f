"""The four KDA pallas_calls, each with a GPU driver and a TPU driver around ``kda_body``.

    intra_fwd   grid (B*HV, N), all parallel: W, U, QG, Kg, Aqk, gam of every chunk.
    state_fwd   the state pass: O (and, for the backward, the states h and V' of every chunk).
    state_bwd   the reverse state pass: dh (gradient of each chunk's outgoing state) and dV'.
    intra_bwd   grid (B*HV, N), then (K/BK, B*HV, N), all parallel: dq, dk, dv, dg, dbeta.

Both state passes and intra_bwd's first kernel (intra_bwd_scores) have Mosaic GPU forms for
Hopper cards (kda_mgpu_state, kda_mgpu_bwd), taken as ``KernelTuning.hopper`` says
(``mosaic_gpu_mode``).

The state passes carry S across chunks. On GPU (Pallas-Triton) grid programs run in parallel,
so one program per (B*HV, V tile) walks all chunks in a ``fori_loop`` with the state in
registers. On TPU (Mosaic) the chunk index is the last, "arbitrary" grid axis and the state
lives in a VMEM scratch buffer across grid steps. Plain interpret mode runs the GPU driver,
TPU interpret mode the TPU one.

Layouts. Inputs and the outputs users see are token-major [B, T, heads, X] on GPU (the layout
callers have: no transposes) and head-major [B, heads, T, X] on TPU (Mosaic wants the two
minor block dims to be tiles). Intermediates are ours: [B*HV, N, C, X] for per-chunk rows and
[B*HV, N, V, K] for per-chunk (transposed) states.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import device, kda_mgpu, kda_mgpu_bwd, kda_mgpu_state
from pallas_kernels import kda_body as body
from pallas_kernels.kda_body import KdaConfig

# Optional backend: a JAX without it still runs the others (device.probe says which compile).
try:  # Pallas-Mosaic TPU
    from jax.experimental.pallas import tpu as pltpu
except ImportError:  # pragma: no cover
    pltpu = None

f32 = jnp.float32
DA_NAMES = ("dAqk", "dAkk", "dAqkT", "dAkkT")  # the [C, C] score gradients between the two
# intra-chunk backward kernels, then, with cfg.bwd_rows' blocks (the diagonal blocks of their
# rows scaled: body.stores_scaled_blocks), the [C, 1] powers of two that undo each one's scaling
DA_DOWN_NAMES = tuple(f"{name}_down" for name in DA_NAMES)


def da_names(cfg: KdaConfig) -> tuple[str, ...]:
    """What intra_bwd_scores hands intra_bwd_channels (its outputs after dv and dbeta)."""
    return DA_NAMES + DA_DOWN_NAMES if body.stores_scaled_blocks(cfg) else DA_NAMES


def _compiler_params(cfg: KdaConfig, *, warps: int, stages: int | None, dims: tuple[str, ...]):
    if cfg.mode == "gpu":
        return device.triton_compiler_params(warps, stages)
    if cfg.mode in ("tpu", "tpu_interpret"):
        cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
        return cls(dimension_semantics=dims)
    return None


def _interpret_arg(cfg: KdaConfig):
    if cfg.mode == "interpret":
        return True
    if cfg.mode == "tpu_interpret":
        return pltpu.InterpretParams()
    return False


def _call(kernel, cfg: KdaConfig, *, grid, in_specs, out_specs, out_shape, name,
          warps=4, stages=None, dims=None, scratch=()):
    """pallas_call with backend-specific parameters chosen at call time. With ``cfg.poison``
    every output is first filled with NaN and aliased to an extra input, so the kernel starts
    from NaN wherever it does not write."""
    poison = cfg.poison
    n_in, n_out = len(in_specs), len(out_specs)
    if poison:
        def kernel_fn(*refs):
            return kernel(*refs[:n_in], *refs[n_in + n_out:])
        in_specs = list(in_specs) + list(out_specs)
        aliases = {n_in + i: i for i in range(n_out)}
    else:
        kernel_fn, aliases = kernel, {}
    kwargs = {}
    params = _compiler_params(cfg, warps=warps, stages=stages,
                              dims=dims or ("parallel",) * len(grid))
    if params is not None:
        kwargs["compiler_params"] = params
    if scratch:
        kwargs["scratch_shapes"] = scratch
    fn = pl.pallas_call(
        kernel_fn, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases, interpret=_interpret_arg(cfg), name=name, **kwargs,
    )
    if not poison:
        return fn

    def poisoned(*args):
        nans = [jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape]
        return fn(*args, *nans)

    return poisoned


def _div(i, d: int):
    """i // d for the non-negative grid indices of index maps (floor_divide's sign logic does
    not lower everywhere)."""
    return lax.div(i, jnp.int32(d)) if d != 1 else i


def _rem(i, d: int):
    return lax.rem(i, jnp.int32(d)) if d != 1 else jnp.zeros_like(i)


def head_major(cfg: KdaConfig) -> bool:
    return cfg.mode in ("tpu", "tpu_interpret")


def _tok_spec(cfg: KdaConfig, last: int, head_of, chunk_of, *, rows=None):
    """BlockSpec of a user-layout array [B, T, heads, X] / [B, heads, T, X].

    Block: ``rows`` tokens (default C) of one head and all of X (or ``last`` columns, tile
    ``tile_of``). ``head_of(*grid)`` -> (b, head); ``chunk_of(*grid)`` -> (token block, X block).
    """
    rows = cfg.C if rows is None else rows
    if head_major(cfg):
        def index(*gi):
            b, h = head_of(*gi)
            t, x = chunk_of(*gi)
            return (b, h, t, x)
        return pl.BlockSpec((None, None, rows, last), index)

    def index(*gi):
        b, h = head_of(*gi)
        t, x = chunk_of(*gi)
        return (b, t, h, x)
    return pl.BlockSpec((None, rows, None, last), index)


def _tok_shape(cfg: KdaConfig, heads: int, last: int, dtype):
    Tp = cfg.N * cfg.C
    shape = (cfg.B, heads, Tp, last) if head_major(cfg) else (cfg.B, Tp, heads, last)
    return jax.ShapeDtypeStruct(shape, dtype)


def _seg_specs(cfg: KdaConfig, chunk_of):
    """a, lm, segc [B, N, C, 1] and segr [B, N, 1, C]; chunk_of(*grid) -> (b, n)."""
    col = pl.BlockSpec((None, None, cfg.C, 1), lambda *gi: (*chunk_of(*gi), 0, 0))
    row = pl.BlockSpec((None, None, 1, cfg.C), lambda *gi: (*chunk_of(*gi), 0, 0))
    return [col, col, col, row]


# ----------------------------------------------------------------------------- intra (fwd)


def _take_seg(cfg: KdaConfig, refs):
    """(the loaded segment arrays a, lm, segc, segr, or four Nones; the refs after them)."""
    if cfg.has_seg:
        return tuple(r[...] for r in refs[:4]), refs[4:]
    return (None,) * 4, refs


def _chunk_specs(cfg: KdaConfig):
    """Index maps and BlockSpecs shared by the per-chunk kernels (grid (B*HV, N, ...)): the
    q/k head and the value head of program (bh, n), token block n, a per-chunk block of
    intermediates [C, x], and the segment arrays (an empty list without segments)."""
    HV = cfg.HV
    return SimpleNamespace(
        qk_head=lambda bh, n, *_: (_div(bh, HV), _div(_rem(bh, HV), cfg.G)),
        v_head=lambda bh, n, *_: (_div(bh, HV), _rem(bh, HV)),
        chunk=lambda bh, n, *_: (n, 0),
        per_chunk=lambda x: pl.BlockSpec((None, None, cfg.C, x), lambda bh, n, *_: (bh, n, 0, 0)),
        seg=_seg_specs(cfg, lambda bh, n, *_: (_div(bh, HV), n)) if cfg.has_seg else [],
    )


def _regrid(spec: pl.BlockSpec, order) -> pl.BlockSpec:
    """``spec`` on a grid with permuted axes: its index map gets, as its j-th grid index, the
    new grid's axis ``order[j]``."""
    index_map = spec.index_map
    return dataclasses.replace(spec, index_map=lambda *g: index_map(*(g[i] for i in order)))


def _writer(ks, vs, by_k: dict, by_v: dict, whole: dict):
    """put(name, i, x): store x into the named output ref, at K slice i (refs in by_k), V slice i
    (by_v) or whole (whole), in the ref's dtype. Kernel bodies write through it."""

    def put(name, i, x):
        if name in whole:
            whole[name][...] = x.astype(whole[name].dtype)
        elif name in by_v:
            by_v[name][:, vs(i)] = x.astype(by_v[name].dtype)
        else:
            by_k[name][:, ks(i)] = x.astype(by_k[name].dtype)

    return put


def _slicers(cfg: KdaConfig):
    """Column slices of K slice s and of V tile t (static when s, t are Python ints)."""
    return (lambda s: pl.ds(s * cfg.bk, cfg.bk)), (lambda t: pl.ds(t * cfg.bv_intra, cfg.bv_intra))


def _gate_param_spec(cfg: KdaConfig, width: int, slice_of=lambda *gi: 0):
    """BlockSpec of A or dt_bias [HV, 1, K] (the in-kernel gate's per-head parameters): the row
    of program (bh, ...)'s value head, ``width`` columns, column block ``slice_of(*grid)``."""
    return pl.BlockSpec((None, 1, width),
                        lambda bh, *gi: (_rem(bh, cfg.HV), 0, slice_of(bh, *gi)))


def _take_gate(cfg: KdaConfig, refs):
    """(the in-kernel gate's parameter refs (A, dt_bias) or (), the refs after them)."""
    return (refs[:2], refs[2:]) if cfg.gate != "given" else ((), refs)


def mosaic_gpu_mode(cfg: KdaConfig, kernel: str, unsupported: str | None) -> str | None:
    """How ``kernel`` (its name, for errors) runs this call, by ``cfg.hopper``
    (KernelTuning.hopper): "compiled" (its Mosaic GPU form, for sm_90), "interpret" (its Mosaic
    GPU form in Mosaic GPU interpret mode) or None (the Triton or TPU kernel). ``unsupported``:
    the Mosaic GPU kernel's ``unsupported_reason`` for the call (None: it implements it).

    hopper = 0: None. -1: "compiled" in "gpu" mode where ``device.probe("gpu")`` finds Mosaic
    GPU (a Hopper card) and the kernel implements the call, None otherwise ("interpret" mode
    included). 1: "compiled" in "gpu" mode, "interpret" in "interpret" mode, and ValueError,
    naming why, where the card, the mode or the call rules the Mosaic GPU kernel out."""
    if cfg.hopper == 0 or (cfg.hopper == -1 and cfg.mode != "gpu"):
        return None
    if cfg.mode == "gpu":
        why = device.probe("gpu").why_not("mosaic_gpu")
    elif cfg.mode == "interpret":
        why = (None if kda_mgpu.interpret_params() is not None
               else f"this JAX ({jax.__version__}) has no Mosaic GPU interpret mode")
    else:
        why = f"backend {cfg.mode!r} has no Mosaic GPU kernels (a GPU's only)"
    why = why or unsupported
    if why is None:
        return "compiled" if cfg.mode == "gpu" else "interpret"
    if cfg.hopper == 1:
        raise ValueError(f"kda_pallas: KernelTuning.hopper=1 runs the Mosaic GPU {kernel}, "
                         f"which cannot take this call: {why} (hopper=-1 falls back to Triton "
                         "where it cannot, 0 runs Triton only)")
    return None


def scores_mode(cfg: KdaConfig, k, v, G, beta, dv_dtype) -> str | None:
    """``mosaic_gpu_mode`` of intra_bwd_scores for these arguments (arrays or
    ``jax.ShapeDtypeStruct``, as ``intra_bwd_scores`` takes them)."""
    why = kda_mgpu_bwd.unsupported_reason(cfg, k, v, G, beta, dv_dtype)
    return mosaic_gpu_mode(cfg, "intra_bwd_scores", why)


def state_mode(cfg: KdaConfig, dtype) -> str | None:
    """``mosaic_gpu_mode`` of the state passes; dtype: the forward's O, the backward's dO."""
    return mosaic_gpu_mode(cfg, "state passes", kda_mgpu_state.unsupported_reason(cfg, dtype))


def _mosaic_gpu_interpret(mode: str):
    """The ``interpret`` argument of a Mosaic GPU kernel run in ``mode`` (``mosaic_gpu_mode``):
    None compiles for sm_90."""
    return kda_mgpu.interpret_params() if mode == "interpret" else None


def _cta_barrier(cfg: KdaConfig):
    """Compiled Triton: a barrier of the program's threads, after which each sees every other's
    stores to memory (bar.sync). Interpret mode runs a program's code in order: nothing."""
    if cfg.mode == "gpu":
        device.pallas_triton().debug_barrier()


def intra_fwd(cfg: KdaConfig, q, k, v, g, beta, segs, gate_params=(), *,
              residuals: bool = False):
    """W, U, QG, Kg [B*HV, N, C, X] (cfg.cd), Aqk [B*HV, N, C, C] (cfg.cd), gam [B*HV, N, 1, K] f32
    and, with ``residuals`` (for the backward), the chunk-local cumulative gate G [B*HV, N, C, K]
    f32, the chunk's masked Akk [B*HV, N, C, C] f32 and Tinv = (I + Diag(beta) Akk)^-1
    [B*HV, N, C, C] (cfg.cd).

    With the gate in the kernel (``cfg.gate`` not "given"), g holds the gate logits f and
    ``gate_params`` = (A, dt_bias), each [HV, 1, K] float32.

    In the GPU layout (Triton, interpret mode) W's operand beta k e^G goes from the scores loop
    to the inverse through W's own buffer, behind a barrier of the program's threads
    (``kda_body.fwd_intra``); the TPU modes recompute it."""
    # The forward's K slices (KernelTuning.bk_fwd): the body reads them as cfg.bk.
    cfg = dataclasses.replace(cfg, bk=cfg.bk_fwd)
    BHV, N, C, K, V = cfg.B * cfg.HV, cfg.N, cfg.C, cfg.K, cfg.V
    sp = _chunk_specs(cfg)
    qk_head, v_head, chunk, per_chunk = sp.qk_head, sp.v_head, sp.chunk, sp.per_chunk
    gate_specs = [_gate_param_spec(cfg, K)] * 2 if cfg.gate != "given" else []
    in_specs = [
        _tok_spec(cfg, K, qk_head, chunk), _tok_spec(cfg, K, qk_head, chunk),
        _tok_spec(cfg, V, v_head, chunk), _tok_spec(cfg, K, v_head, chunk),
        _tok_spec(cfg, 1, v_head, chunk), *gate_specs, *sp.seg,
    ]
    out_specs = [per_chunk(K), per_chunk(V), per_chunk(K), per_chunk(K), per_chunk(C),
                 pl.BlockSpec((None, None, 1, K), lambda bh, n: (bh, n, 0, 0))]
    dt = cfg.dtype
    out_shape = [jax.ShapeDtypeStruct((BHV, N, C, x), dt) for x in (K, V, K, K, C)]
    out_shape.append(jax.ShapeDtypeStruct((BHV, N, 1, K), f32))
    if residuals:
        out_specs += [per_chunk(K), per_chunk(C), per_chunk(C)]
        out_shape += [jax.ShapeDtypeStruct((BHV, N, C, K), f32),
                      jax.ShapeDtypeStruct((BHV, N, C, C), f32),
                      jax.ShapeDtypeStruct((BHV, N, C, C), dt)]

    def kernel(q_r, k_r, v_r, g_r, b_r, *refs):
        gate_r, refs = _take_gate(cfg, refs)
        seg, outs = _take_seg(cfg, refs)
        W_r, U_r, QG_r, Kg_r, A_r, gam_r, *res_r = outs
        ks, vs = _slicers(cfg)
        whole, by_k = {"Aqk": A_r}, {"QG": QG_r, "Kg": Kg_r, "W": W_r, "gam": gam_r}
        if residuals:
            by_k["G"] = res_r[0]
            whole.update(Akk=res_r[1], Tinv=res_r[2])
        put = _writer(ks, vs, by_k=by_k, by_v={"U": U_r}, whole=whole)

        io = SimpleNamespace(
            qkg=lambda s: (q_r[:, ks(s)], k_r[:, ks(s)], g_r[:, ks(s)]),
            v=lambda t: v_r[:, vs(t)], beta=b_r[...], seg=seg, put=put, residuals=residuals,
            handoff=None if head_major(cfg) else "W", W_in=lambda s: W_r[:, ks(s)],
            sync=functools.partial(_cta_barrier, cfg),
            gate_params=lambda s: tuple(r[:, ks(s)] for r in gate_r))
        body.fwd_intra(io, pl.program_id(1), cfg)

    args = (q, k, v, g, beta, *gate_params) + (tuple(segs) if cfg.has_seg else ())
    return _call(kernel, cfg, grid=(BHV, N), in_specs=in_specs, out_specs=out_specs,
                 out_shape=out_shape, name="kda_intra_fwd", warps=cfg.warps_intra,
                 stages=cfg.stages_intra)(*args)


# ----------------------------------------------------------------------------- state passes


def _carry_in_scratch(step, carry_r, init_r, final_r, N: int):
    """TPU state passes: grid step t of the "arbitrary" chunk axis runs ``step`` on the state
    carried in the VMEM scratch ``carry_r`` (loaded from ``init_r`` at t = 0) and stores the
    state after the last chunk in ``final_r``."""
    t = pl.program_id(2)

    @pl.when(t == 0)
    def _():
        carry_r[...] = init_r[...]

    new = step(carry_r[...])
    carry_r[...] = new

    @pl.when(t == N - 1)
    def _():
        final_r[...] = new


def _tpu_sequential_call(kernel, cfg: KdaConfig, in_specs, out_specs, out_shape, name, grid, BV):
    """pallas_call of a TPU state pass: grid (B*HV, V tiles, chunks), chunks in order, one
    [BV, K] float32 scratch for the carried state."""
    return _call(kernel, cfg, grid=grid, in_specs=in_specs, out_specs=out_specs,
                 out_shape=out_shape, name=name, dims=("parallel", "parallel", "arbitrary"),
                 scratch=[pltpu.VMEM((BV, cfg.K), f32)])


def state_fwd(cfg: KdaConfig, W, U, QG, Kg, Aqk, gam, h0t, *, out_dtype, residuals: bool):
    """O in the user layout (out_dtype), final St [B*HV, V, K] f32 and, if ``residuals``, the
    state entering every chunk h [B*HV, N, V, K] and V' [B*HV, N, C, V] (both cfg.cd).

    The Mosaic GPU kernel (kda_mgpu_state) computes it where ``state_mode`` says so."""
    mode = state_mode(cfg, out_dtype)
    if mode is not None:
        return kda_mgpu_state.state_fwd(cfg, W, U, QG, Kg, Aqk, gam, h0t, out_dtype=out_dtype,
                                        residuals=residuals,
                                        interpret=_mosaic_gpu_interpret(mode))
    BHV, N, C, K, V, HV, BV = cfg.B * cfg.HV, cfg.N, cfg.C, cfg.K, cfg.V, cfg.HV, cfg.bv_seq
    nv = V // BV
    dt = cfg.dtype
    out_shape = [_tok_shape(cfg, HV, V, out_dtype), jax.ShapeDtypeStruct((BHV, V, K), f32)]
    if residuals:
        out_shape += [jax.ShapeDtypeStruct((BHV, N, V, K), dt),
                      jax.ShapeDtypeStruct((BHV, N, C, V), dt)]
    args = (W, U, QG, Kg, Aqk, gam, h0t)
    o_head = lambda bh, vt, *n: (_div(bh, HV), _rem(bh, HV))

    if head_major(cfg):  # TPU: grid over chunks, state in VMEM scratch
        chunk = lambda x, last_block=False: pl.BlockSpec(
            (None, None, C, x), lambda bh, vt, n: (bh, n, 0, vt if last_block else 0))
        in_specs = [chunk(K), chunk(BV, True), chunk(K), chunk(K), chunk(C),
                    pl.BlockSpec((None, None, 1, K), lambda bh, vt, n: (bh, n, 0, 0)),
                    pl.BlockSpec((None, BV, K), lambda bh, vt, n: (bh, vt, 0))]
        out_specs = [_tok_spec(cfg, BV, o_head, lambda bh, vt, n: (n, vt)),
                     pl.BlockSpec((None, BV, K), lambda bh, vt, n: (bh, vt, 0))]
        if residuals:
            out_specs += [pl.BlockSpec((None, None, BV, K), lambda bh, vt, n: (bh, n, vt, 0)),
                          chunk(BV, True)]

        def kernel(W_r, U_r, QG_r, Kg_r, A_r, gam_r, h0_r, o_r, ST_r, *rest):
            *res_r, St_r = rest

            def step(St):
                St_next, Vp, O = body.state_step(St, W_r[...], U_r[...], QG_r[...], Kg_r[...],
                                                 A_r[...], gam_r[...], cfg)
                o_r[...] = O.astype(o_r.dtype)
                if residuals:
                    res_r[0][...] = St.astype(dt)
                    res_r[1][...] = Vp.astype(dt)
                return St_next

            _carry_in_scratch(step, St_r, h0_r, ST_r, N)

        return _tpu_sequential_call(kernel, cfg, in_specs, out_specs, out_shape, "kda_state_fwd",
                                    (BHV, nv, N), BV)(*args)

    # GPU / interpret: one program per (B*HV, V tile) loops over all chunks.
    whole = lambda x, last_block=False: pl.BlockSpec(
        (None, N, C, x), lambda bh, vt: (bh, 0, 0, vt if last_block else 0))
    in_specs = [whole(K), whole(BV, True), whole(K), whole(K), whole(C),
                pl.BlockSpec((None, N, 1, K), lambda bh, vt: (bh, 0, 0, 0)),
                pl.BlockSpec((None, BV, K), lambda bh, vt: (bh, vt, 0))]
    out_specs = [_tok_spec(cfg, BV, o_head, lambda bh, vt: (0, vt), rows=N * C),
                 pl.BlockSpec((None, BV, K), lambda bh, vt: (bh, vt, 0))]
    if residuals:
        out_specs += [pl.BlockSpec((None, N, BV, K), lambda bh, vt: (bh, 0, vt, 0)),
                      whole(BV, True)]

    def kernel(W_r, U_r, QG_r, Kg_r, A_r, gam_r, h0_r, o_r, ST_r, *res_r):
        def step(n, St):
            St_next, Vp, O = body.state_step(St, W_r[n], U_r[n], QG_r[n], Kg_r[n], A_r[n],
                                             gam_r[n], cfg)
            o_r[pl.ds(n * C, C), :] = O.astype(o_r.dtype)
            if residuals:
                res_r[0][n] = St.astype(dt)
                res_r[1][n] = Vp.astype(dt)
            return St_next

        ST_r[...] = lax.fori_loop(0, N, step, h0_r[...].astype(f32))

    return _call(kernel, cfg, grid=(BHV, nv), in_specs=in_specs, out_specs=out_specs,
                 out_shape=out_shape, name="kda_state_fwd", warps=cfg.warps_seq,
                 stages=cfg.stages_seq)(*args)


def state_bwd(cfg: KdaConfig, dO, W, QG, Kg, Aqk, gam, dSTt):
    """Reverse pass. dO in the user layout, dSTt [B*HV, V, K] (gradient of the final state,
    transposed). Returns dh [B*HV, N, V, K], dV' [B*HV, N, C, V] (cfg.cd) and dS0t [B*HV, V, K].

    The Mosaic GPU kernel (kda_mgpu_state) computes it where ``state_mode`` says so."""
    mode = state_mode(cfg, dO.dtype)
    if mode is not None:
        return kda_mgpu_state.state_bwd(cfg, dO, W, QG, Kg, Aqk, gam, dSTt,
                                        interpret=_mosaic_gpu_interpret(mode))
    BHV, N, C, K, V, HV, BV = cfg.B * cfg.HV, cfg.N, cfg.C, cfg.K, cfg.V, cfg.HV, cfg.bv_seq
    nv = V // BV
    dt = cfg.dtype
    out_shape = [jax.ShapeDtypeStruct((BHV, N, V, K), dt),
                 jax.ShapeDtypeStruct((BHV, N, C, V), dt),
                 jax.ShapeDtypeStruct((BHV, V, K), f32)]
    args = (dO, W, QG, Kg, Aqk, gam, dSTt)
    o_head = lambda bh, vt, *n: (_div(bh, HV), _rem(bh, HV))

    if head_major(cfg):
        rev = lambda n: N - 1 - n
        chunk = lambda x: pl.BlockSpec((None, None, C, x), lambda bh, vt, n: (bh, rev(n), 0, 0))
        in_specs = [_tok_spec(cfg, BV, o_head, lambda bh, vt, n: (rev(n), vt)),
                    chunk(K), chunk(K), chunk(K), chunk(C),
                    pl.BlockSpec((None, None, 1, K), lambda bh, vt, n: (bh, rev(n), 0, 0)),
                    pl.BlockSpec((None, BV, K), lambda bh, vt, n: (bh, vt, 0))]
        out_specs = [pl.BlockSpec((None, None, BV, K), lambda bh, vt, n: (bh, rev(n), vt, 0)),
                     pl.BlockSpec((None, None, C, BV), lambda bh, vt, n: (bh, rev(n), 0, vt)),
                     pl.BlockSpec((None, BV, K), lambda bh, vt, n: (bh, vt, 0))]

        def kernel(dO_r, W_r, QG_r, Kg_r, A_r, gam_r, dST_r, dh_r, dVp_r, dS0_r, dSt_r):
            def step(dSt):
                dh_r[...] = dSt.astype(dt)
                dSt_prev, dVp = body.reverse_step(dSt, dO_r[...], W_r[...], QG_r[...],
                                                  Kg_r[...], A_r[...], gam_r[...], cfg)
                dVp_r[...] = dVp.astype(dt)
                return dSt_prev

            _carry_in_scratch(step, dSt_r, dST_r, dS0_r, N)

        return _tpu_sequential_call(kernel, cfg, in_specs, out_specs, out_shape, "kda_state_bwd",
                                    (BHV, nv, N), BV)(*args)

    whole = lambda x: pl.BlockSpec((None, N, C, x), lambda bh, vt: (bh, 0, 0, 0))
    in_specs = [_tok_spec(cfg, BV, o_head, lambda bh, vt: (0, vt), rows=N * C),
                whole(K), whole(K), whole(K), whole(C),
                pl.BlockSpec((None, N, 1, K), lambda bh, vt: (bh, 0, 0, 0)),
                pl.BlockSpec((None, BV, K), lambda bh, vt: (bh, vt, 0))]
    out_specs = [pl.BlockSpec((None, N, BV, K), lambda bh, vt: (bh, 0, vt, 0)),
                 pl.BlockSpec((None, N, C, BV), lambda bh, vt: (bh, 0, 0, vt)),
                 pl.BlockSpec((None, BV, K), lambda bh, vt: (bh, vt, 0))]

    def kernel(dO_r, W_r, QG_r, Kg_r, A_r, gam_r, dST_r, dh_r, dVp_r, dS0_r):
        def step(i, dSt):
            n = N - 1 - i
            dh_r[n] = dSt.astype(dt)
            dSt_prev, dVp = body.reverse_step(dSt, dO_r[pl.ds(n * C, C), :], W_r[n], QG_r[n],
                                              Kg_r[n], A_r[n], gam_r[n], cfg)
            dVp_r[n] = dVp.astype(dt)
            return dSt_prev

        dS0_r[...] = lax.fori_loop(0, N, step, dST_r[...].astype(f32))

    return _call(kernel, cfg, grid=(BHV, nv), in_specs=in_specs, out_specs=out_specs,
                 out_shape=out_shape, name="kda_state_bwd", warps=cfg.warps_seq,
                 stages=cfg.stages_seq)(*args)


# ----------------------------------------------------------------------------- intra (bwd)


def intra_bwd(cfg: KdaConfig, q, k, v, G, beta, segs, W, U, Akk, Tinv, h, dh, Vp, dVp, dO,
              f=None, gate_params=(), *, dqk_dtype, dv_dtype, dg_dtype):
    """dq, dk (per value head) and dg [.., K], dv [.., V], dbeta [.., 1], all in the user layout,
    and a tuple: () or, with the gate in the kernel (f the gate logits in the user layout,
    gate_params = (A, dt_bias) [HV, 1, K]), the per-chunk column sums of d(dt_bias) and dA
    [B*HV, N, 1, K] float32; dg then holds df.

    Two kernels: ``intra_bwd_scores`` per chunk (grid (B*HV, N): dv, dbeta and the chunk's
    [C, C] dAqk, dAkk and their transposes, stored in cfg.cd since their only consumers are
    fast dots), then ``intra_bwd_channels`` per chunk and K slice: K/BK times as many
    programs, each holding one slice's tiles, so more of them fit on an SM.
    """
    dv, db, *dA = intra_bwd_scores(cfg, k, v, G, beta, segs, W, U, Akk, Tinv, h, Vp, dVp, dO,
                                   dv_dtype=dv_dtype)
    dq, dk, dg, *dgate = intra_bwd_channels(cfg, q, k, G, segs, dA, h, dh, Vp, dO, dv, f,
                                            gate_params, dqk_dtype=dqk_dtype, dg_dtype=dg_dtype)
    return dq, dk, dv, dg, db, tuple(dgate)


def intra_bwd_scores(cfg: KdaConfig, k, v, G, beta, segs, W, U, Akk, Tinv, h, Vp, dVp, dO, *,
                     dv_dtype):
    """Backward part 1, grid (B*HV, N): dv, dbeta (user layout) and dAqk, dAkk, dAqk^T, dAkk^T
    [B*HV, N, C, C] (cfg.cd); where cfg.bwd_rows' blocks take them, with each row's
    diagonal block scaled by a power of two, followed (``da_names``) by the powers of two that
    undo it, dAqk_down, ..., dAkkT_down [B*HV, N, C, 1] float32 (body.scale_diagonal_blocks).
    Akk and Tinv are the forward's (``intra_fwd(..., residuals=True)``), and so is G.

    The Mosaic GPU kernel (kda_mgpu_bwd) computes it where ``scores_mode`` says so."""
    mode = scores_mode(cfg, k, v, G, beta, dv_dtype)
    if mode is not None:
        return kda_mgpu_bwd.intra_bwd_scores(cfg, k, v, G, beta, segs, W, U, Akk, Tinv, h, Vp,
                                             dVp, dO, dv_dtype=dv_dtype,
                                             interpret=_mosaic_gpu_interpret(mode))
    BHV, N, C, K, V, HV = cfg.B * cfg.HV, cfg.N, cfg.C, cfg.K, cfg.V, cfg.HV
    sp = _chunk_specs(cfg)
    qk_head, v_head, chunk, per_chunk = sp.qk_head, sp.v_head, sp.chunk, sp.per_chunk
    segs = tuple(segs) if cfg.has_seg else ()
    in_specs = [
        _tok_spec(cfg, K, qk_head, chunk), _tok_spec(cfg, V, v_head, chunk),
        per_chunk(K), _tok_spec(cfg, 1, v_head, chunk), *sp.seg,
        per_chunk(K), per_chunk(V), per_chunk(C), per_chunk(C),
        pl.BlockSpec((None, None, V, K), lambda bh, n: (bh, n, 0, 0)),
        per_chunk(V), per_chunk(V), _tok_spec(cfg, V, v_head, chunk),
    ]
    n_down = len(da_names(cfg)) - len(DA_NAMES)
    out_specs = [_tok_spec(cfg, V, v_head, chunk), _tok_spec(cfg, 1, v_head, chunk),
                 *[per_chunk(C)] * 4, *[per_chunk(1)] * n_down]
    out_shape = [_tok_shape(cfg, HV, V, dv_dtype), _tok_shape(cfg, HV, 1, f32),
                 *[jax.ShapeDtypeStruct((BHV, N, C, C), cfg.dtype)] * 4,
                 *[jax.ShapeDtypeStruct((BHV, N, C, 1), f32)] * n_down]

    def scores_kernel(k_r, v_r, G_r, b_r, *refs):
        seg, rest = _take_seg(cfg, refs)
        W_r, U_r, Akk_r, Ti_r, h_r, Vp_r, dVp_r, dO_r, dv_r, db_r, *dA_r = rest
        ks, vs = _slicers(cfg)
        by_v = {"v": v_r, "U": U_r, "Vp": Vp_r, "dVp": dVp_r, "dO": dO_r}
        cc = {"Akk": Akk_r, "Tinv": Ti_r}
        put = _writer(ks, vs, by_k={}, by_v={"dv": dv_r},
                      whole={"dbeta": db_r, **dict(zip(da_names(cfg), dA_r, strict=True))})
        io = SimpleNamespace(
            qkg=lambda s: (None, k_r[:, ks(s)], None), G=lambda s: G_r[:, ks(s)],
            beta=b_r[...], seg=seg, put=put, W=lambda s: W_r[:, ks(s)],
            cc=lambda name: cc[name][...],
            vt=lambda name, t: by_v[name][:, vs(t)], st=lambda name, t, s: h_r[vs(t), ks(s)])
        body.bwd_intra_scores(io, cfg)

    return _call(
        scores_kernel, cfg, grid=(BHV, N), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, name="kda_intra_bwd_scores", warps=cfg.warps_grad,
        stages=cfg.stages_intra)(k, v, G, beta, *segs, W, U, Akk, Tinv, h, Vp, dVp, dO)


def intra_bwd_channels(cfg: KdaConfig, q, k, G, segs, dA, h, dh, Vp, dO, dv, f=None,
                       gate_params=(), *, dqk_dtype, dg_dtype):
    """Backward part 2, per chunk and K slice: dq, dk (per value head) and dg in the user layout.
    dA = (dAqk, dAkk, dAqk^T, dAkk^T[, and the four's scales]) (``da_names``) and dv from
    ``intra_bwd_scores`` for the same config. With the gate in the kernel (see ``intra_bwd``)
    dg holds df, followed by the d(dt_bias) and dA column sums. dv stands in for beta, Tinv and
    dV' (``kda_body.bwd_intra_channels`` says why).

    Grid (K/BK, B*HV, N) in the GPU layout: Pallas-Triton launches the first axis as CUDA's x,
    the index the GPU walks fastest, so the K/BK programs of one chunk run side by side and
    share the chunk's score gradients, dO, V' and dv through L2 instead of reading them from
    DRAM again. The TPU modes take (B*HV, N, K/BK): the TPU walks the last axis innermost."""
    names = da_names(cfg)
    if len(dA) != len(names):
        raise ValueError(f"intra_bwd_channels: dA must hold {names} (intra_bwd_scores' outputs "
                         f"for this config), got {len(dA)} arrays")
    BHV, N, C, K, V, HV = cfg.B * cfg.HV, cfg.N, cfg.C, cfg.K, cfg.V, cfg.HV
    nk = K // cfg.bk
    sp = _chunk_specs(cfg)
    qk_head, v_head, chunk, per_chunk = sp.qk_head, sp.v_head, sp.chunk, sp.per_chunk
    segs = tuple(segs) if cfg.has_seg else ()
    bk = cfg.bk
    slice_k = lambda bh, n, s: (n, s)
    state = pl.BlockSpec((None, None, V, bk), lambda bh, n, s: (bh, n, 0, s))
    in_specs = [
        _tok_spec(cfg, bk, qk_head, slice_k), _tok_spec(cfg, bk, qk_head, slice_k),
        pl.BlockSpec((None, None, C, bk), lambda bh, n, s: (bh, n, 0, s)), *sp.seg,
        *[per_chunk(C)] * 4, *[per_chunk(1)] * (len(names) - 4), state, state, per_chunk(V),
        _tok_spec(cfg, V, v_head, chunk), _tok_spec(cfg, V, v_head, chunk),
    ]
    out_specs = [_tok_spec(cfg, bk, v_head, slice_k)] * 3
    out_shape = [_tok_shape(cfg, HV, K, dqk_dtype), _tok_shape(cfg, HV, K, dqk_dtype),
                 _tok_shape(cfg, HV, K, dg_dtype)]
    gated = cfg.gate != "given"
    gate_args = (f, *gate_params) if gated else ()
    if gated:  # the logits' K slice, A and dt_bias in; per-chunk d(dt_bias), dA sums out
        in_specs += [_tok_spec(cfg, bk, v_head, slice_k),
                     *[_gate_param_spec(cfg, bk, lambda bh, n, s: s)] * 2]
        out_specs += [pl.BlockSpec((None, None, 1, bk), lambda bh, n, s: (bh, n, 0, s))] * 2
        out_shape += [jax.ShapeDtypeStruct((BHV, N, 1, K), f32)] * 2
    ch_cfg = dataclasses.replace(cfg, K=bk)  # one slice: the body's K loop has one step
    slice_first = not head_major(cfg)
    grid, n_axis = ((nk, BHV, N), 2) if slice_first else ((BHV, N, nk), 1)

    def channels_kernel(q_r, k_r, G_r, *refs):
        seg, rest = _take_seg(cfg, refs)
        *dA_r, h_r, dh_r, Vp_r, dO_r, dv_r = rest[:len(names) + 5]
        rest = rest[len(names) + 5:]
        f_r, *gate_r = rest[:3] if gated else (None,)
        dq_r, dk_r, dg_r, *dgate_r = rest[3:] if gated else rest
        _, vs = _slicers(cfg)
        by_v = {"Vp": Vp_r, "dO": dO_r, "dv": dv_r}
        dA = dict(zip(names, dA_r, strict=True))  # whole: the unbounded gate's diagonal,
        # and cfg.bwd_rows' blocks
        whole = {"dq": dq_r, "dk": dk_r, "dg": dg_r}
        if gated:
            whole.update(dbias=dgate_r[0], dA=dgate_r[1])
        put = _writer(None, vs, by_k={}, by_v={}, whole=whole)
        io = SimpleNamespace(
            f=lambda: f_r[...], gate_params=lambda s: tuple(r[...] for r in gate_r),
            qkg=lambda s: (q_r[...], k_r[...], None), G=lambda s: G_r[...],
            # anchor rows of G straight from memory; Mosaic takes the masked-reduction default
            G_row=None if head_major(cfg) else (lambda r: G_r[pl.ds(r, 1), :]),
            seg=seg, put=put,
            rows=lambda name, ib: dA[name][pl.ds(ib * cfg.sub, cfg.sub), :],
            cc=lambda name: dA[name][...], vt=lambda name, t: by_v[name][:, vs(t)],
            st=lambda name, t, s: (h_r if name == "St" else dh_r)[vs(t), :])
        body.bwd_intra_channels(io, pl.program_id(n_axis), 0, ch_cfg)

    if slice_first:  # grid (s, bh, n): the specs above take (bh, n, s)
        in_specs, out_specs = ([_regrid(spec, (1, 2, 0)) for spec in specs]
                               for specs in (in_specs, out_specs))
    return _call(
        channels_kernel, cfg, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, name="kda_intra_bwd_channels", warps=cfg.warps_chan,
        stages=cfg.stages_intra)(q, k, G, *segs, *dA, h, dh, Vp, dO, dv, *gate_args)
