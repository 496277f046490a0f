"""The config room: every section's defaults, their checks, and the typed spec derived from them.

    configs/x.py (ml_collections.ConfigDict, command-line overrides)
        -> run_spec(config) / model_spec(config.model): checked once, here
        -> RunSpec / ModelSpec: frozen dataclasses, everything derived already resolved
        -> the trainer, the model, the layers and the FLOP count read the spec and trust it.

A config file builds its ConfigDict from :func:`default_model_config` and
:func:`add_training_defaults`, changes what it needs, and is loaded by path
(``kimi_k3.config_files.load_config`` or ``--config=configs/x.py[:arg]``). Every field, its
default and its unit are listed below; an error always names the field
(``config.model.kda.chunk_size: must be a positive power of two, got 48``).

What the spec resolves, so nothing downstream re-derives it: the layer pattern
("KKKM...KKKMM") and its scan plan (unrolled prefix + unit x repeats + tail; the prefix holds
the MoE model's dense-FFN first layers), the KDA and MLA head dimensions
(0 = derived from d_model), the KDA gate's bound (None for the softplus form), the KDA
implementation for the backend (``kimi_k3.dispatch``), the mixture of experts (``MoeSpec``, or
None for the dense FFN), the mesh's axis rules, the dtypes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections

from kimi_k3 import dispatch
from pallas_kernels import device
from pallas_kernels.tuning import KernelTuning

# Named choices of the model section.
GATES = ("bounded", "softplus")
ATTN_RES_MODES = ("none", "full", "block")
# How dropless expert parallelism sends tokens to their experts' devices (layers/moe.py).
EP_EXCHANGES = ("all_tokens", "ragged")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Values the layers name with ``jax.ad_checkpoint.checkpoint_name`` for "dots_kernels" to keep:
# KDA's q, k, v after their short convolutions (recomputing the convolutions and norms inside
# the backward pass costs more than it saves), and the Attention Residual reads' outputs and
# mixing weights (each read walks all its sources).
SAVED_NAMES = frozenset({"kda_qkv", "attn_res_read", "attn_res_weights"})


def _save_dots_and_kernels(prim, *avals, **params) -> bool:
    """Saves the outputs of matmuls and of kernels (the Pallas KDA kernel with the residuals
    its backward reads, cuDNN attention) and the values named in SAVED_NAMES; everything else
    elementwise is recomputed."""
    del avals
    if prim.name == "name":
        return params.get("name") in SAVED_NAMES
    return (prim.name in ("dot_general", "ragged_dot_general", "pallas_call")
            or "dot_product_attention" in prim.name)


REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,  # keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # keep each scanned unit's input only
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
    "dots_kernels": _save_dots_and_kernels,  # and kernel outputs: no matmul or kernel reruns
}
# ... and of the trainer's sections.
SOURCES = ("stdlib", "text", "tokens")
TOKEN_DTYPES = ("uint16", "uint32")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
NAN_POLICIES = ("stop", "skip")
STATE_DTYPES = ("float32", "bfloat16")  # opt.moments_dtype, train.grad_accum_dtype
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

# Weight decay is off for every vector (also when stacked over layers) and for parameters whose
# path matches one of these (case-insensitive regex): norm scales, biases, KDA's A_log and
# dt_bias, the Attention Residual pseudo-queries (mixer_query / mlp_query / final_query).
NO_DECAY = ("norm", "bias", "A_log", "dt_bias", "query")

# Data parallel over ("data", "fsdp", "expert"), parameters sharded over "fsdp" (ZeRO-3 style)
# along the model width, over "tensor" along heads / MLP / vocabulary (Megatron style), and the
# routed experts over "expert" (expert parallelism: the batch is split over that axis too, and
# tokens travel to their experts by all-to-all), and one sequence's tokens over "context"
# (context parallelism: KDA passes states between the shards, MLA gathers the latents; see
# kimi_k3/ops/kda_context.py). The model's logical names are listed in kimi_k3/sharding.py.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", "context"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("kv_lora", None),
    ("q_lora", None),
    ("rank", None),
    ("conv", None),
    ("norm", None),
    ("layers", None),
    ("expert", "expert"),
)


# ---------------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------------


def default_model_config() -> ml_collections.ConfigDict:
    """The model section with every field and its default (a CPU-sized K3-style stack)."""
    cfg = ml_collections.ConfigDict()
    cfg.vocab_size = 256  # tokens; 256 = bytes
    cfg.d_model = 128  # model width D
    cfg.num_layers = 4  # layers (each = mixer sublayer + MLP sublayer)
    cfg.kda_per_mla = 3  # r: r KDA layers then one MLA, repeating; 0 = all MLA
    cfg.final_mla = True  # force the last layer to be MLA
    cfg.pattern = ""  # explicit "K"/"M" string of length num_layers; overrides the two above
    cfg.num_heads = 4  # KDA query/key heads

    cfg.kda = ml_collections.ConfigDict()
    cfg.kda.head_dim = 32  # K = V per head; 0 = d_model // num_heads
    cfg.kda.num_v_heads = 0  # value heads HV, a multiple of num_heads; 0 = num_heads
    cfg.kda.conv_width = 4  # causal depthwise conv taps on q, k, v
    cfg.kda.gate = "bounded"  # "bounded" (K3) | "softplus" (Kimi Linear)
    cfg.kda.gate_lower_bound = -5.0  # g_min of the bounded gate (per-token log-decay floor)
    cfg.kda.chunk_size = 64  # tokens per chunk of the chunked KDA forms (power of two)
    cfg.kda.impl = "auto"  # "auto" | "recurrent" | "xla" | "pallas"
    # The decay gate inside the KDA op (the Pallas kernel's prologue: g never reaches memory)
    # instead of before it. Off by default: its training step has not been timed against the
    # gate outside (benchmarks/step_profile.py would).
    cfg.kda.gate_in_kernel = False
    # The short convolutions: "auto" (the kernels on the GPU, XLA elsewhere:
    # dispatch.choose_conv_impl), "xla" (the layer's float32 form, fused as XLA likes) or
    # "pallas" (forward and backward kernels, pallas_kernels/short_conv.py; interpret mode off
    # the GPU).
    cfg.kda.conv_impl = "auto"
    # A decoding step's work after the projections (convolutions, gates, the state update, the
    # output norm and gate): "xla" or "pallas" (one kernel per layer,
    # pallas_kernels/kda_decode.py; interpret mode off the GPU).
    cfg.kda.step_impl = "xla"
    # The Pallas KDA kernel's launch parameters over its defaults: "key=int,..." of
    # pallas_kernels.tuning.KernelTuning's fields; e.g. "hopper=0" runs the portable Triton
    # kernels on a Hopper card too, to compare a run with the Mosaic GPU path.
    cfg.kda.kernel_tuning = ""

    cfg.mla = ml_collections.ConfigDict()
    cfg.mla.num_heads = 4  # MLA heads H
    cfg.mla.q_lora_rank = 0  # low-rank query bottleneck; 0 = full-rank queries
    cfg.mla.kv_lora_rank = 64  # latent rank R (cached per token)
    cfg.mla.qk_nope_head_dim = 32  # per-head key/query dim from the latent; 0 = d_model // H
    cfg.mla.shared_head_dim = 16  # the shared key slice (cached), "rope dim" in DeepSeek terms
    cfg.mla.v_head_dim = 32  # per-head value dim; 0 = d_model // H
    cfg.mla.output_gate = True  # elementwise sigmoid gate per head before W_o
    cfg.mla.attn_impl = "auto"  # "auto" | "xla" | "cudnn" | "pallas" | "reference"
    cfg.mla.attn_block_size = 512  # query/key block of the blockwise "xla" attention
    cfg.mla.decode_impl = "auto"  # decoding's read of the latent cache: "auto" | "xla" | "pallas"

    cfg.mlp_dim = 384  # SwiGLU hidden width F (every layer's FFN, or the dense first layers of
    # a mixture of experts)

    # Mixture of experts (layers/moe.py): y = sum_chosen w_e SwiGLU_e(x) + SwiGLU_shared(x),
    # Kimi Linear's sigmoid router with a load-balancing bias; see MoeSpec below.
    cfg.moe = ml_collections.ConfigDict()
    cfg.moe.num_experts = 0  # routed experts E; 0 = no mixture: every FFN is the dense SwiGLU
    cfg.moe.top_k = 2  # routed experts per token
    cfg.moe.expert_dim = 128  # each expert's SwiGLU width (HF moe_intermediate_size)
    cfg.moe.num_shared = 1  # shared experts, used by every token; 0 = none
    cfg.moe.shared_dim = 0  # the shared SwiGLU's width; 0 = expert_dim * num_shared
    cfg.moe.renormalize = True  # divide the chosen weights by their sum (+1e-20)
    cfg.moe.routed_scaling_factor = 1.0  # multiplies the routed weights (Kimi Linear: 2.446)
    cfg.moe.n_group = 1  # expert groups for grouped routing; 1 = no groups
    cfg.moe.topk_group = 1  # groups a token may choose its experts from (<= n_group)
    cfg.moe.first_k_dense = 0  # the first k layers keep the dense SwiGLU of width mlp_dim
    cfg.moe.router_float32 = True  # router matmul and scores in float32 (else compute dtype)
    cfg.moe.bias_update_rate = 1e-3  # per optimizer step: b_e += rate * sign(mean_load -
    # load_e), the auxiliary-loss-free balancing (DeepSeek-V3); 0 = the bias stays at zero
    cfg.moe.balance_loss_coef = 0.0  # alpha of the sequence-wise balance loss; 0 = off
    cfg.moe.capacity_factor = 0.0  # 0 = dropless; c > 0: of a device's n tokens an expert takes
    # at most ceil(c * n * top_k / E), the rest of its assignments are dropped (fixed shapes)
    cfg.moe.expert_matmul = "auto"  # dropless experts: "ragged" (jax.lax.ragged_dot on rows
    # sorted by expert) | "mosaic_gpu" (the same rows through Hopper grouped-matmul kernels,
    # sm_90+, bf16, D and F multiples of 128) | "blocked" (Pallas-Triton kernels on a blocked
    # layout that gather their own rows: no [tokens x top_k, D] copies) | "dense" (every token
    # through every local expert, weighted by its routing weights, zero off its top-k: E / k x
    # the FLOPs, no sort) | "auto" (kimi_k3/dispatch.py)
    cfg.moe.remat_experts = False  # "blocked": keep only the experts' input for the backward
    # pass and compute their hidden activations again there (less memory, one more matmul)
    cfg.moe.latent_dim = 0  # 0 = off; l > 0: LatentMoE (Elango et al. 2026): the routed
    # experts run in a width l < d_model between a shared down- and up-projection (the router
    # and the shared expert stay at d_model)
    cfg.moe.ep_exchange = "all_tokens"  # how dropless expert parallelism moves tokens to the
    # devices of their experts: "all_tokens" (fixed shapes: each device sends every peer all its
    # tokens, the traffic of an all-gather) | "ragged" (jax.lax.ragged_all_to_all: each token
    # once to each device holding one of its experts, traffic as routed; receive buffers still
    # sized for the worst case)
    cfg.attn_res = "block"  # "none" | "full" | "block"
    cfg.attn_res_block_size = 4  # sublayers per block (a layer is 2 sublayers)
    # How each read and the RMSNorm after it run in an unrolled stack (scan_layers=False):
    # "auto" (one Pallas kernel pass each way on the GPU, XLA elsewhere:
    # dispatch.choose_attn_res_impl), "xla" or "pallas" (interpret mode off the GPU).
    cfg.attn_res_impl = "auto"
    # How the dense SwiGLU's activation runs its backward pass: "auto" (a Pallas kernel writing
    # the gate's and up's gradients into the fused layout on the GPU, XLA elsewhere:
    # dispatch.choose_mlp_impl), "xla" or "pallas" (interpret mode off the GPU).
    cfg.mlp_impl = "auto"
    cfg.tie_embeddings = True  # output head = embedding^T / sqrt(D)
    cfg.head_chunk = 1024  # tokens per row whose logits exist at once in the loss (token_nll)
    cfg.norm_eps = 1e-6
    cfg.dtype = "float32"  # compute dtype: "float32" | "bfloat16" | "float16"
    cfg.param_dtype = "float32"  # parameter storage dtype
    # The linear projections' products (KDA's q/k/v/o, MLA's, the SwiGLUs', the experts'):
    # "bf16" (in dtype) | "fp8" (e4m3 operands forward, e5m2 gradients backward, one scale per
    # tensor from its current maximum: layers/dense.py). Attention, the KDA op and its low-rank
    # gate projections, norms, the router and the output head stay in dtype / float32. "fp8"
    # runs on a GPU with FP8 matrix units (sm_89+: Ada, Hopper) and on the CPU (for tests).
    cfg.matmul_format = "bf16"
    cfg.remat = "none"  # "none" | "full" | "dots" | "dots_kernels": what each scanned unit
    # keeps for its backward pass (the rest is recomputed; see REMAT_POLICIES)
    cfg.scan_layers = True  # scan over the repeating unit of the pattern
    return cfg


def fill_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A whole run's config recorded by an earlier version (a run folder's ``config.json``) with
    every field added since at its default, so that the run resumes and evaluates as it ran:
    the training sections' fields and, where there is a model section, the model's. Fields the
    record has keep their values. Returns ``config``."""
    add_training_defaults(config)
    if "model" in config:
        with config.unlocked() if config.is_locked else contextlib.nullcontext():
            _fill_missing(config.model, default_model_config())
    return config


def _fill_missing(section: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict):
    for k, v in defaults.items():
        if k not in section:
            section[k] = v
        elif isinstance(v, ml_collections.ConfigDict) and isinstance(
                section[k], ml_collections.ConfigDict):
            _fill_missing(section[k], v)


def add_training_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds ``seed``, ``data``, ``opt``, ``mesh``, ``checkpoint`` and ``train`` with their
    defaults; a field the config already set keeps its value. Returns ``config``."""
    defaults = {
        "seed": 0,  # parameters' init and the data order
        "data": {
            "source": "stdlib",  # stdlib | text | tokens (see kimi_k3/data.py)
            "paths": "",  # comma-separated files / globs for text or tokens
            "eval_paths": "",  # held-out files; empty: split data by file with eval_fraction
            "eval_fraction": 0.05,  # share held out: by file (CRC32 of path) or the tokens' tail (data.py)
            "tokenizer": "",  # tokenizers JSON for text; "": bytes, ids 0..255; "none": no text
            "token_dtype": "uint16",  # uint16 | uint32, for token files
            "eos_id": -1,  # end-of-document id inside token files; -1: one document per file
            "seq_len": 256,  # T, tokens per row
            "global_batch_size": 16,  # B, rows per step over all hosts
            "shuffle": True,  # a new seeded row order every epoch
        },
        "opt": {
            "name": "adamw",  # adamw | muon
            "lr": 3e-3,  # peak learning rate
            "schedule": "cosine",  # cosine | wsd | constant, after the warmup
            "warmup_steps": 100,  # linear warmup from lr / warmup_steps
            "min_lr_ratio": 0.1,  # final lr = lr * min_lr_ratio
            "decay_fraction": 0.2,  # wsd: share of steps in the final linear decay
            "b1": 0.9,
            "b2": 0.95,
            "eps": 1e-8,
            "weight_decay": 0.1,  # decoupled, times lr
            "no_decay": NO_DECAY,  # regexes of parameter paths without weight decay
            "grad_clip": 1.0,  # global-norm clip; 0 = off
            "moments_dtype": "float32",  # float32 | bfloat16: the stored Adam / Muon moments
            # (the update is computed in float32 either way; bfloat16 halves their memory)
            "muon_beta": 0.95,  # Muon momentum
            "muon_ns_steps": 5,  # Newton-Schulz iterations
            "muon_rms": 0.2,  # Muon update RMS (matches AdamW's, so lr and decay carry over)
            "muon_adam_axes": ("vocab", "conv"),  # logical axes whose weights stay on AdamW
            "muon_batch_axes": ("layers", "expert"),  # stacked axes: per-slice Muon, not
            # counted in rank (one orthogonalisation per layer and per expert)
            "muon_exclude": (),  # further path regexes kept on AdamW
        },
        "mesh": {
            "data": -1,  # data-parallel size; -1 = all devices not used by the others
            "fsdp": 1,  # parameter-sharded data parallelism
            "expert": 1,  # expert parallelism: routed experts split over it (the batch too)
            "context": 1,  # context parallelism: each sequence's tokens split over it
            "tensor": 1,  # tensor parallelism
            "axis_rules": DEFAULT_RULES,  # (logical name, mesh axes | None)
        },
        "checkpoint": {
            "enabled": True,  # False: never save nor resume (benchmarks, throwaway runs)
            "every_steps": 200,  # save every N steps (and at the end, and on SIGTERM)
            "keep": 3,  # keep the last K
            "async_save": True,  # write in the background while training goes on
            "dir": "",  # default <workdir>/checkpoints
        },
        "train": {
            "steps": 1000,  # total optimizer steps
            "microbatch_size": 0,  # rows per forward/backward pass (all data-parallel devices
            # together); the global batch is their gradient sum. 0 = the largest that fits in
            # device memory (kimi_k3.plan's estimate), or the whole batch where memory is unknown
            "log_every": 10,  # steps between console / JSONL / TensorBoard reports
            "eval_every": 200,  # steps between held-out evaluations; 0 = only at the end
            "eval_batches": 4,  # global batches per evaluation
            "internals_every": -1,  # steps between internals reports (kimi_k3/internals.py:
            # per-layer KDA timescales, MLA reach, Attention Residual weights, expert load on
            # held-out rows); -1 = at each held-out evaluation, 0 = off
            "nan_policy": "stop",  # stop | skip, on a non-finite loss or gradient
            "progress_bar": True,  # shown only when stderr is a terminal
            "tensorboard": True,
            "peak_tflops_per_device": 0.0,  # for MFU; 0 = look up the device kind
            "grad_accum_dtype": "float32",  # float32 | bfloat16: with micro-batches, each
            # micro-batch's gradient and their running sum (bfloat16: taken with respect to the
            # weights rounded to the compute dtype; the float32 master weights stay)
            "memory_check": True,  # refuse, before compiling, a step the planner (kimi_k3.plan)
            # says cannot fit the device, naming what would fit; False: try anyway
        },
    }

    def fill(cd, d):
        for k, v in d.items():
            if isinstance(v, dict):
                if k not in cd:
                    cd[k] = ml_collections.ConfigDict()
                fill(cd[k], v)
            elif k not in cd:
                cd[k] = v

    with config.unlocked() if config.is_locked else contextlib.nullcontext():
        fill(config, defaults)
    return config


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KdaSpec:
    """A KDA layer: H query/key heads of dim K, HV = G * H value heads of dim V = K."""

    num_heads: int  # H
    head_dim: int  # K = V
    num_v_heads: int  # HV
    conv_width: int  # ShortConv taps
    gate: str  # "bounded" | "softplus"
    lower_bound: float | None  # the bounded gate's g_min; None for the softplus form
    chunk_size: int  # tokens per chunk of the chunked forms
    impl: str  # "recurrent" | "xla" | "pallas": "auto" already resolved for the backend
    gate_in_kernel: bool = False  # the decay gate computed inside the KDA op
    conv_impl: str = "xla"  # the short convolutions: "xla" | "pallas" (resolved)
    step_impl: str = "xla"  # a decoding step after the projections: "xla" | "pallas"
    # the Pallas kernel's launch parameters: KernelTuning() with model.kda.kernel_tuning's
    # overrides, parsed once here
    kernel_tuning: KernelTuning = dataclasses.field(default_factory=KernelTuning)
    norm_eps: float = 1e-6  # the output RMSNorm's epsilon: model.norm_eps (Kimi Linear's
    # rms_norm_eps reaches this norm too)


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """A Gated MLA layer: H heads, latent rank R, head dims dn (+ ds shared) / dv."""

    num_heads: int  # H
    q_lora_rank: int  # 0 = full-rank queries
    kv_lora_rank: int  # R
    qk_nope_head_dim: int  # dn
    shared_head_dim: int  # ds
    v_head_dim: int  # dv
    output_gate: bool
    attn_impl: str  # as requested; "auto" is decided per call (it depends on the shapes)
    attn_block_size: int
    decode_impl: str = "auto"  # as requested; "auto" is decided per call (dispatch)


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts FFN (layers/moe.py) of every layer after the first
    ``first_k_dense``."""

    num_experts: int  # E >= 1
    top_k: int  # k <= E
    expert_dim: int  # each routed expert's SwiGLU width
    num_shared: int  # shared experts (0 = none)
    shared_dim: int  # the shared SwiGLU's width, resolved (0 only when num_shared == 0)
    renormalize: bool
    routed_scaling_factor: float
    n_group: int  # divides E
    topk_group: int  # <= n_group
    first_k_dense: int  # < num_layers
    router_float32: bool
    bias_update_rate: float  # >= 0, per optimizer step
    balance_loss_coef: float  # >= 0
    capacity_factor: float  # 0 = dropless
    expert_matmul: str = "auto"  # "auto" | "ragged" | "mosaic_gpu" | "blocked" | "dense": how
    # dropless experts multiply
    remat_experts: bool = False  # "blocked": the hidden activations computed again backward
    latent_dim: int = 0  # 0 = off; else the routed experts' width l in [1, d_model)
    ep_exchange: str = "all_tokens"  # "all_tokens" | "ragged": dropless expert parallelism's
    # exchange of tokens (EP_EXCHANGES)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``config.model``, checked, with everything derived resolved."""

    vocab_size: int
    d_model: int
    num_layers: int
    pattern: str  # one letter per layer: "K" = KDA, "M" = Gated MLA
    # pattern == scan_prefix + scan_unit * scan_repeats + scan_tail; the prefix (unrolled) holds
    # a mixture of experts' dense-FFN first layers, so every scanned layer has the same FFN.
    scan_prefix: str
    scan_unit: str
    scan_repeats: int
    scan_tail: str
    kda: KdaSpec
    mla: MlaSpec
    mlp_dim: int
    moe: MoeSpec | None  # None: every layer's FFN is the dense SwiGLU of width mlp_dim
    attn_res: str
    attn_res_block_size: int
    tie_embeddings: bool
    head_chunk: int
    norm_eps: float
    dtype: str
    param_dtype: str
    remat: str
    scan_layers: bool
    attn_res_impl: str = "xla"  # "xla" | "pallas" (resolved)
    mlp_impl: str = "xla"  # the dense SwiGLU's backward: "xla" | "pallas" (resolved)
    matmul_format: str = "bf16"  # the projections' products: "bf16" | "fp8" (checked here)

    @property
    def fp8(self) -> bool:
        """The projections multiply in FP8 (``matmul_format == "fp8"``)."""
        return self.matmul_format == "fp8"

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def storage_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def remat_policy(self):
        return REMAT_POLICIES[self.remat]


@dataclasses.dataclass(frozen=True)
class DataSpec:
    source: str
    paths: tuple[str, ...]
    eval_paths: tuple[str, ...]
    eval_fraction: float
    tokenizer: str
    token_dtype: str
    eos_id: int
    seq_len: int
    global_batch_size: int
    shuffle: bool


@dataclasses.dataclass(frozen=True)
class OptSpec:
    name: str
    lr: float
    schedule: str
    warmup_steps: int
    min_lr_ratio: float
    decay_fraction: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    no_decay: tuple[str, ...]
    grad_clip: float
    muon_beta: float
    muon_ns_steps: int
    muon_rms: float
    muon_adam_axes: tuple[str, ...]
    muon_batch_axes: tuple[str, ...]
    muon_exclude: tuple[str, ...]
    moments_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    data: int  # -1 = the devices the other axes leave
    fsdp: int
    expert: int
    context: int  # devices one sequence's tokens are split over
    tensor: int
    axis_rules: tuple  # ((logical name, mesh axis | (mesh axes) | None), ...), normalised


@dataclasses.dataclass(frozen=True)
class CkptSpec:
    enabled: bool
    every_steps: int
    keep: int
    async_save: bool
    dir: str


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    steps: int
    microbatch_size: int  # 0 = chosen when the step is built (train_lib.build)
    log_every: int
    eval_every: int
    eval_batches: int
    nan_policy: str
    progress_bar: bool
    tensorboard: bool
    peak_tflops_per_device: float
    memory_check: bool = True
    grad_accum_dtype: str = "float32"
    internals_every: int = -1  # -1: at each evaluation (eval_every), 0: never


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A whole training run's config, checked."""

    model: ModelSpec | None  # None only for runs that bring their own model (stand-ins)
    data: DataSpec
    opt: OptSpec
    mesh: MeshSpec
    checkpoint: CkptSpec
    train: TrainSpec
    seed: int


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class ConfigError(ValueError):
    """A config field out of range, or fields that do not fit together: the message names the
    field (``config.<section>.<field>``, as ``--config.`` overrides name it), the value given and
    what is allowed. The entry points print it as one line and exit with code 2."""


class _Fields:
    """Reads one section's fields, raising ConfigError naming ``<prefix><field>``."""

    def __init__(self, section, prefix: str):
        self.section, self.prefix = section, prefix

    def fail(self, field: str, got, allowed: str):
        raise ConfigError(f"{self.prefix}{field}: {got!r} {allowed}")

    def get(self, field: str, ok: Callable[[object], bool], allowed: str):
        value = getattr(self.section, field)
        if not ok(value):
            self.fail(field, value, allowed)
        return value

    def int(self, field: str, lo: int | None = None, allowed: str | None = None) -> int:
        ok = lambda v: _is_int(v) and (lo is None or v >= lo)
        default = ("must be a positive integer" if lo == 1 else
                   f"must be an integer >= {lo}" if lo is not None else "must be an integer")
        return self.get(field, ok, allowed or default)

    def number(self, field: str, lo: float | None = None, hi: float | None = None,
               allowed: str | None = None) -> float:
        ok = lambda v: _is_number(v) and (lo is None or v >= lo) and (hi is None or v <= hi)
        if allowed is None:
            allowed = (f"must be in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else
                       f"must be >= {lo:g}" if lo is not None else "must be a finite number")
        value = getattr(self.section, field)
        if isinstance(value, int | float) and not isinstance(value, bool) \
                and not math.isfinite(value):  # "inf must be >= 0" would puzzle
            bounds = (f" in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else
                      f" >= {lo:g}" if lo is not None else "")
            self.fail(field, value, f"is not a finite number; allowed: a finite number{bounds}")
        return float(self.get(field, ok, allowed))

    def bool(self, field: str) -> bool:
        return self.get(field, lambda v: isinstance(v, bool), "must be True or False")

    def choice(self, field: str, choices) -> str:
        return self.get(field, lambda v: v in choices, f"is not one of {tuple(choices)}")

    def strings(self, field: str) -> tuple[str, ...]:
        value = getattr(self.section, field)
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        if isinstance(value, list | tuple) and all(isinstance(x, str) for x in value):
            return tuple(value)
        self.fail(field, value, "must be a comma-separated string or a list of strings")
        return ()


def layer_pattern(cfg) -> str:
    """The stack as a string, one letter per layer: "K" = KDA, "M" = Gated MLA (from
    ``config.model``; an explicit ``pattern`` wins). K3 (93 layers, r = 3, final_mla):
    "KKKM" * 23 + "M", MLA at layers 4, 8, ..., 92, 93."""
    f = _Fields(cfg, "config.model.")
    L = f.int("num_layers", 1)
    r = f.int("kda_per_mla", 0, "must be an integer >= 0 (0 = all MLA)")
    pattern = f.get("pattern", lambda v: isinstance(v, str), "must be a string of 'K' and 'M'")
    if pattern:
        bad = sorted(set(pattern) - {"K", "M"})
        if bad:
            f.fail("pattern", pattern, f"may only contain 'K' (KDA) and 'M' (MLA), found {bad}")
        if len(pattern) != L:
            f.fail("pattern", pattern, f"must have num_layers={L} letters")
        return pattern
    unit = "K" * r + "M"
    pattern = (unit * (L // len(unit) + 1))[:L]
    if f.bool("final_mla"):
        pattern = pattern[:-1] + "M"
    return pattern


def scan_plan(pattern: str, scan_layers: bool = True) -> tuple[str, int, str]:
    """(unit, repeats, tail) with pattern == unit * repeats + tail, compiling the fewest layers.

    "KKKM" * 23 + "M" -> ("KKKM", 23, "M"). Without scanning, or when nothing repeats, the whole
    pattern is the unrolled tail.
    """
    best = ("", 0, pattern)
    if not scan_layers:
        return best
    best_cost = len(pattern)
    for p in range(1, len(pattern) // 2 + 1):
        unit = pattern[:p]
        n = 1
        while pattern.startswith(unit * (n + 1)):
            n += 1
        cost = p + len(pattern) - n * p
        if n >= 2 and cost < best_cost:
            best, best_cost = (unit, n, pattern[n * p:]), cost
    return best


def _kda_spec(cfg, d_model: int, backend: str | None, norm_eps: float = 1e-6) -> KdaSpec:
    f, k = _Fields(cfg.kda, "config.model.kda."), cfg.kda
    H = _Fields(cfg, "config.model.").int("num_heads", 1)
    head_dim = f.int("head_dim", 0, "must be an integer >= 0 (0 = d_model // num_heads)")
    if head_dim == 0 and d_model % H:
        _Fields(cfg, "config.model.").fail(
            "num_heads", H, f"must divide d_model={d_model} when kda.head_dim=0 derives the head dim")
    HV = f.int("num_v_heads", 0, "must be an integer >= 0 (0 = num_heads)") or H
    if HV % H:
        f.fail("num_v_heads", k.num_v_heads, f"must be a multiple of num_heads={H}")
    gate = f.choice("gate", GATES)
    bound = f.number("gate_lower_bound", allowed="must be a finite number < 0")
    if bound >= 0:
        f.fail("gate_lower_bound", k.gate_lower_bound, "must be a finite number < 0")
    chunk = f.get("chunk_size", lambda v: _is_int(v) and v > 0 and v & (v - 1) == 0,
                  "must be a positive power of two")
    impl = f.choice("impl", dispatch.KDA_IMPLS)
    step_impl = f.choice("step_impl", dispatch.KDA_STEP_IMPLS) if "step_impl" in k else "xla"
    if step_impl == "pallas" and (backend or device.target_platform()) == "gpu":
        from pallas_kernels import kda_decode  # Pallas only for a config that asks for it

        K = head_dim or d_model // H  # the value heads' dim too
        if why := kda_decode.unsupported(K, K):
            f.fail("step_impl", step_impl,
                   f"cannot take this model on the GPU: {why}; use \"xla\"")
    return KdaSpec(num_heads=H, head_dim=head_dim or d_model // H, num_v_heads=HV,
                   conv_width=f.int("conv_width", 1), gate=gate,
                   lower_bound=bound if gate == "bounded" else None, chunk_size=chunk,
                   impl=dispatch.choose_kda_impl(impl, backend),
                   gate_in_kernel=f.bool("gate_in_kernel"),
                   conv_impl=dispatch.choose_conv_impl(f.choice("conv_impl", dispatch.CONV_IMPLS),
                                                       backend),
                   step_impl=step_impl,
                   kernel_tuning=_kernel_tuning(f),
                   norm_eps=norm_eps)


def _kernel_tuning(f: _Fields) -> KernelTuning:
    """model.kda.kernel_tuning ("key=int,...") parsed into the kernel's launch parameters now:
    a bad key or value is named before anything runs."""
    spec = f.get("kernel_tuning", lambda v: isinstance(v, str),
                 'must be a string "key=int,..." of pallas_kernels.tuning.KernelTuning fields')
    return KernelTuning.parse(spec, source=f"{f.prefix}kernel_tuning")


def _mla_spec(cfg, d_model: int) -> MlaSpec:
    f = _Fields(cfg.mla, "config.model.mla.")
    H = f.int("num_heads", 1)
    dims = {}
    for field in ("qk_nope_head_dim", "v_head_dim"):
        dims[field] = f.int(field, 0, "must be an integer >= 0 (0 = d_model // mla.num_heads)")
        if dims[field] == 0 and d_model % H:
            f.fail("num_heads", H, f"must divide d_model={d_model} when mla.{field}=0 derives "
                                   f"the head dim")
    block = f.get("attn_block_size", lambda v: _is_int(v) and v > 0 and v % 8 == 0,
                  "must be a positive multiple of 8")
    return MlaSpec(
        num_heads=H, q_lora_rank=f.int("q_lora_rank", 0, "must be an integer >= 0 (0 = no "
                                                            "low-rank queries)"),
        kv_lora_rank=f.int("kv_lora_rank", 1),
        qk_nope_head_dim=dims["qk_nope_head_dim"] or d_model // H,
        shared_head_dim=f.int("shared_head_dim", 0), v_head_dim=dims["v_head_dim"] or d_model // H,
        output_gate=f.bool("output_gate"), attn_impl=f.choice("attn_impl", dispatch.ATTN_IMPLS),
        attn_block_size=block,
        # absent from a model section written before decoding had its own kernel: "auto"
        decode_impl=(f.choice("decode_impl", dispatch.DECODE_ATTN_IMPLS)
                     if "decode_impl" in cfg.mla else "auto"))


def _moe_spec(cfg, num_layers: int, d_model: int) -> MoeSpec | None:
    """``config.model.moe`` checked; None when ``num_experts`` is 0 (the dense FFN)."""
    if "moe" not in cfg:  # a model section written before the mixture of experts existed
        return None
    f = _Fields(cfg.moe, "config.model.moe.")
    E = f.int("num_experts", 0, "must be an integer >= 0 (0 = dense FFN, no experts)")
    if E == 0:
        return None
    top_k = f.int("top_k", 1)
    if top_k > E:
        f.fail("top_k", top_k, f"must be in [1, num_experts={E}]")
    num_shared = f.int("num_shared", 0, "must be an integer >= 0 (0 = no shared expert)")
    expert_dim = f.int("expert_dim", 1)
    shared_dim = f.int("shared_dim", 0, "must be an integer >= 0 (0 = expert_dim * num_shared)")
    n_group = f.int("n_group", 1)
    if E % n_group:
        f.fail("n_group", n_group, f"must divide num_experts={E}")
    if n_group > 1 and E // n_group < 2:
        f.fail("n_group", n_group, f"leaves fewer than 2 experts per group (num_experts={E}); "
                                   f"a group is scored by its top two")
    topk_group = f.int("topk_group", 1)
    if topk_group > n_group:
        f.fail("topk_group", topk_group, f"must be in [1, n_group={n_group}]")
    if top_k > topk_group * (E // n_group):
        f.fail("top_k", top_k, f"exceeds the experts of the eligible groups: topk_group="
                               f"{topk_group} x {E // n_group} experts per group")
    first_k_dense = f.int("first_k_dense", 0)
    if first_k_dense >= num_layers:
        f.fail("first_k_dense", first_k_dense, f"must be < num_layers={num_layers} (leave at "
                                               f"least one mixture-of-experts layer)")
    # A run folder's config written before the latent form existed has no field: off.
    latent_dim = f.int("latent_dim", 0, f"must be 0 (off) or an integer in [1, d_model={d_model})"
                       ) if "latent_dim" in cfg.moe else 0
    if latent_dim >= d_model:
        f.fail("latent_dim", latent_dim, f"must be 0 (off) or an integer in [1, d_model={d_model})")
    scale = f.number("routed_scaling_factor", allowed="must be a finite number > 0")
    if scale <= 0:
        f.fail("routed_scaling_factor", scale, "must be a finite number > 0")
    capacity = f.number("capacity_factor", 0.0, allowed="must be >= 0 (0 = dropless)")
    # A run folder's config written before the ragged exchange existed has no field.
    exchange = (f.choice("ep_exchange", EP_EXCHANGES) if "ep_exchange" in cfg.moe
                else "all_tokens")
    if exchange == "ragged" and capacity > 0:
        f.fail("ep_exchange", exchange, f"is for dropless experts only; capacity_factor="
                                        f"{capacity:g} sends fixed buffers of c n k rows per "
                                        f"device; allowed: 'all_tokens', or capacity_factor=0")
    return MoeSpec(
        num_experts=E, top_k=top_k, expert_dim=expert_dim, num_shared=num_shared,
        shared_dim=(shared_dim or expert_dim * num_shared) if num_shared else 0,
        renormalize=f.bool("renormalize"), routed_scaling_factor=scale, n_group=n_group,
        topk_group=topk_group, first_k_dense=first_k_dense,
        router_float32=f.bool("router_float32"),
        bias_update_rate=f.number("bias_update_rate", 0.0),
        balance_loss_coef=f.number("balance_loss_coef", 0.0),
        capacity_factor=capacity,
        expert_matmul=f.choice("expert_matmul", dispatch.EXPERT_MATMULS),
        remat_experts=f.bool("remat_experts"), latent_dim=latent_dim, ep_exchange=exchange)


def model_spec(cfg, backend: str | None = None) -> ModelSpec:
    """``config.model`` checked once and resolved into a ModelSpec (a ModelSpec passes through).

    ``backend`` ("cpu" / "gpu" / "tpu"; default: JAX's) decides ``kda.impl="auto"``. Raises
    ValueError naming the first bad field."""
    if isinstance(cfg, ModelSpec):
        return cfg
    f = _Fields(cfg, "config.model.")
    for field in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim"):
        f.int(field, 1)
    pattern = layer_pattern(cfg)
    f.bool("final_mla")
    scan_layers = f.bool("scan_layers")
    moe = _moe_spec(cfg, cfg.num_layers, cfg.d_model)
    # A mixture's dense-FFN first layers differ from the rest: they run unrolled before the scan.
    prefix = pattern[:moe.first_k_dense] if moe else ""
    unit, repeats, tail = scan_plan(pattern[len(prefix):], scan_layers)
    norm_eps = f.get("norm_eps", lambda v: isinstance(v, float) and v > 0,
                     "must be a positive float")
    return ModelSpec(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, num_layers=cfg.num_layers,
        pattern=pattern, scan_prefix=prefix, scan_unit=unit, scan_repeats=repeats,
        scan_tail=tail, kda=_kda_spec(cfg, cfg.d_model, backend, norm_eps),
        mla=_mla_spec(cfg, cfg.d_model),
        mlp_dim=cfg.mlp_dim, moe=moe, attn_res=f.choice("attn_res", ATTN_RES_MODES),
        attn_res_block_size=f.int("attn_res_block_size", 1,
                                  "must be a positive integer (sublayers per block)"),
        tie_embeddings=f.bool("tie_embeddings"), head_chunk=f.int("head_chunk", 1),
        norm_eps=norm_eps,
        dtype=f.choice("dtype", DTYPES), param_dtype=f.choice("param_dtype", DTYPES),
        remat=f.choice("remat", REMAT_POLICIES), scan_layers=scan_layers,
        attn_res_impl=dispatch.choose_attn_res_impl(
            f.choice("attn_res_impl", dispatch.ATTN_RES_IMPLS), backend),
        mlp_impl=dispatch.choose_mlp_impl(f.choice("mlp_impl", dispatch.MLP_IMPLS), backend),
        matmul_format=_matmul_format(cfg, moe, backend))


def _matmul_format(cfg, moe: MoeSpec | None, backend: str | None) -> str:
    """``config.model.matmul_format`` checked: "fp8" only where its products run
    (``dispatch.fp8_error``) and, with experts, on the expert forms that have them."""
    if "matmul_format" not in cfg:  # a model section written before FP8 existed
        return "bf16"
    f = _Fields(cfg, "config.model.")
    fmt = f.choice("matmul_format", dispatch.MATMUL_FORMATS)
    if fmt != "fp8":
        return fmt
    why = dispatch.fp8_error(backend)
    if why is not None:
        f.fail("matmul_format", fmt, f"cannot run here: {why}; allowed here: 'bf16'")
    if moe is not None and moe.capacity_factor == 0 and moe.expert_matmul != "dense":
        raise ConfigError(
            f"config.model.moe.expert_matmul: {moe.expert_matmul!r} cannot run with "
            f"config.model.matmul_format='fp8': FP8 experts run in the 'dense' form or on "
            f"capacity buffers (config.model.moe.capacity_factor > 0); the grouped forms "
            f"('ragged', 'mosaic_gpu', 'blocked', which 'auto' picks) multiply in the compute "
            f"dtype only; allowed: 'dense', or a capacity factor, or matmul_format 'bf16'")
    return fmt


def data_spec(cfg) -> DataSpec:
    """``config.data`` checked (the fields that need no file reading)."""
    if isinstance(cfg, DataSpec):
        return cfg
    f = _Fields(cfg, "config.data.")
    seq_len = f.int("seq_len", 1)
    if seq_len < 2:
        f.fail("seq_len", seq_len, "leaves no next token to predict inside a row; it must be >= 2")
    source = f.choice("source", SOURCES)
    paths = f.strings("paths")
    if source == "stdlib" and paths:
        raise ConfigError(
            f"config.data.paths: {cfg.paths!r} is given, but config.data.source is 'stdlib' (the "
            f"default: the Python standard library), which reads no files; set "
            f"--config.data.source=text (or tokens) to train on them")
    eval_fraction = f.number("eval_fraction", 0.0, allowed="must be in [0, 1)")
    if eval_fraction >= 1:
        f.fail("eval_fraction", cfg.eval_fraction, "must be in [0, 1)")
    return DataSpec(
        source=source, paths=paths, eval_paths=f.strings("eval_paths"),
        eval_fraction=eval_fraction,
        tokenizer=f.get("tokenizer", lambda v: isinstance(v, str),
                        "must be a path, '' (bytes) or 'none' (no text)"),
        token_dtype=f.choice("token_dtype", TOKEN_DTYPES),
        eos_id=f.int("eos_id", -1, "must be an integer >= -1 (-1 = none)"),
        seq_len=seq_len, global_batch_size=f.int("global_batch_size", 1),
        shuffle=f.bool("shuffle"))


def opt_spec(cfg) -> OptSpec:
    """``config.opt`` checked."""
    if isinstance(cfg, OptSpec):
        return cfg
    f = _Fields(cfg, "config.opt.")
    name, schedule = f.choice("name", OPTIMIZERS), f.choice("schedule", SCHEDULES)
    decay_fraction = f.number("decay_fraction", 0.0, 1.0)
    if schedule == "wsd" and decay_fraction == 0:
        f.fail("decay_fraction", decay_fraction, "must be in (0, 1] for opt.schedule='wsd'")
    return OptSpec(
        name=name, lr=f.number("lr", 0.0), schedule=schedule,
        warmup_steps=f.int("warmup_steps", 0), min_lr_ratio=f.number("min_lr_ratio", 0.0, 1.0),
        decay_fraction=decay_fraction, b1=f.number("b1", 0.0, 1.0), b2=f.number("b2", 0.0, 1.0),
        eps=f.number("eps", 0.0), weight_decay=f.number("weight_decay", 0.0),
        no_decay=f.strings("no_decay"), grad_clip=f.number("grad_clip", 0.0),
        muon_beta=f.number("muon_beta", 0.0, 1.0),
        muon_ns_steps=f.int("muon_ns_steps", 1), muon_rms=f.number("muon_rms", 0.0),
        muon_adam_axes=f.strings("muon_adam_axes"), muon_batch_axes=f.strings("muon_batch_axes"),
        muon_exclude=f.strings("muon_exclude"),
        moments_dtype=f.choice("moments_dtype", STATE_DTYPES))


def normalize_rules(rules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Rules as ((logical, mesh_axis | (mesh_axis, ...) | None), ...), checked against the
    mesh's axis names; errors name ``mesh.axis_rules[i]``."""
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(
                f"config.mesh.axis_rules[{i}]: {rule!r} must be (logical_name, mesh_axis | "
                f"(mesh_axis, ...) | None)"
            )
        name, target = rule
        if target is None:
            out.append((name, None))
            continue
        axes = (target,) if isinstance(target, str) else tuple(target)
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ConfigError(
                f"config.mesh.axis_rules[{i}] ({name!r}): mesh axes {bad} are not among {MESH_AXES}"
            )
        out.append((name, axes[0] if len(axes) == 1 else axes))
    return tuple(out)


def mesh_sizes(cfg) -> tuple[int, int, int, int, int]:
    """The (data, fsdp, expert, context, tensor) sizes of ``config.mesh`` (or a MeshSpec),
    checked; at most one is -1 ("the rest of the devices", resolved in kimi_k3/mesh.py). A mesh
    section without ``expert`` or ``context`` (written before those existed) has them = 1."""
    f = _Fields(cfg, "config.mesh.")
    ok = lambda v: _is_int(v) and (v >= 1 or v == -1)
    sizes = tuple(1 if a in ("expert", "context") and not hasattr(cfg, a) else
                  f.get(a, ok, "must be a positive integer or -1 (the rest)") for a in MESH_AXES)
    rest = [a for a, s in zip(MESH_AXES, sizes, strict=True) if s == -1]
    if len(rest) > 1:
        raise ConfigError(f"config.mesh: only one axis may be -1, got {rest}")
    return sizes


def mesh_spec(cfg) -> MeshSpec:
    """``config.mesh`` checked; the sizes are resolved against the devices in kimi_k3/mesh.py."""
    if isinstance(cfg, MeshSpec):
        return cfg
    return MeshSpec(*mesh_sizes(cfg), axis_rules=normalize_rules(cfg.axis_rules))


def check_context(seq_len: int, context: int, chunk_size: int | None,
                  field: str = "config.data.seq_len") -> None:
    """A sequence split over ``context`` devices: each shard must hold whole KDA chunks
    (``chunk_size``; None for a model without KDA layers: whole tokens). Raises ValueError
    naming ``field`` (a ConfigError)."""
    if context <= 1:
        return
    unit = context * (chunk_size or 1)
    if seq_len % unit:
        what = (f"config.mesh.context x config.model.kda.chunk_size = {context} x {chunk_size}"
                if chunk_size else f"config.mesh.context = {context}")
        raise ConfigError(f"{field}: {seq_len} must be a multiple of {what} = {unit} (each "
                         f"device of the context axis holds whole chunks); allowed: multiples "
                         f"of {unit}, or a smaller config.mesh.context")


def ckpt_spec(cfg) -> CkptSpec:
    """``config.checkpoint`` checked."""
    if isinstance(cfg, CkptSpec):
        return cfg
    f = _Fields(cfg, "config.checkpoint.")
    return CkptSpec(enabled=f.bool("enabled"), every_steps=f.int("every_steps", 1),
                    keep=f.int("keep", 1), async_save=f.bool("async_save"),
                    dir=f.get("dir", lambda v: isinstance(v, str), "must be a path or ''"))


def train_spec(cfg) -> TrainSpec:
    """``config.train`` checked."""
    if isinstance(cfg, TrainSpec):
        return cfg
    f = _Fields(cfg, "config.train.")
    return TrainSpec(
        steps=f.int("steps", 1), log_every=f.int("log_every", 1),
        microbatch_size=f.int("microbatch_size", 0, "must be an integer >= 0 (0 = automatic)"),
        eval_every=f.int("eval_every", 0, "must be an integer >= 0"),
        eval_batches=f.int("eval_batches", 1), nan_policy=f.choice("nan_policy", NAN_POLICIES),
        progress_bar=f.bool("progress_bar"), tensorboard=f.bool("tensorboard"),
        peak_tflops_per_device=f.number("peak_tflops_per_device", 0.0),
        memory_check=f.bool("memory_check"),
        grad_accum_dtype=f.choice("grad_accum_dtype", STATE_DTYPES),
        internals_every=f.int("internals_every", -1, "must be an integer >= -1 (-1 = at each "
                              "held-out evaluation, 0 = off, N = every N steps)"))


def kda_chunk(model: ModelSpec | None) -> int | None:
    """The KDA chunk size a context-parallel sequence must be cut in whole multiples of (None
    for a model without KDA layers, or without a model)."""
    return model.kda.chunk_size if model is not None and "K" in model.pattern else None


@functools.cache
def _warn_once(message: str) -> None:
    """A config that runs but likely not as meant: said once per process, however often the
    config is checked."""
    logging.warning(message)


def run_spec(config, backend: str | None = None, with_model: bool = True) -> RunSpec:
    """The whole config checked once and resolved: raises ValueError naming the first bad
    field (a RunSpec passes through). ``backend`` decides ``model.kda.impl="auto"`` (default:
    JAX's backend); ``with_model=False`` skips the model section (a run that brings its own
    model function)."""
    if isinstance(config, RunSpec):
        return config
    seed = _Fields(config, "config.").get("seed", lambda v: _is_int(v) and 0 <= v < 2**31,
                                   "must be an integer in [0, 2**31)")
    model = model_spec(config.model, backend) if with_model else None
    spec = RunSpec(model=model, data=data_spec(config.data), opt=opt_spec(config.opt),
                   mesh=mesh_spec(config.mesh), checkpoint=ckpt_spec(config.checkpoint),
                   train=train_spec(config.train), seed=seed)
    moe, ep = (model.moe if model else None), spec.mesh.expert
    if moe and ep > 0 and moe.num_experts % ep:
        raise ConfigError(f"config.mesh.expert: {ep} does not divide config.model.moe.num_experts="
                         f"{moe.num_experts} (each device of the expert axis holds "
                         f"num_experts / mesh.expert experts)")
    if spec.mesh.context > 1:
        check_context(spec.data.seq_len, spec.mesh.context, kda_chunk(model))
    if spec.opt.warmup_steps > spec.train.steps:
        # Allowed (a short smoke run of a long config), but never silently.
        _warn_once(f"config.opt.warmup_steps={spec.opt.warmup_steps} is more than "
                   f"config.train.steps={spec.train.steps}: the learning rate stops at "
                   f"{spec.train.steps / spec.opt.warmup_steps:.0%} of config.opt.lr="
                   f"{spec.opt.lr:g}; lower --config.opt.warmup_steps to reach it")
    if model is not None and spec.data.eos_id >= model.vocab_size:
        raise ConfigError(f"config.data.eos_id: {spec.data.eos_id} is outside the vocabulary "
                          f"(config.model.vocab_size={model.vocab_size}); allowed: -1 (none) or "
                          f"an id in [0, {model.vocab_size})")
    micro, batch = spec.train.microbatch_size, spec.data.global_batch_size
    if micro and batch % micro:
        raise ConfigError(f"config.train.microbatch_size: {micro} does not divide "
                         f"config.data.global_batch_size={batch}")
    return spec
