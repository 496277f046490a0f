"""Which implementation runs: the one place where "auto" is decided, for KDA and attention alike.

The contract, for every operator with an ``impl`` argument:

- an explicitly requested implementation runs, or raises an error saying why it cannot; it
  never silently becomes another;
- ``"auto"`` picks the fastest implementation that works for the backend (and, for attention,
  for the call's shapes and dtype), falling back to XLA's form where a compiled kernel is
  unavailable with the installed JAX (the log line says why);
- every choice is reported once per process (``logging.info``), so a run's log says what it
  used.

The backend, where a caller gives none, is the target platform (``device.target_platform``:
the platform of the mesh in context, else JAX's default backend), so a program traced under a
TPU topology's mesh on a CPU machine (``kimi_k3.aot``) takes the TPU's kernels.

KDA (``kimi_k3.ops.kda``): "recurrent" (the definition), "xla" (chunked, plain JAX), "pallas"
(the Pallas kernel; interpret mode on CPU). "auto": "pallas" on the backends in
``AUTO_PALLAS_BACKENDS`` when the kernel lowers there, else "xla".

Attention (``kimi_k3.layers.attention``): "reference", "xla" (blockwise), "cudnn", "pallas".
"auto": on GPU in bf16/fp16, cuDNN (packed documents through its packed layout on Hopper,
rows of one document each through its plain causal attention, with a mask as the fallback,
while that mask stays under ``CUDNN_MASK_BYTES``; else the
Pallas (Triton) kernel when T % 128 == 0); on TPU, splash
when T % 128 == 0; "xla" otherwise, and whenever the queries continue a cache (prefill,
decoding: q_offset != 0 or S != T).

Attention against a cache (``kimi_k3.layers.attention.cache_attention``, MLA's prefill and
decoding), where each block of keys also returns its log-sum-exp: "auto" is cuDNN on GPU in
bf16/fp16, splash on TPU when the piece is a multiple of 128 tokens, "xla" otherwise.

The projections' number format (``model.matmul_format``, ``layers/dense.py``): "bf16" (the
compute dtype) everywhere; "fp8" where :func:`fp8_error` finds none: a GPU with FP8 matrix
units, or the CPU (for tests). There is no "auto": FP8 is asked for by name.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import jax

from pallas_kernels import device

KDA_IMPLS = ("auto", "recurrent", "xla", "pallas")
EXPERT_MATMULS = ("auto", "ragged", "mosaic_gpu", "blocked", "dense")
ATTN_IMPLS = ("auto", "reference", "xla", "cudnn", "pallas")
CONV_IMPLS = ("auto", "xla", "pallas")  # the short convolutions
ATTN_RES_IMPLS = ("auto", "xla", "pallas")  # an Attention Residual read and its norm
MLP_IMPLS = ("auto", "xla", "pallas")  # the dense SwiGLU's activation backward
DECODE_ATTN_IMPLS = ("auto", "xla", "pallas")  # MLA decoding over the latent cache
KDA_STEP_IMPLS = ("xla", "pallas")  # a KDA layer's decoding step after its projections
MATMUL_FORMATS = ("bf16", "fp8")  # the projections' products (model.matmul_format)

# Backends on which KDA's "auto" takes the Pallas kernel (when it lowers there with this JAX):
# the GPU (Triton and, on Hopper, Mosaic GPU kernels) and the TPU (the same kernel source
# through Mosaic, tested in TPU interpret mode).
AUTO_PALLAS_BACKENDS: frozenset[str] = frozenset({"gpu", "tpu"})

# cuDNN takes packed documents only as a dense [B, 1, T, S] mask; above this many bytes of
# mask "auto" prefers the Pallas kernel, which reads segment ids instead.
CUDNN_MASK_BYTES = 1 << 30

@functools.cache
def _report(op: str, requested: str, chosen: str, why: str) -> None:
    """One log line per distinct choice in this process (the cache keeps it to one)."""
    logging.info("%s: impl=%r -> %r (%s)", op, requested, chosen, why)


def _chosen(op: str, requested: str, chosen: str, why: str) -> str:
    """``chosen``, reported (``_report``): every choose_* function returns through here."""
    _report(op, requested, chosen, why)
    return chosen


def _check_choice(requested: str, choices: tuple[str, ...], what: str) -> None:
    """The first step of every choose_* function: ``requested`` must be one of ``choices``;
    the error names ``what`` (e.g. "kda: impl")."""
    if requested not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {requested!r}")


def _half(dtype) -> bool:
    """A half-precision compute dtype (bf16 / fp16): what the GPU's matrix-unit kernels take."""
    return str(dtype) in ("bfloat16", "float16")


def kda_kernel_error(backend: str) -> str | None:
    """None when the Pallas KDA kernel can run on ``backend`` with the installed JAX (compiled
    on "gpu" / "tpu", interpreted on "cpu"), else why not (one line)."""
    family = {"gpu": "triton", "tpu": "mosaic_tpu"}.get(backend)
    return device.probe(backend).why_not(family) if family else None


def fp8_error(backend: str | None = None) -> str | None:
    """None when FP8 products (``model.matmul_format="fp8"``) run on ``backend`` (default: the
    target platform), else why not (one line). A GPU needs FP8 matrix units (``device.probe``:
    CUDA, sm_89 or later); the CPU runs them with XLA converting the FP8 operands (the same
    numbers, without the speed: for tests); TPUs are refused (the path is built and tested for
    NVIDIA's FP8 GEMMs; TPUs before v7 have no FP8 matrix units). Qwix, the quantisation
    library, must be installed."""
    if importlib.util.find_spec("qwix") is None:
        return "Qwix, its quantisation library, is not installed (pip install 'kimi_k3[fp8]')"
    backend = backend or device.target_platform()
    if backend == "cpu":
        return None
    if backend == "tpu":
        return ("FP8 products are built for NVIDIA GPUs with FP8 matrix units (sm_89+) and run "
                "on the CPU for tests; TPUs are not supported")
    return device.probe(backend).fp8_why_not()


def choose_conv_impl(requested: str, backend: str | None = None) -> str:
    """How the short convolutions run: "pallas" (forward and backward kernels,
    pallas_kernels/short_conv.py) or "xla" (the layer's float32 form with its own backward
    pass). "auto" takes the kernels on the GPU when this JAX still has Pallas-Triton, XLA
    elsewhere (off the GPU the kernels only run in interpret mode). XLA's fusions write the
    weight gradient as column reductions, which the kernels' one pass avoids."""
    return _kernels_on_the_gpu(requested, CONV_IMPLS, "conv", backend)


def choose_attn_res_impl(requested: str, backend: str | None = None) -> str:
    """How an unrolled stack's Attention Residual reads and the RMSNorms after them run:
    "pallas" (one kernel pass forward and one backward, pallas_kernels/depth_read.py) or "xla".
    "auto" takes the kernels on the GPU when this JAX still has Pallas-Triton, XLA elsewhere."""
    return _kernels_on_the_gpu(requested, ATTN_RES_IMPLS, "attn_res", backend)


def choose_mlp_impl(requested: str, backend: str | None = None) -> str:
    """How the dense SwiGLU's activation runs its backward pass: "pallas" (one kernel writing
    the gate's and up's gradients into the fused [B, T, 2, F] layout, pallas_kernels/swiglu.py)
    or "xla". "auto" takes the kernel on the GPU when this JAX still has Pallas-Triton, XLA
    elsewhere. Either way the layer keeps XLA's form for a width the kernel cannot tile or a
    mesh that splits the activations."""
    return _kernels_on_the_gpu(requested, MLP_IMPLS, "mlp", backend)


def _kernels_on_the_gpu(requested: str, choices, what: str, backend) -> str:
    """``requested`` checked against ``choices``; "auto" is "pallas" on the GPU when its
    Pallas-Triton kernels compile there (``device.probe``), "xla" elsewhere."""
    _check_choice(requested, choices, f"{what}: impl")
    if requested != "auto":
        return requested
    backend = backend or device.target_platform()
    return "pallas" if backend == "gpu" and device.probe(backend).triton else "xla"


def choose_kda_impl(requested: str, backend: str | None = None) -> str:
    """The KDA implementation to run for ``requested`` on ``backend`` (default: JAX's)."""
    _check_choice(requested, KDA_IMPLS, "kda: impl")
    backend = backend or device.target_platform()
    if requested == "pallas":
        error = kda_kernel_error(backend)
        if error:
            raise ValueError(f"kda: impl='pallas' cannot run here: {error}; use impl='auto' or "
                             f"'xla'")
        return _chosen("kda", requested, "pallas", backend)
    if requested != "auto":
        return _chosen("kda", requested, requested, backend)
    if backend in AUTO_PALLAS_BACKENDS:
        error = kda_kernel_error(backend)
        if error is None:
            return _chosen("kda", requested, "pallas", backend)
        return _chosen("kda", requested, "xla", f"{backend}: {error}")
    return _chosen("kda", requested, "xla", f"{backend}: the kernel only interprets here")


def choose_attention_impl(requested: str, *, dtype, T: int, S: int, packed: bool,
                          continues_cache: bool, batch: int = 1,
                          backend: str | None = None) -> str:
    """The attention implementation to run for ``requested`` with these queries: ``batch``
    rows of ``T`` queries against ``S`` keys, ``packed`` documents (segment ids given),
    ``continues_cache`` when the queries sit after a cache (q_offset != 0). Raises when an
    explicit kernel cannot take them.
    """
    mask_bytes = 3 * batch * T * S  # cuDNN's packed-document mask: bool, then a bf16 bias
    _check_choice(requested, ATTN_IMPLS, "attention: impl")
    backend = backend or device.target_platform()
    whole = not continues_cache and T == S
    if requested in ("cudnn", "pallas") and not whole:
        raise ValueError(f"attention: impl={requested!r} needs q_offset=0 and S == T (got T={T}, "
                         f"S={S}, continues a cache: {continues_cache}); use 'xla' or 'auto'")
    if requested == "cudnn" and backend != "gpu":
        raise ValueError(f"attention: impl='cudnn' needs a GPU, the backend is {backend!r}; use "
                         f"'auto' or 'xla'")
    if requested != "auto":
        return _chosen("attention", requested, requested, backend)
    chosen, why = "xla", f"{backend}, {dtype}"
    if not whole:
        why += ", continues a cache"
    elif backend == "gpu" and _half(dtype):
        if not packed:
            chosen = "cudnn"
        elif mask_bytes <= CUDNN_MASK_BYTES:
            chosen, why = "cudnn", why + ", packed documents (packed layout, mask fallback)"
        elif T % 128 == 0:
            chosen, why = "pallas", why + f", packed documents, a {mask_bytes >> 20} MiB mask"
        else:
            why += f", packed documents, T={T} not a multiple of 128"
    elif backend == "tpu" and T % 128 == 0:
        chosen = "pallas"
    return _chosen("attention", requested, chosen, why)


def attention_fallback(requested: str, chosen: str, err: Exception) -> None:
    """An "auto" kernel failed at trace time for these shapes: the caller falls back to "xla";
    an explicit request re-raises."""
    if requested != "auto":
        raise err
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    logging.warning("attention: %s kernel unavailable for these shapes (%s); using xla",
                    chosen, first)
    _report("attention", requested, "xla", f"{chosen} failed: {first[:80]}")


def cudnn_fused_attention():
    """JAX's cuDNN fused-attention module, whose entry point takes value heads narrower than
    key heads (cuDNN >= 9.10, Hopper: MLA's 128 vs 192, no padding) and returns the log-sum-exp
    in float32; None where this JAX lacks it (``device.probe("gpu").cudnn_lse``; jax.nn's public
    entry point casts the log-sum-exp to the output dtype, too coarse for merging blocks)."""
    if not device.probe("gpu").cudnn_lse:
        return None
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def choose_cache_attention_impl(requested: str, *, dtype, T: int,
                                backend: str | None = None) -> str:
    """The implementation of the blocks of ``cache_attention`` (pieces of ``T`` queries, each
    block of keys returning its log-sum-exp) for ``requested``. "cudnn" needs a GPU and
    :func:`cudnn_fused_attention` ("auto" takes "xla" on a GPU without it); "pallas"
    is splash (TPU, or interpreted on CPU) and needs T % 128 == 0; explicit requests run or
    raise."""
    _check_choice(requested, ATTN_IMPLS, "attention: impl")
    backend = backend or device.target_platform()
    if requested == "cudnn" and backend != "gpu":
        raise ValueError(f"attention: impl='cudnn' needs a GPU, the backend is {backend!r}; use "
                         f"'auto' or 'xla'")
    lse_entry = device.probe("gpu").cudnn_lse
    if requested == "cudnn" and not lse_entry:
        raise ValueError(f"attention: impl='cudnn' against a cache needs JAX's cuDNN entry point "
                         f"that returns the log-sum-exp in float32, absent in JAX "
                         f"{jax.__version__}; use 'auto' or 'xla'")
    if requested == "pallas" and (backend == "gpu" or T % 128):
        raise ValueError(f"attention: impl='pallas' against a cache is splash (TPU), which needs "
                         f"pieces of a multiple of 128 tokens; got T={T} on {backend!r}; use "
                         f"'auto', 'cudnn' (GPU) or 'xla'")
    if requested != "auto":
        return _chosen("cache attention", requested, requested, backend)
    chosen = "xla"
    if backend == "gpu" and _half(dtype) and lse_entry:
        chosen = "cudnn"
    elif backend == "tpu" and T % 128 == 0:
        chosen = "pallas"
    return _chosen("cache attention", requested, chosen, f"{backend}, {dtype}, pieces of {T}")


def blocked_why(backend: str, dims: tuple[int, int] = ()) -> str | None:
    """None when the blocked-layout kernels (``kimi_k3.ops.routed_experts``) run here: Triton on
    a GPU, interpret mode on a CPU; experts' D and F multiples of 16."""
    if backend == "gpu":
        why = device.probe(backend).why_not("triton")
        if why is not None:
            return why
    elif backend != "cpu":
        return f"the kernels are Pallas-Triton (GPU, or interpret mode on CPU), not {backend}"
    for name, size in zip(("d_model (moe.latent_dim where set)", "moe.expert_dim"), dims,
                          strict=False):
        if size % 16:
            return f"{name} = {size} (a multiple of 16)"
    return None


def choose_expert_matmul(requested: str, *, tokens_move: bool, dims: tuple[int, int] = (),
                         dtype=None, backend: str | None = None) -> str:
    """How dropless experts multiply (``layers/moe.py``): rows sorted by expert through
    ``kimi_k3.ops.grouped_matmul`` — "ragged" (``jax.lax.ragged_dot``) or "mosaic_gpu" (the
    Hopper kernels) —, "blocked" (``kimi_k3.ops.routed_experts``: Pallas-Triton kernels that
    gather their rows) or "dense" (every token through every local expert, weighted). ``dims``:
    the (D, F) of the experts, ``dtype`` their compute dtype, for "mosaic_gpu"'s shape rules.

    "auto": "blocked" on a GPU where Pallas-Triton lowers (moe_bench and routed_experts_bench
    measure it against the rest); else "mosaic_gpu" where ``device.probe`` finds a Hopper card
    and its kernels take the shapes and dtype; else "dense" on GPU, where XLA
    rewrites ``ragged_dot`` into a dense product with a far larger footprint (moe_bench), "ragged"
    elsewhere and whenever tokens move between devices (all-to-all expert parallelism, which
    "dense" cannot take)."""
    from kimi_k3.ops.grouped_matmul import mosaic_gpu_fits

    _check_choice(requested, EXPERT_MATMULS, "moe: expert_matmul")
    backend = backend or device.target_platform()
    if requested == "dense" and tokens_move:
        raise ValueError("moe: expert_matmul='dense' cannot run with all-to-all expert "
                         "parallelism (tokens move to their experts' devices); use 'ragged' or "
                         "'auto'")

    def mosaic_why() -> str | None:
        why = device.probe(backend).why_not("mosaic_gpu")
        if why is not None:
            return why
        D, F = dims
        return mosaic_gpu_fits(D, 2 * F, dtype) or mosaic_gpu_fits(F, D, dtype)

    if requested == "mosaic_gpu":
        why = mosaic_why()
        if why is not None:
            raise ValueError(f"moe: expert_matmul='mosaic_gpu' cannot run here: {why}")
    if requested == "blocked":
        why = blocked_why(backend, dims)
        if why is not None:
            raise ValueError(f"moe: expert_matmul='blocked' cannot run here: {why}")
    if requested != "auto":
        return _chosen("expert matmul", requested, requested, backend)
    if backend == "gpu" and blocked_why(backend, dims) is None:
        chosen = "blocked"
    elif dims and mosaic_why() is None:
        chosen = "mosaic_gpu"
    else:
        chosen = "dense" if backend == "gpu" and not tokens_move else "ragged"
    return _chosen("expert matmul", requested, chosen,
                   backend + (", all-to-all" if tokens_move else ""))


def choose_decode_attention_impl(requested: str, *, dtype, unsupported: str | None,
                                 backend: str | None = None) -> str:
    """How one decoding step reads MLA's latent cache (``attention.latent_decode_attention``):
    "pallas" (one kernel pass over the cache split over its positions,
    ``pallas_kernels.latent_decode``; interpret mode off the GPU) or "xla" (the scores, their
    softmax and the weighted sum as XLA fuses them). ``unsupported``: why the compiled kernel
    cannot take the layer's shapes (``latent_decode.unsupported``), None when it can.

    "auto": "pallas" on a GPU with Pallas-Triton for a bf16 / fp16 cache whose shapes the
    kernel takes (its dots run on the matrix units, exact for half-precision entries but not
    for float32 ones), "xla" otherwise. An explicit "pallas" on a GPU it cannot serve raises."""
    _check_choice(requested, DECODE_ATTN_IMPLS, "mla: decode_impl")
    backend = backend or device.target_platform()
    why = None
    if backend == "gpu":
        why = device.probe(backend).why_not("triton") or unsupported
    if requested == "pallas" and why is not None:
        raise ValueError(f"mla: decode_impl='pallas' cannot run here: {why}; use 'auto' or "
                         f"'xla'")
    if requested != "auto":
        return _chosen("decode attention", requested, requested, backend)
    chosen = "pallas" if backend == "gpu" and why is None and _half(dtype) else "xla"
    return _chosen("decode attention", requested, chosen, f"{backend}, {dtype}" + (
        f": {why}" if why and backend == "gpu" else ""))
