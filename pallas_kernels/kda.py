"""KDA as Pallas kernels: forward and backward joined by ``jax.custom_vjp``.

Public entry points (``kimi_k3.ops.kda.kda(..., impl="pallas")`` calls the first):

    kda_pallas(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, lower_bound,
               interpret=None, backend=None, tuning=None, poison=False)
        -> (o [B, T, HV, V], final_state [B, HV, K, V] f32)
    pallas_supported(backend) -> bool
    KernelTuning, default_tuning(device_kind)     launch parameters, passed as ``tuning=``

Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; state
[B, HV, K, V] float32; HV a multiple of H. Per token, per value head:

    S <- Diag(exp g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T (scale q_t)

computed in chunks of C tokens (the WY form; pallas_kernels/kda_body.py has the equations).

Forward:  intra_fwd (parallel over chunks) -> state_fwd (sequential over chunks).
Backward: state_bwd (reverse, sequential) -> intra_bwd (parallel over chunks). The forward
saves the per-chunk states (O(T K V / C) memory, never O(T^2)) so the backward does not
replay the state pass, each chunk's cumulative gate G (instead of g) and its Akk and
(I + Diag(beta) Akk)^-1 (O(T C)); the decayed intra-chunk factors are recomputed.

Backends (``backend=``, default from ``interpret`` and ``jax.default_backend()``):
    "gpu"            Pallas-Triton, compiled.          "tpu"  Pallas-Mosaic, compiled.
    "interpret"      the GPU kernels in Pallas' interpret mode (any machine; the CPU default).
    "tpu_interpret"  the TPU kernels in TPU interpret mode (pltpu.InterpretParams) on CPU.

Gates: ``lower_bound`` in [-5, 0) promises g >= lower_bound and selects the factored
tensor-core path for the diagonal sub-blocks of the intra-chunk scores; None (or a bound below
-5) selects the safe path, exact for arbitrarily negative gates. With ``A_log`` and ``dt_bias``
the kernel takes the gate logits f for g and applies the gate itself (intra_fwd's prologue,
``kda_body.gate_from_logits``); the backward recomputes the gate's derivative from the saved f
and returns df, with dA_log and d dt_bias from per-chunk sums.

Tests: ``poison=True`` starts every kernel output as NaN. ``python -m
pallas_kernels.triton_report`` prints the GPU kernels' shared memory, registers and spills for
sm_90 without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import kda_calls as calls
from pallas_kernels.kda_body import (
    HOPPER_ALL,
    HOPPER_BWD_CHANNELS,
    HOPPER_BWD_SCORES,
    HOPPER_INTRA_FWD,
    HOPPER_STATE,
    MAX_FACTORED_EXPONENT,
    KdaConfig,
)

__all__ = ["kda_pallas", "pallas_supported", "make_config", "KernelTuning", "default_tuning",
           "HOPPER_INTRA_FWD", "HOPPER_BWD_SCORES", "HOPPER_BWD_CHANNELS", "HOPPER_STATE", "HOPPER_ALL"]

f32 = jnp.float32
MODES = ("gpu", "tpu", "interpret", "tpu_interpret")
SAFE_SUB = 16  # sub-chunk rows of the unbounded-gate path (its diagonal blocks cost ~SUB)

TARGET_PROGRAMS = 256  # programs the state passes aim for when KernelTuning.bv_seq is 0


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Launch parameters of the compiled GPU kernels (frozen and hashable, like the
    ``BlockSizes`` of JAX's Pallas GPU attention): ``kda_pallas(..., tuning=)``.

    The tiles (bv_seq, bv_intra, bk) also apply in interpret mode, so a tuning can be tested on
    CPU; the TPU modes choose their own tiles (Mosaic wants lane tiles of 128 or the whole
    dim), and warps and stages are Triton's only. Tiles larger than the padded K or V are cut
    to it. ``default_tuning`` gives the defaults for a device kind; ``parse`` reads the
    ``--tune`` flag of the command-line tools; ``dataclasses.replace`` makes variants.
    """

    # V tile of the state passes (state_fwd, state_bwd). 0: the widest tile that still gives
    # them TARGET_PROGRAMS programs; they are the sequential part, and at small batch finer V
    # tiles are the only parallelism left.
    bv_seq: int = 0
    # V tile of the loops inside the intra-chunk kernels (the launch sweep's winner).
    bv_intra: int = 128
    # K slice of the backward's intra-chunk kernels, and the third grid axis of
    # intra_bwd_channels. Wider slices spill registers in that kernel (python -m
    # pallas_kernels.triton_report --tune bk=64): on the H200 bk=64 took forward+backward from
    # 4.41 to 8.02 ms at 8 x 4096 (session aa).
    bk: int = 32
    # K slice of the forward's intra-chunk kernel (intra_fwd; both kernels with split_intra),
    # cut to the padded K. Its loop over slices runs the decayed scores' chain of dots once per
    # slice; at 64 it runs half as often. On the H200 (session aa) the forward took 1.08
    # against 1.21 ms at 8 x 4096 x 16 x 128, and 1.00 against 1.17-1.18 ms at
    # configs/small.py's 32 x 2048 x 12 x 64, where K = 64 is then one slice.
    bk_fwd: int = 64
    warps_intra: int = 4  # Triton warps of intra_fwd
    warps_seq: int = 4  # Triton warps of state_fwd and state_bwd
    warps_grad: int = 4  # Triton warps of intra_bwd_scores
    warps_chan: int = 4  # Triton warps of intra_bwd_channels
    stages_seq: int = 2  # Triton pipeline stages of state_fwd and state_bwd
    # Triton pipeline stages of the intra-chunk kernels. Software pipelining multiplies the
    # shared memory of their slice loops (3 stages overflowed the H200's 227 KB in the
    # backward), and they are not load-bound.
    stages_intra: int = 1
    # 1: three tf32 passes (float32 accuracy) for the triangular inverse; 0: one plain tf32
    # pass. The GPU tests pass with either, and the three passes make intra_fwd markedly
    # slower (BENCHMARKS.md).
    inverse_x3: int = 0
    # 1: intra_bwd_channels' reverse cumsum of dG (dg_i = sum_{r >= i} dG_r, a dot with the
    # triangle of ones) exact in float32 (tf32x3 on GPU, HIGHEST elsewhere); 0: with bf16
    # inputs, two bf16 passes, dG as hi + lo (the ones are exact in bf16): 16 bits of dG, which
    # already carries the bf16 error of the state dots that make it (dO S^T, V' dS^T, ...).
    # float32 inputs keep the exact form either way. On the H200 at configs/small.py's
    # 32 x 2048 x 12 x 64, forward+backward took 3.39 against 3.46 ms, and on an H100 at
    # 8 x 4096 x 16 x 128 4.66 against 4.74 (session ab); intra_bwd_channels' SASS for sm_90
    # (heads of 64) has 5048 instructions against 5328 and 232 against 268 bytes of spills.
    rcumsum_x3: int = 0
    # Which kernels run on Mosaic GPU (pallas_kernels/kda_mgpu.py, kda_mgpu_bwd.py,
    # kda_mgpu_state.py) instead of Triton, a sum of bits: HOPPER_INTRA_FWD (1),
    # HOPPER_BWD_SCORES (2), HOPPER_BWD_CHANNELS (4), HOPPER_STATE (8: both state passes);
    # HOPPER_ALL = 15.
    # Each applies where it can: backend "gpu" on a Hopper (sm_90) device, or "interpret"
    # (Mosaic GPU interpret mode), for the configs its unsupported_reason accepts; everything
    # else keeps the Triton kernels.
    # default_tuning turns on those measured faster on a Hopper card (BENCHMARKS.md).
    hopper: int = 0
    # 1: the forward's intra-chunk work as two kernels, the decayed scores (Aqk, Akk) and then
    # the inverse with W and U, handing Akk (float32) and beta k e^G (the dot operand it is
    # cast to anyway) through memory: the same arithmetic, each kernel with fewer live
    # registers and a shorter chain of dependent dots. 0: one kernel. Triton and TPU paths.
    # On the H200 at 8 x 4096 the two run even (BENCHMARKS.md, ninth pass); a scores kernel
    # with one program per sub-chunk of rows was 1.5x slower and is gone.
    split_intra: int = 0
    # 1: the one-kernel intra_fwd stores W's operand beta k e^G, computed in its scores loop,
    # into W's own output buffer and reads it back for W = Tinv (beta k e^G) after a barrier of
    # the program's threads; 0: it recomputes the operand per K slice after the inverse (a
    # second cumsum and exponential). The same bf16 operand either way, so the same results;
    # with 1, forward+backward was 0.1-0.25 ms faster at 8 x 4096 on the H200 (the forward
    # alone 0-0.2 ms; BENCHMARKS.md). GPU (Triton) and interpret modes; the TPU modes keep 0.
    w_in_place: int = 1
    # 1: with a bounded gate, the forward's decayed scores factor each diagonal block of rows
    # around the midpoint of G over the block instead of its first row: the exponents then
    # split between the row factor and the column factor (half a block of steps each), so a
    # block can be twice as tall for the same largest exponent, MAX_FACTORED_EXPONENT (32 rows
    # instead of 16 at lower_bound = -5). The diagonal blocks then take one dot, and the
    # blocks before each row's own (anchored at that block's first row, factors <= 1) one
    # more: half the scores loop's exponentials and dots. It applies where it makes the
    # blocks taller (-5 <= lower_bound < -80/63). 0: sub-chunks anchored at their first row.
    # On the H200 at 8 x 4096 the forward took 1.30 against 1.57 ms, forward+backward 5.22
    # against 5.47, and intra_fwd under ncu 1.11 against 1.34 (BENCHMARKS.md, session x). All
    # modes.
    anchor_mid: int = 1
    # 1: the backward's pairwise-decay sums (intra_bwd_channels, ``kda_body.pair_grads``) in
    # the same blocks as anchor_mid: the diagonal blocks around their midpoints, one dot per
    # sum over the whole chunk, with the rows of dA scaled to O(1) by powers of two (the outer
    # factor up to e^77.5 would otherwise bring back flushed products of small gradients); the
    # blocks before each block through its first row. 0: 16-row sub-chunks. Bounded gates,
    # all modes but the Mosaic GPU intra_bwd_channels (its own sub-chunks). The more accurate
    # of the two at the bound, and faster on the H200: forward+backward 4.61 against 4.91 ms
    # at 8 x 4096, 12.13 against 12.78 at 1 x 65536 (BENCHMARKS.md, session z).
    anchor_mid_bwd: int = 1
    # 1: intra_bwd_channels' grid puts the K slice first, which Pallas-Triton launches as CUDA's
    # x, the index the GPU walks fastest: the K/bk programs of one chunk then run side by side
    # and share the chunk's score gradients, dO, V' and dv through L2 (80 KB a chunk). 0: the
    # slice last (launched slowest): the programs of one chunk ran B*HV*N launches apart, and
    # each read those from DRAM again (at 8 x 4096 that repeat was ~2.2 GB, half of the
    # 4.5 GB Nsight Compute measured the kernel moving in session w). On the H200 at 8 x 4096
    # forward+backward took 4.91 against 5.26-5.27 ms (session z). GPU and interpret modes;
    # the TPU walks the grid last axis innermost, where the slice already is.
    slice_first: int = 1
    # The form of the Mosaic GPU state passes (HOPPER_STATE; kda_mgpu_state). 0: one
    # warpgroup per CTA of 64 V columns, two CTAs per SM, each step of the chain issuing all of
    # the chunk's products. The others take one CTA per SM with every input double-buffered.
    # 1: two warpgroups per 64 columns, the products that do not depend on the state (the
    # forward's output; the backward's Aqk^T dO and dO^T QG) on the second, so each step of the
    # chain is shorter. That is the time with few chains: at 1 x 65536 x 16 heads (32 CTAs)
    # the forward took 4.03 ms, against 1.30 for half the tokens at 8 x 4096 (session x).
    # 2: all 128 columns in one CTA (forward: two warpgroups as in 1; backward: one), each
    # chunk's W, QG, Kg and Aqk read once per value head instead of twice, ~30% less traffic.
    # That counts with many chains: at B*HV = 128 each pass moves ~1.5 GB, most of its
    # 0.38-0.39 ms at the card's bandwidth (session w). 3: chosen by the number of chains
    # (kda_mgpu_state.forms). On the H200 (session z): at 8 x 4096 form 2 took 1.20-1.21 /
    # 4.69-4.73 ms forward / forward+backward against form 0's 1.29 / 4.91; at 1 x 65536
    # form 1's forward 3.47 against 4.03 ms, but its backward ~1 ms longer than form 0's,
    # and form 2's forward 4.63. So 3 takes form 2 for many chains, and form 1's forward with
    # form 0's backward for few.
    mgpu_state: int = 3
    # (One dot over several sub-chunks at once, for intra_bwd_channels' pairwise-decay sums or
    # the forward's decayed scores, was much slower on the H200 at 8 x 4096 and is gone:
    # forward + backward 17.2 against 7.27 ms, the forward 3.8 against 2.2 ms.)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            allowed, ok = _TUNING_RULES[field.name]
            # bool is an int subclass: True would pass as 1 and hide a mistaken argument
            if type(value) is not int or not ok(value):
                raise ValueError(f"KernelTuning.{field.name} must be {allowed}, got {value!r}")

    @classmethod
    def parse(cls, spec: str, base: KernelTuning | None = None,
              source: str = "--tune") -> KernelTuning:
        """``base`` (default: ``default_tuning()``) with the overrides of ``spec``, a string
        "key=int,key=int" such as "bk=16,warps_grad=8" ("" gives ``base``). ``source`` names
        where the string came from in the ValueError raised for a bad item or value."""
        names = [field.name for field in dataclasses.fields(cls)]
        overrides = {}
        for item in filter(None, spec.split(",")):
            key, sep, val = item.partition("=")
            if not sep or key not in names or not val.lstrip("-").isdigit():
                raise ValueError(
                    f"{source}: expected key=int with key in {sorted(names)}, got {item!r}"
                )
            overrides[key] = int(val)
        try:
            return dataclasses.replace(default_tuning() if base is None else base, **overrides)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _power_of_two(x: int, lo: int) -> bool:
    return x >= lo and x & (x - 1) == 0


# KernelTuning field -> (what is allowed, check). Tiles are powers of two (the padded K and V
# are, and each must split into whole tiles) of at least 16 rows or columns (the least a dot
# takes); Triton takes a power of two of warps.
_TILE = ("a power of two >= 16", lambda x: _power_of_two(x, 16))
_WARPS = ("a power of two >= 1", lambda x: _power_of_two(x, 1))
_STAGES = ("an int >= 1", lambda x: x >= 1)
_TUNING_RULES = {
    "bv_seq": ("0 (automatic) or a power of two >= 16", lambda x: x == 0 or _power_of_two(x, 16)),
    "bv_intra": _TILE, "bk": _TILE, "bk_fwd": _TILE,
    "warps_intra": _WARPS, "warps_seq": _WARPS, "warps_grad": _WARPS, "warps_chan": _WARPS,
    "stages_seq": _STAGES, "stages_intra": _STAGES,
    "inverse_x3": ("0 or 1", lambda x: x in (0, 1)),
    "rcumsum_x3": ("0 or 1", lambda x: x in (0, 1)),
    "hopper": (f"a sum of HOPPER_* bits, 0 to {HOPPER_ALL}", lambda x: 0 <= x <= HOPPER_ALL),
    "split_intra": ("0 or 1", lambda x: x in (0, 1)),
    "w_in_place": ("0 or 1", lambda x: x in (0, 1)),
    "anchor_mid": ("0 or 1", lambda x: x in (0, 1)),
    "anchor_mid_bwd": ("0 or 1", lambda x: x in (0, 1)),
    "slice_first": ("0 or 1", lambda x: x in (0, 1)),
    "mgpu_state": ("0, 1, 2 or 3 (automatic)", lambda x: x in (0, 1, 2, 3)),
}


def default_tuning(device_kind: str | None = None) -> KernelTuning:
    """The launch parameters ``kda_pallas`` uses when it is given none, for a device kind
    (``jax.Device.device_kind``, e.g. "NVIDIA H200"; None: any device).

    The Triton parameters are one set for every kind: they were chosen on the H200 and no other
    card has been measured. A Hopper card (H100, H200, H800, H20, GH200) also runs the Mosaic GPU
    kernels that were faster there: intra_bwd_scores, 0.82 against Triton's 1.14 ms at
    8 x 4096 x 16 heads on the H200, and both state passes (kda_mgpu_state: the whole
    forward 1.98-2.01 against 2.12-2.18 ms, forward+backward 5.81-5.86 against 6.16-6.23 ms,
    same call); its Mosaic GPU intra_fwd and intra_bwd_channels were slower (3.7 against
    1.7 ms, 13.2 against 4.0 ms) and stay opt-in. This function is the one
    place a per-kind table goes; nothing else should look at the device kind.
    """
    if device_kind and _HOPPER_KIND.search(device_kind):
        return KernelTuning(hopper=HOPPER_BWD_SCORES | HOPPER_STATE)
    return KernelTuning()


# Hopper (sm_90) names in jax.Device.device_kind, e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3",
# "NVIDIA GH200 480GB". A wrong match costs nothing: off sm_90 the Triton kernels run anyway.
_HOPPER_KIND = re.compile(r"\bG?H(100|200|800|20)\b")


def _next_pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << (x - 1).bit_length())


def _resolve_mode(interpret, backend) -> str:
    if backend is not None:
        if backend not in MODES:
            raise ValueError(f"kda_pallas: backend must be one of {MODES}, got {backend!r}")
        return backend
    platform = jax.default_backend()
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
    """Rows of the forward's score blocks factored around their midpoint (``anchor_mid``): each
    factor's exponent reaches (rows - 1)*|lower_bound|/2, within MAX_FACTORED_EXPONENT. A
    bounded gate only (lower_bound >= -5, so at least 32 rows where the chunk has them)."""
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
    # the score blocks of the forward and the backward (KernelTuning.anchor_mid,
    # anchor_mid_bwd), where the midpoint makes them taller than the sub-chunks
    fwd_rows, fwd_mid, bwd_rows = sub, 0, 0
    if bounded and (rows := _mid_anchored_rows(lower_bound, C)) > sub:
        if tuning.anchor_mid:
            fwd_rows, fwd_mid = rows, 1
        if tuning.anchor_mid_bwd:  # the backward's pairwise-decay sums (0: sub-chunks)
            bwd_rows = rows
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
        bv_intra=bv_intra, bk=bk, bk_fwd=bk_fwd, inverse_x3=bool(tuning.inverse_x3),
        rcumsum_x3=bool(tuning.rcumsum_x3),
        warps_intra=tuning.warps_intra,
        warps_seq=tuning.warps_seq, warps_grad=tuning.warps_grad, warps_chan=tuning.warps_chan,
        stages_seq=tuning.stages_seq, stages_intra=tuning.stages_intra, poison=bool(poison),
        gate=("softplus" if lower_bound is None else "bounded") if gate_in_kernel else "given",
        gate_bound=float(lower_bound) if gate_in_kernel and lower_bound is not None else 0.0,
        hopper=tuning.hopper, split_intra=tuning.split_intra,
        w_in_place=tuning.w_in_place if mode in ("gpu", "interpret") else 0,
        fwd_rows=fwd_rows, fwd_mid=fwd_mid, bwd_rows=bwd_rows,
        slice_first=tuning.slice_first if mode in ("gpu", "interpret") else 0,
        mgpu_state=tuning.mgpu_state,
    )


def kda_pallas(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, lower_bound,
               interpret=None, backend=None, tuning: KernelTuning | None = None,
               poison: bool = False, A_log=None, dt_bias=None):
    """KDA with the Pallas kernels. Inputs are validated by ``kimi_k3.ops.kda.kda``.

    tuning: the launch parameters; None takes ``default_tuning`` for the default backend's
    device kind. poison: every kernel output starts as NaN (an aliased NaN-filled buffer), so an
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
        tuning = default_tuning(jax.devices()[0].device_kind)
    elif not isinstance(tuning, KernelTuning):
        raise TypeError(f"kda_pallas: tuning must be a KernelTuning or None, got {tuning!r}")
    gated = A_log is not None
    if gated != (dt_bias is not None):
        raise ValueError("kda_pallas: pass both A_log and dt_bias (the gate in the kernel) or "
                         "neither")
    cfg = make_config(q, v, scale=scale, segment_ids=segment_ids, chunk_size=chunk_size,
                      lower_bound=lower_bound, mode=mode, tuning=tuning, poison=poison,
                      gate_in_kernel=gated)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kda(q, k, v, g, beta, h0, seg, gate_params, cfg):
    """gate_params: () (g is the log-decay) or (A, dt_bias) [HV, 1, Kp] (g is the logits f)."""
    return _forward(q, k, v, g, beta, h0, seg, gate_params, cfg, residuals=False)[0]


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


# ----------------------------------------------------------------------------- support probe


def _probe_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = jnp.dot(x, x, preferred_element_type=f32)


@functools.cache
def pallas_supported(backend: str) -> bool:
    """Whether the compiled kernels can lower on ``backend`` ("gpu" / "tpu") with this JAX.

    Never raises: an unavailable lowering gives False and one warning line.
    """
    try:
        if backend == "gpu":
            if not calls.triton_available():
                raise ImportError("jax.experimental.pallas.triton has no CompilerParams")
            params = calls._compiler_params(_probe_cfg("gpu"), warps=4, stages=None, dims=())
        elif backend == "tpu":
            if not calls.mosaic_available():
                raise ImportError("jax.experimental.pallas.tpu has no CompilerParams")
            params = calls._compiler_params(_probe_cfg("tpu"), warps=4, stages=None,
                                            dims=("parallel",))
        else:
            raise ValueError(f"no compiled Pallas kernel for backend {backend!r}")
        platform = {"gpu": "cuda", "tpu": "tpu"}[backend]
        if backend == "gpu" and jax.default_backend() == "gpu":
            platform = jax.devices("gpu")[0].client.platform  # "cuda" or "rocm"
        fn = pl.pallas_call(_probe_kernel, out_shape=jax.ShapeDtypeStruct((16, 16), f32),
                            grid=(1,), compiler_params=params)
        jax.jit(fn).trace(jax.ShapeDtypeStruct((16, 16), f32)).lower(lowering_platforms=(platform,))
    except Exception as err:  # any failure means "not supported"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        warnings.warn(f"kda: Pallas lowering for {backend!r} unavailable ({first}); "
                      "falling back to impl='xla'", stacklevel=2)
        return False
    return True


def _probe_cfg(mode: str) -> KdaConfig:
    """The config of a one-chunk 16 x 16 call in ``mode``, default launch parameters."""
    x = jax.ShapeDtypeStruct((1, 16, 1, 16), f32)
    return make_config(x, x, scale=1.0, segment_ids=None, chunk_size=16, lower_bound=-5.0,
                       mode=mode, tuning=KernelTuning())
