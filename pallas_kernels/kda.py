"""KDA as Pallas kernels: forward and backward joined by ``jax.custom_vjp``.

Public entry points (``kimi_k3.ops.kda.kda(..., impl="pallas")`` calls the first):

    kda_pallas(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, lower_bound,
               interpret=None, backend=None, tuning=None, poison=False)
        -> (o [B, T, HV, V], final_state [B, HV, K, V] f32)
    KernelTuning (pallas_kernels.tuning)     launch parameters, passed as ``tuning=``

Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; state
[B, HV, K, V] float32; HV a multiple of H. Per token, per value head:

    S <- Diag(exp g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T (scale q_t)

computed in chunks of C tokens (the WY form; pallas_kernels/kda_body.py has the equations).

Forward:  intra_fwd (parallel over chunks) -> state_fwd (sequential over chunks).
Backward: state_bwd (reverse, sequential) -> intra_bwd (parallel over chunks). The forward
saves the per-chunk states (O(T K V / C) memory, never O(T^2)) so the backward does not
replay the state pass, each chunk's cumulative gate G (instead of g) and its Akk and
(I + Diag(beta) Akk)^-1 (O(T C)); the decayed intra-chunk factors are recomputed.

Backends (``backend=``, default from ``interpret`` and ``device.target_platform()``):
    "gpu"            Pallas-Triton, compiled.          "tpu"  Pallas-Mosaic, compiled.
    "interpret"      the GPU kernels in Pallas' interpret mode (any machine; the CPU default).
    "tpu_interpret"  the TPU kernels in TPU interpret mode (pltpu.InterpretParams) on CPU.
On a Hopper card (``pallas_kernels.device.probe``) intra_bwd_scores and both state passes run
their Mosaic GPU forms where they take the call (``KernelTuning.hopper``).

Gates: ``lower_bound`` in [-5, 0) promises g >= lower_bound and selects the factored
tensor-core path for the diagonal sub-blocks of the intra-chunk scores; None (or a bound below
-5) selects the safe path, exact for arbitrarily negative gates. Without a bound a gate of -inf
("forget everything") is exact as well: the forward takes every gate below
``kda_body.FORGET_GATE`` as that finite gate, which decays to exactly 0 too. With ``A_log`` and
``dt_bias`` the kernel takes the gate logits f for g and applies the gate itself (intra_fwd's
prologue, ``kda_body.gate_from_logits``); the backward recomputes the gate's derivative from the
saved f and returns df, with dA_log and d dt_bias from per-chunk sums.

Tests: ``poison=True`` starts every kernel output as NaN. ``python -m
pallas_kernels.triton_report`` prints the GPU kernels' shared memory, registers and spills for
sm_90 without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device
from pallas_kernels import kda_calls as calls
from pallas_kernels.kda_body import MAX_FACTORED_EXPONENT, KdaConfig
from pallas_kernels.tuning import TARGET_PROGRAMS, KernelTuning

__all__ = ["kda_pallas", "make_config", "KernelTuning"]

f32 = jnp.float32
MODES = ("gpu", "tpu", "interpret", "tpu_interpret")
SAFE_SUB = 16  # sub-chunk rows of the unbounded-gate path (its diagonal blocks cost ~SUB)


def _next_pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << (x - 1).bit_length())


def _resolve_mode(interpret, backend) -> str:
    if backend is not None:
        if backend not in MODES:
            raise ValueError(f"kda_pallas: backend must be one of {MODES}, got {backend!r}")
        return backend
    platform = device.target_platform()  # a TPU topology's mesh in context: "tpu"
    if interpret is None:
        interpret = platform not in ("gpu", "tpu")
    if interpret:
        return "interpret"
    if platform not in ("gpu", "tpu"):
        raise ValueError(f"kda_pallas: no compiled Pallas kernel for backend {platform!r}; "
                         "use interpret=True")
    return platform


def _sub_rows(lower_bound, C: int) -> tuple[bool, int]:
    """(bounded, sub-chunk rows). The factored diagonal block needs (sub-1)*|lower_bound| <=
    MAX_FACTORED_EXPONENT; for a bound below -5 (or none) the safe path is used."""
    if lower_bound is None or lower_bound < -5:
        return False, min(SAFE_SUB, C)
    sub = 16
    while 2 * sub <= C and (2 * sub - 1) * (-lower_bound) <= MAX_FACTORED_EXPONENT:
        sub *= 2
    return True, min(sub, C)


def _mid_anchored_rows(lower_bound, C: int) -> int:
    """Rows of the score blocks factored around their midpoint: each factor's exponent reaches
    (rows - 1)*|lower_bound|/2, within MAX_FACTORED_EXPONENT. A bounded gate only
    (lower_bound >= -5, so at least 32 rows where the chunk has them)."""
    rows = 32
    while 2 * rows <= C and (2 * rows - 1) * (-lower_bound) / 2 <= MAX_FACTORED_EXPONENT:
        rows *= 2
    return min(rows, C)


def make_config(q, v, *, scale, segment_ids, chunk_size, lower_bound, mode: str,
                tuning: KernelTuning, poison: bool = False,
                gate_in_kernel: bool = False) -> KdaConfig:
    """The static ``KdaConfig`` of one call.

    q [B, T, H, K] and v [B, T, HV, V] give the shapes and the compute dtype (arrays or
    ``jax.ShapeDtypeStruct``); lower_bound the gate path; mode one of MODES; tuning the launch
    parameters (GPU and interpret modes; the TPU modes pick their own tiles); poison: every
    kernel output starts as NaN; gate_in_kernel: g holds the gate logits, and the gate form
    follows lower_bound (None: softplus, a negative bound: bounded).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    C = max(16, chunk_size)  # dots need >= 16 rows; the result does not depend on C
    bounded, sub = _sub_rows(lower_bound, C)
    # The score blocks of the forward (``kda_body.decayed_scores``) and of the backward's
    # pairwise-decay sums (``kda_body.pair_grads``). Where the midpoint makes them taller than
    # the sub-chunks (a bounded gate, -5 <= lower_bound < -80/63), each diagonal block is
    # factored around the midpoint of G over it: the exponents split between the row and the
    # column factor, so a block is twice as tall for the same largest exponent (32 rows instead
    # of 16 at lower_bound = -5), the diagonal blocks take one dot, and the scores loop half
    # its exponentials and dots. The backward's sums take the same blocks, with dA's rows
    # scaled to O(1) by powers of two (``kda_body.scale_diagonal_blocks``); at the bound they
    # are also the more accurate form. Elsewhere: ``sub``-row sub-chunks anchored at their
    # first row.
    fwd_rows, fwd_mid, bwd_rows = sub, 0, 0
    if bounded and (rows := _mid_anchored_rows(lower_bound, C)) > sub:
        fwd_rows, fwd_mid, bwd_rows = rows, 1, rows
    cd = jnp.result_type(q.dtype, v.dtype)
    cd = "float32" if cd not in (jnp.bfloat16, jnp.float16) else jnp.dtype(cd).name
    Kp, Vp = _next_pow2(K), _next_pow2(V)
    platform = {"gpu": "gpu", "tpu": "tpu"}.get(mode, "cpu")
    if mode in ("tpu", "tpu_interpret"):
        # Mosaic: lane-dim tiles of 128 (or the whole dim)
        bv_seq = bv_intra = Vp if Vp <= 128 else 128
        bk = bk_fwd = Kp if Kp <= 128 else 128
    else:
        bv_seq = tuning.bv_seq or Vp
        while not tuning.bv_seq and bv_seq > 16 and B * HV * (Vp // bv_seq) < TARGET_PROGRAMS:
            bv_seq //= 2
        bv_seq, bv_intra = min(bv_seq, Vp), min(tuning.bv_intra, Vp)
        bk, bk_fwd = min(tuning.bk, Kp), min(tuning.bk_fwd, Kp)
    return KdaConfig(
        B=B, T=T, H=H, HV=HV, K=Kp, V=Vp, k_dim=K, v_dim=V, C=C, sub=sub, scale=float(scale), bounded=bounded,
        has_seg=segment_ids is not None, cd=cd, platform=platform, mode=mode, bv_seq=bv_seq,
        bv_intra=bv_intra, bk=bk, bk_fwd=bk_fwd, warps_intra=tuning.warps_intra,
        warps_seq=tuning.warps_seq, warps_grad=tuning.warps_grad, warps_chan=tuning.warps_chan,
        stages_seq=tuning.stages_seq, stages_intra=tuning.stages_intra, poison=bool(poison),
        gate=("softplus" if lower_bound is None else "bounded") if gate_in_kernel else "given",
        gate_bound=float(lower_bound) if gate_in_kernel and lower_bound is not None else 0.0,
        hopper=tuning.hopper, fwd_rows=fwd_rows, fwd_mid=fwd_mid, bwd_rows=bwd_rows,
        mgpu_state=tuning.mgpu_state, forget_gate=lower_bound is None,
    )


def kda_pallas(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, lower_bound,
               interpret=None, backend=None, tuning: KernelTuning | None = None,
               poison: bool = False, A_log=None, dt_bias=None):
    """KDA with the Pallas kernels. Inputs are validated by ``kimi_k3.ops.kda.kda``.

    tuning: the launch parameters; None takes ``KernelTuning()``, right for every card.
    ``tuning.hopper=1`` raises ValueError, naming why, where the Mosaic GPU kernels cannot run
    the call. poison: every kernel output starts as NaN (an aliased NaN-filled buffer), so an
    element a kernel never writes shows up as NaN downstream (tests, benchmarks/kda_stress.py).
    A_log [HV], dt_bias [HV, K] (or [HV * K]): the gate in the kernel. g is then the gate
    logits f [B, T, HV, K] and intra_fwd computes the log-decay (``kimi_k3.ops.gates``) in
    float32 from them: lower_bound * sigmoid(exp(A_log) (f + dt_bias)) with a lower_bound,
    -exp(A_log) softplus(f + dt_bias) without.

    Returns (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] float32). Differentiable in
    q, k, v, g, beta and initial_state (and A_log, dt_bias).
    """
    mode = _resolve_mode(interpret, backend)
    if tuning is None:
        tuning = KernelTuning()
    elif not isinstance(tuning, KernelTuning):
        raise TypeError(f"kda_pallas: tuning must be a KernelTuning or None, got {tuning!r}")
    gated = A_log is not None
    if gated != (dt_bias is not None):
        raise ValueError("kda_pallas: pass both A_log and dt_bias (the gate in the kernel) or "
                         "neither")
    cfg = make_config(q, v, scale=scale, segment_ids=segment_ids, chunk_size=chunk_size,
                      lower_bound=lower_bound, mode=mode, tuning=tuning, poison=poison,
                      gate_in_kernel=gated)
    if tuning.hopper == 1:
        # An explicit Mosaic GPU path is refused here, whole, rather than at the backward's
        # trace: the state passes read and write v's dtype, the scores kernel float32 G.
        calls.state_mode(cfg, v.dtype)
        calls.scores_mode(cfg, k, v, jax.ShapeDtypeStruct((), jnp.float32), beta, v.dtype)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if initial_state is None:
        initial_state = jnp.zeros((B, HV, K, V), f32)
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    gate_params = _gate_params(A_log, dt_bias, cfg) if gated else ()
    return _kda(q, k, v, g, beta, initial_state.astype(f32), seg, gate_params, cfg)


def _gate_params(A_log_HV, dt_bias, cfg: KdaConfig):
    """(A, dt_bias), each [HV, 1, Kp] float32, A = exp(A_log) repeated over the channels.

    The padded channels hold zeros, and JAX's transpose of the pad drops their cotangents, so
    A_log's gradient (through the repeat: a sum over channels) counts the real channels only.
    """
    HV, K = cfg.HV, cfg.k_dim
    A_HVxK = jnp.broadcast_to(jnp.exp(A_log_HV.astype(f32))[:, None], (HV, K))
    dt_bias_HVxK = dt_bias.astype(f32).reshape(HV, K)
    pad = [(0, 0), (0, cfg.K - K)]
    return tuple(jnp.pad(x, pad)[:, None, :] for x in (A_HVxK, dt_bias_HVxK))


# ----------------------------------------------------------------------------- layout glue


def _pad_tokens(x, cfg: KdaConfig, last: int):
    """[B, T, heads, X] -> padded to [B, N*C, heads, last], then into the kernel layout."""
    T, X = x.shape[1], x.shape[3]
    pad_t, pad_x = cfg.N * cfg.C - T, last - X
    if pad_t or pad_x:
        x = jnp.pad(x, [(0, 0), (0, pad_t), (0, 0), (0, pad_x)])
    return jnp.swapaxes(x, 1, 2) if calls.head_major(cfg) else x


def _unpad_tokens(x, cfg: KdaConfig, X: int):
    """Kernel layout -> [B, T, heads, X]."""
    if calls.head_major(cfg):
        x = jnp.swapaxes(x, 1, 2)
    return x[:, : cfg.T, :, :X]


def _state_to_kernel(S, cfg: KdaConfig):
    """[B, HV, K, V] -> transposed and padded [B*HV, Vp, Kp] float32."""
    B, HV, K, V = S.shape
    St = jnp.swapaxes(S.astype(f32), 2, 3)
    St = jnp.pad(St, [(0, 0), (0, 0), (0, cfg.V - V), (0, cfg.K - K)])
    return St.reshape(B * HV, cfg.V, cfg.K)


def _state_from_kernel(St, cfg: KdaConfig, K: int, V: int):
    St = St.reshape(cfg.B, cfg.HV, cfg.V, cfg.K)[:, :, :V, :K]
    return jnp.swapaxes(St, 2, 3)


def _segment_arrays(seg, cfg: KdaConfig):
    """a, lm, segc [B, N, C, 1] and segr [B, N, 1, C] (see kda_body) from ids [B, T]."""
    B, N, C = cfg.B, cfg.N, cfg.C
    seg = jnp.pad(seg, [(0, 0), (0, N * C - cfg.T)], mode="edge").reshape(B, N, C)
    # The state entering chunk n belongs to the segment of token n*C - 1 (row 0's for n = 0).
    prev = jnp.concatenate([seg[:, :1, 0], seg[:, :-1, -1]], axis=1)  # [B, N]
    a = (seg == prev[..., None]).astype(f32)
    lm = (seg == seg[:, :, -1:]).astype(f32)
    return a[..., None], lm[..., None], seg[..., None], seg[:, :, None, :]


def _prep(q, k, v, g, beta, seg, cfg: KdaConfig):
    qk = [_pad_tokens(x, cfg, cfg.K) for x in (q, k)]
    vv = _pad_tokens(v, cfg, cfg.V)
    gg = _pad_tokens(g, cfg, cfg.K)
    bb = _pad_tokens(beta[..., None], cfg, 1)
    segs = _segment_arrays(seg, cfg) if cfg.has_seg else ()
    return qk[0], qk[1], vv, gg, bb, segs


def _forward(q, k, v, g, beta, h0, seg, gate_params, cfg: KdaConfig, residuals: bool):
    K, V = q.shape[3], v.shape[3]
    qp, kp, vp, gp, bp, segs = _prep(q, k, v, g, beta, seg, cfg)
    W, U, QG, Kg, Aqk, gam, *wy = calls.intra_fwd(cfg, qp, kp, vp, gp, bp, segs, gate_params,
                                                  residuals=residuals)
    out = calls.state_fwd(cfg, W, U, QG, Kg, Aqk, gam, _state_to_kernel(h0, cfg),
                          out_dtype=v.dtype, residuals=residuals)
    o = _unpad_tokens(out[0], cfg, V)
    ST = _state_from_kernel(out[1], cfg, K, V)
    res = None
    if residuals:
        h, Vp = out[2:]
        # The backward reads the forward's G, not g; with the gate in the kernel it also needs
        # the logits f (the gate's derivative, recomputed from f in float32).
        g_saved = gp if cfg.gate != "given" else jnp.zeros((0,), g.dtype)
        res = (qp, kp, vp, g_saved, bp, segs, gate_params, W, U, QG, Kg, Aqk, gam, *wy, h, Vp)
    return (o, ST), res


# The forward alone, jitted (device.jit_per_choices): a model's KDA layers, which call it with
# the same shapes and configuration, lower its kernels once. Only an undifferentiated call runs
# it; a differentiated one takes _kda_fwd.
_forward_once = device.jit_per_choices(functools.partial(_forward, residuals=False),
                                       static_argnums=(8,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kda(q, k, v, g, beta, h0, seg, gate_params, cfg):
    """gate_params: () (g is the log-decay) or (A, dt_bias) [HV, 1, Kp] (g is the logits f)."""
    return _forward_once(q, k, v, g, beta, h0, seg, gate_params, cfg)[0]


def _kda_fwd(q, k, v, g, beta, h0, seg, gate_params, cfg):
    return _forward(q, k, v, g, beta, h0, seg, gate_params, cfg, residuals=True)


def _kda_bwd(cfg, residuals, cotangents):
    qp, kp, vp, gp, bp, segs, gate_params, W, U, QG, Kg, Aqk, gam, G, Akk, Tinv, h, Vp = residuals
    q_dt, k_dt, v_dt, g_dt, b_dt = (x.dtype for x in (qp, kp, vp, gp, bp))
    K, V = cfg.k_dim, cfg.v_dim
    do, dST = cotangents
    dop = _pad_tokens(do.astype(v_dt), cfg, cfg.V)
    dh, dVp, dS0t = calls.state_bwd(cfg, dop, W, QG, Kg, Aqk, gam, _state_to_kernel(dST, cfg))
    grouped = cfg.G > 1
    gated = cfg.gate != "given"
    dq, dk, dv, dg, db, dgate = calls.intra_bwd(
        cfg, qp, kp, vp, G, bp, segs, W, U, Akk, Tinv, h, dh, Vp, dVp, dop,
        gp if gated else None, gate_params,
        dqk_dtype=f32 if grouped or q_dt != k_dt else q_dt, dv_dtype=v_dt, dg_dtype=g_dt)
    # per-chunk column sums [B*HV, N, 1, Kp] (d dt_bias, dA) -> summed over rows and chunks
    # [HV, 1, Kp], in gate_params' order (A, dt_bias)
    d_gate_params = tuple(x.reshape(cfg.B, cfg.HV, cfg.N, 1, cfg.K).sum(axis=(0, 2))
                          for x in dgate[::-1])
    dq, dk = (_unpad_tokens(x, cfg, K) for x in (dq, dk))
    if grouped:  # q/k head h served value heads h*G .. h*G+G-1
        B, T = dq.shape[:2]
        dq, dk = (x.reshape(B, T, cfg.H, cfg.G, K).sum(axis=3) for x in (dq, dk))
    dv = _unpad_tokens(dv, cfg, V)
    dg = _unpad_tokens(dg, cfg, K)
    db = _unpad_tokens(db, cfg, 1)[..., 0]
    dh0 = _state_from_kernel(dS0t, cfg, K, V)
    return (dq.astype(q_dt), dk.astype(k_dt), dv.astype(v_dt), dg.astype(g_dt), db.astype(b_dt),
            dh0, None, d_gate_params)


_kda.defvjp(_kda_fwd, _kda_bwd)
