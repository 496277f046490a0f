r"""Kimi Linear checkpoints (transformers' ``KimiLinearForCausalLM``): import and export.

    from kimi_k3.hf import load_hf_checkpoint, save_hf_checkpoint
    model_config, model = load_hf_checkpoint("Kimi-Linear-48B-A3B-Instruct/")   # a local folder
    logits_BxTxV = model(tokens_BxT)                     # float32, transformers' logits
    save_hf_checkpoint(model, model_config, "out/")      # KimiLinearForCausalLM.from_pretrained("out/")

    python -m kimi_k3.hf import --hf_dir=DIR --workdir=RUN  # RUN/config.py + Orbax step 0
    python -m kimi_k3.hf export --workdir=RUN --hf_dir=DIR  # RUN's newest step as a HF folder

``model_config`` is the ``config.model`` section (an ml_collections ConfigDict, as configs/*.py
give it); ``model`` is a ``HybridLM`` that holds its weights (an NNX module: no separate params).

Kimi Linear is this repository's model with these settings (``model_config_from_hf``):

    every layer: x += Mixer(RMSNorm(x)); x += FFN(RMSNorm(x))        attn_res = "none"
    KDA ("linear_attention"): the softplus gate g = -exp(A_log_h) softplus(f + dt_bias),
        HV = H, K = V = linear_head_dim, output RMSNorm with rms_norm_eps      kda.gate = "softplus"
    MLA ("full_attention"): no positional encoding, the "rope" slice shared but never rotated,
        no output gate, q-LoRA when q_lora_rank is set                  mla.output_gate = False
    FFN: SwiGLU of intermediate_size in the first first_k_dense_replace layers, then the mixture
        of experts (sigmoid router + e_score_correction_bias, grouped top-k, renormalised weights
        x routed_scaling_factor, shared SwiGLU of moe_intermediate_size x n_shared_experts)
    logits = RMSNorm(x) W_lm_head                                       tie_embeddings = False

Every field of config.json either maps onto one of ours, is checked to hold the only value we
compute (``attention_bias=false``, ``hidden_act="silu"``, ...), or is one that does not change
the logits (token ids, ``initializer_range``, ``use_cache``, ...; listed in ``NO_EFFECT``). Any
other field is an error naming it, as is a missing, extra or wrongly shaped tensor.

Two weight layouts are read (``LAYOUTS``): "released", the one of the published checkpoints and
the one ``save_pretrained`` writes (``self_attn.q_conv1d`` / ``f_a_proj`` / ``A_log`` ...,
``block_sparse_moe.experts.<e>.w1 / w2 / w3``), and "transformers", the module layout
``KimiLinearForCausalLM.state_dict()`` has after its conversion mapping (``self_attn.conv1d``
stacking q, k, v; ``self_attn.forget_gate.*``; ``mlp.experts.gate_up_proj`` / ``down_proj``).
Export writes "released", as ``save_pretrained`` does. The tensors (torch Linear weights are
[out, in], our Dense kernels [in, *out]; ``_layer_links``):

    KDA   {q,k,v}_proj [H K, D] -> mixer/{q,k,v}_proj [D, H, K];  {q,k,v}_conv1d [H K, 1, W]
          -> mixer/{q,k,v}_conv [W, H, K];  f_a_proj [K, D], f_b_proj [H K, K] -> f_down [D, K],
          f_up [K, H, K] (g_a_proj, g_b_proj -> g_down, g_up alike);  A_log [1, 1, H, 1] ->
          [H];  dt_bias [H K] -> [H, K];  b_proj [H, D] -> [D, H];  o_norm [K];
          o_proj [D, H K] -> [H, K, D]
    MLA   q_proj [H (dn + ds), D] -> [D, H, dn + ds] (or q_a_proj, q_a_layernorm, q_b_proj ->
          q_down, q_norm, q_up);  kv_a_proj_with_mqa [R + ds, D] -> kv_down [D, R] and
          k_shared [D, ds];  kv_b_proj [H (dn + dv), R], per head [k_nope ; v] -> k_up [R, H, dn]
          and v_up [R, H, dv];  o_proj [D, H dv] -> [H, dv, D]
    FFN   {gate,up}_proj [F, D], down_proj [D, F] -> mlp/wi [D, (gate, up), F], mlp/wo [F, D];
          experts.<e>.w1 / w3 / w2 -> experts/wi [E, D, 2, F], experts/wo [E, F, D];
          gate.weight [E, D] -> router [D, E];  gate.e_score_correction_bias [E] -> the routing
          bias (model state, not a parameter)

With ``dtype="bfloat16"`` the router's weights are stored in bfloat16 like every other matrix
(transformers keeps them in float32); A_log, dt_bias and the routing bias stay float32.

Memory: the safetensors files are memory-mapped and every parameter is built by
``jax.make_array_from_callback`` with its target sharding: each device's shard is sliced out of
the mapped file (one layer of one tensor at a time) and copied to that device, so no complete
host copy of the model exists. (The files are mapped with NumPy from the safetensors header
rather than through ``safe_open``, whose NumPy backend cannot return bfloat16, the released
checkpoints' dtype.) Export gathers one tensor at a time and writes files of at most
``max_shard_bytes`` with a ``model.safetensors.index.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import train_lib
from kimi_k3.config import (
    DTYPES,
    ModelSpec,
    add_training_defaults,
    default_model_config,
    model_spec,
    run_spec,
)
from kimi_k3.layers.moe import ExpertBias, MoeStat
from kimi_k3.model import HybridLM

LAYOUTS = ("released", "transformers")

# safetensors dtype names <-> NumPy dtypes (bfloat16 through ml_dtypes).
_ST_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
              "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

# KimiLinearConfig's defaults for the fields that change the computation (a config.json may
# leave any of them out; transformers then uses these).
HF_DEFAULTS = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": None, "n_shared_experts": 1, "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "num_local_experts": 256, "linear_head_dim": 128, "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4, "first_k_dense_replace": 1,
}
# The names config.json may use instead (KimiLinearConfig.attribute_map; save_pretrained writes
# these).
HF_ALIASES = {
    "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group",
    "num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts", "max_position_embeddings": "model_max_length",
}
# Fields that do not change the logits: token ids, initialisation, what a forward returns,
# bookkeeping. (No position is encoded anywhere, so the rope fields and the context length
# change nothing either; ``head_dim`` and ``qk_head_dim`` are derived from the dims above.)
NO_EFFECT = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "output_router_logits",
    "router_aux_loss_coef", "initializer_range", "pretraining_tp", "max_position_embeddings",
    "model_max_length", "rope_theta", "rope_scaling", "rope_parameters", "head_dim",
    "qk_head_dim", "output_attentions", "output_hidden_states", "return_dict",
    "use_return_dict", "_name_or_path", "id2label", "label2id", "problem_type",
    "tokenizer_class", "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder",
    "_attn_implementation_autoset",
})
# Fields checked to hold the one value this model computes: field -> (allowed values, why).
HF_FIXED = {
    "hidden_act": (("silu",), "SwiGLU experts, SiLU after the short convolutions"),
    "attention_bias": ((False,), "no projection here has a bias"),
    "attention_dropout": ((0, 0.0), "no dropout here"),
    "tie_word_embeddings": ((False,), "the output head is its own matrix (model.tie_embeddings "
                                      "scales a tied head by 1/sqrt(D), transformers does not)"),
    "mla_use_nope": ((True,), "MLA here encodes no position"),
    "moe_router_activation_func": (("sigmoid",), "the router's scores are sigmoids"),
    "num_nextn_predict_layers": ((0,), "no multi-token-prediction layers here"),
    "moe_layer_freq": ((1,), "every layer after first_k_dense_replace is a mixture of experts "
                             "(transformers reads only first_k_dense_replace)"),
    "quantization_config": ((None,), "weights are read as floating point"),
}
DENSE_UNDER_MOE = r"^(model\.layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$"
_LINEAR_ATTN_KEYS = {"head_dim", "num_heads", "short_conv_kernel_size", "kda_layers",
                     "full_attn_layers"}


# ---------------------------------------------------------------------------------------------
# config.json <-> config.model
# ---------------------------------------------------------------------------------------------


def _fail(field: str, got, allowed: str):
    raise ValueError(f"config.json: {field}={got!r} {allowed}")


def _hf_get(hf: dict, field: str):
    """A field of config.json by its KimiLinearConfig name or its alias, else the default."""
    alias = HF_ALIASES.get(field)
    if field in hf and alias in hf and hf[field] != hf[alias]:
        _fail(field, hf[field], f"disagrees with its alias {alias}={hf[alias]!r}")
    if field in hf:
        return hf[field]
    if alias in hf:
        return hf[alias]
    return HF_DEFAULTS.get(field)


def _hf_int(hf: dict, field: str, lo: int = 1) -> int:
    v = _hf_get(hf, field)
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        _fail(field, v, f"must be an integer >= {lo}")
    return v


def _layer_types(hf: dict, L: int) -> tuple[str, str]:
    """(our pattern "KKKM...", the FFN kinds "d..de...e") from layer_types / mlp_layer_types, or
    the released form's linear_attn_config and first_k_dense_replace (as transformers reads
    them)."""
    lac = hf.get("linear_attn_config") or {}
    extra = sorted(set(lac) - _LINEAR_ATTN_KEYS)
    if extra:
        _fail("linear_attn_config", lac, f"has fields {extra} this importer does not know "
                                         f"(known: {sorted(_LINEAR_ATTN_KEYS)})")
    types = hf.get("layer_types")
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * L
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for n in lac[key]:  # 1-based layer numbers
                if not (isinstance(n, int) and 1 <= n <= L):
                    _fail(f"linear_attn_config.{key}", lac[key], f"must hold layer numbers 1..{L}")
                types[n - 1] = kind
    if types is None:  # transformers' default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    if len(types) != L or any(t not in ("full_attention", "linear_attention") for t in types):
        _fail("layer_types", types, f"must list num_hidden_layers={L} entries, each "
                                    f"'linear_attention' (KDA) or 'full_attention' (MLA)")
    pattern = "".join("M" if t == "full_attention" else "K" for t in types)
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        k = _hf_int(hf, "first_k_dense_replace", 0)
        mlp_types = ["dense" if i < k else "sparse" for i in range(L)]
    if len(mlp_types) != L or any(t not in ("dense", "sparse") for t in mlp_types):
        _fail("mlp_layer_types", mlp_types, f"must list num_hidden_layers={L} entries, each "
                                            f"'dense' or 'sparse'")
    ffn = "".join("d" if t == "dense" else "e" for t in mlp_types)
    k = ffn.count("d")
    if ffn != "d" * k + "e" * (L - k):
        _fail("mlp_layer_types", mlp_types, "must be dense layers first, then only sparse ones "
                                            "(model.moe.first_k_dense)")
    return pattern, ffn


def model_config_from_hf(hf: dict, dtype: str = "float32") -> ml_collections.ConfigDict:
    """config.json (a dict) -> our ``config.model`` (``dtype`` for parameters and compute).
    Raises ValueError naming the first field that we do not compute or do not know."""
    if hf.get("model_type", "kimi_linear") != "kimi_linear":
        _fail("model_type", hf.get("model_type"), "must be 'kimi_linear'")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {tuple(DTYPES)}")
    known = (set(HF_DEFAULTS) | set(HF_ALIASES.values()) | set(HF_FIXED) | NO_EFFECT
             | {"linear_attn_config", "layer_types", "mlp_layer_types", "use_grouped_topk"})
    unknown = sorted(k for k in hf if k not in known)
    if unknown:
        _fail(unknown[0], hf[unknown[0]],
              "is a field kimi_k3.hf does not know, so cannot tell whether it changes the "
              f"computation (all unknown fields: {unknown})")
    for field, (allowed, why) in HF_FIXED.items():
        v = _hf_get(hf, field) if field in HF_DEFAULTS else hf.get(field, allowed[0])
        if v not in allowed or isinstance(v, bool) != isinstance(allowed[0], bool):
            _fail(field, v, f"is not supported: must be {allowed[0]!r} ({why})")
    L = _hf_int(hf, "num_hidden_layers")
    pattern, ffn = _layer_types(hf, L)
    lac = hf.get("linear_attn_config") or {}
    m = default_model_config()
    m.vocab_size = _hf_int(hf, "vocab_size")
    m.d_model = _hf_int(hf, "hidden_size")
    m.num_layers = L
    m.pattern = pattern
    m.num_heads = lac.get("num_heads", _hf_int(hf, "linear_num_heads"))
    m.kda.head_dim = lac.get("head_dim", _hf_int(hf, "linear_head_dim"))
    m.kda.num_v_heads = 0  # = num_heads
    m.kda.conv_width = lac.get("short_conv_kernel_size", _hf_int(hf, "linear_conv_kernel_dim"))
    m.kda.gate = "softplus"
    H = _hf_int(hf, "num_attention_heads")
    kv_heads = _hf_get(hf, "num_key_value_heads")
    if kv_heads not in (None, H):
        _fail("num_key_value_heads", kv_heads, f"must equal num_attention_heads={H} (MLA "
                                               f"expands its latent into every head)")
    m.mla.num_heads = H
    q_lora = _hf_get(hf, "q_lora_rank")
    if not (q_lora is None or (isinstance(q_lora, int) and q_lora >= 1)):
        _fail("q_lora_rank", q_lora, "must be null (full-rank queries) or a positive integer")
    m.mla.q_lora_rank = q_lora or 0
    m.mla.kv_lora_rank = _hf_int(hf, "kv_lora_rank")
    m.mla.qk_nope_head_dim = _hf_int(hf, "qk_nope_head_dim")
    m.mla.shared_head_dim = _hf_int(hf, "qk_rope_head_dim", 0)
    m.mla.v_head_dim = _hf_int(hf, "v_head_dim")
    m.mla.output_gate = False
    m.mlp_dim = _hf_int(hf, "intermediate_size")
    if "e" in ffn:
        E, G = _hf_int(hf, "num_local_experts"), _hf_int(hf, "n_group")
        if hf.get("use_grouped_topk", True) is not True and G != 1:
            _fail("use_grouped_topk", hf["use_grouped_topk"], f"must be true with n_group={G}")
        m.moe.num_experts = E
        m.moe.top_k = _hf_int(hf, "num_experts_per_tok")
        m.moe.expert_dim = _hf_int(hf, "moe_intermediate_size")
        m.moe.num_shared = _hf_int(hf, "n_shared_experts", 0)
        m.moe.shared_dim = 0  # = expert_dim * num_shared, as transformers sizes it
        renorm = _hf_get(hf, "norm_topk_prob")
        if not isinstance(renorm, bool):
            _fail("norm_topk_prob", renorm, "must be true or false")
        m.moe.renormalize = renorm
        scale = _hf_get(hf, "routed_scaling_factor")
        if not (isinstance(scale, int | float) and not isinstance(scale, bool) and scale > 0):
            _fail("routed_scaling_factor", scale, "must be a number > 0")
        m.moe.routed_scaling_factor = float(scale)
        m.moe.n_group = G
        m.moe.topk_group = _hf_int(hf, "topk_group")
        m.moe.first_k_dense = ffn.count("d")
    else:
        m.moe.num_experts = 0
    m.attn_res = "none"
    m.tie_embeddings = False
    eps = _hf_get(hf, "rms_norm_eps")
    if not (isinstance(eps, int | float) and not isinstance(eps, bool) and eps > 0):
        _fail("rms_norm_eps", eps, "must be a number > 0")
    m.norm_eps = float(eps)
    m.dtype = m.param_dtype = dtype
    try:
        model_spec(m)
    except ValueError as e:  # a combination our model does not build (e.g. too few experts)
        raise ValueError(f"config.json: {e}") from e
    return m


def hf_config_from_model(model_config, extra: dict | None = None) -> dict:
    """``config.model`` -> the config.json that ``KimiLinearForCausalLM`` reads, in the form
    ``save_pretrained`` writes (``layer_types``, ``mlp_layer_types``, the aliased MoE names).
    ``extra``: fields that change nothing, copied as given (token ids). Raises ValueError naming
    the field of ``config.model`` that Kimi Linear cannot express."""
    spec = model_spec(model_config)
    k, m, e = spec.kda, spec.mla, spec.moe

    def need(field, got, ok, allowed):
        if not ok:
            raise ValueError(f"config.model.{field}: {got!r} {allowed} for a Kimi Linear "
                             f"checkpoint")

    need("attn_res", spec.attn_res, spec.attn_res == "none", "must be 'none' (plain residuals)")
    need("tie_embeddings", spec.tie_embeddings, not spec.tie_embeddings,
         "must be False (transformers' tied head has no 1/sqrt(D) scale)")
    need("kda.gate", k.gate, k.gate == "softplus", "must be 'softplus'")
    need("kda.num_v_heads", k.num_v_heads, k.num_v_heads == k.num_heads,
         f"must equal num_heads={k.num_heads} (or be 0)")
    need("mla.output_gate", m.output_gate, not m.output_gate, "must be False")
    if e is not None:
        need("moe.shared_dim", e.shared_dim, e.shared_dim == e.expert_dim * e.num_shared,
             "must be 0 or expert_dim * num_shared")
        need("moe.capacity_factor", e.capacity_factor, e.capacity_factor == 0,
             "must be 0 (dropless)")
        need("moe.router_float32", e.router_float32, e.router_float32,
             "must be True (transformers routes in float32)")
    bad = sorted(set(extra or {}) - NO_EFFECT)
    if bad:
        raise ValueError(f"extra_config: {bad} are fields that change the computation; only "
                         f"fields of kimi_k3.hf.NO_EFFECT (token ids, ...) may be added")
    out = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": spec.vocab_size, "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_dim, "num_hidden_layers": spec.num_layers,
        "layer_types": ["full_attention" if c == "M" else "linear_attention"
                        for c in spec.pattern],
        "linear_num_heads": k.num_heads, "linear_head_dim": k.head_dim,
        "linear_conv_kernel_dim": k.conv_width,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.shared_head_dim,
        "v_head_dim": m.v_head_dim, "rms_norm_eps": spec.norm_eps, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "dtype": spec.param_dtype,
    }
    n_dense = spec.num_layers if e is None else e.first_k_dense
    out["mlp_layer_types"] = ["dense"] * n_dense + ["sparse"] * (spec.num_layers - n_dense)
    if e is not None:
        out.update({
            "num_experts": e.num_experts, "num_experts_per_token": e.top_k,
            "moe_intermediate_size": e.expert_dim, "num_shared_experts": e.num_shared,
            "moe_renormalize": e.renormalize, "routed_scaling_factor": e.routed_scaling_factor,
            "num_expert_group": e.n_group, "topk_group": e.topk_group,
        })
    # Token ids: transformers' defaults lie outside a small vocabulary, which its embedding
    # refuses (padding_idx), so say "none" unless the caller knows them.
    out.update({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
    out.update(extra or {})
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# Safetensors folders, memory-mapped
# ---------------------------------------------------------------------------------------------


class SafetensorsFolder:
    """The tensors of a folder's ``*.safetensors`` (``model.safetensors.index.json`` when there
    is one), each a read-only NumPy view into the memory-mapped file: nothing is read until
    sliced."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{str(self.path)!r}: no *.safetensors files")
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise FileNotFoundError(f"{str(index)!r} names {name!r}, which does not exist")
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for key, h in header.items():
                if key in self.entries:
                    raise ValueError(f"tensor {key!r} is in both {self.entries[key][0]!r} and "
                                     f"{name!r}")
                if h["dtype"] not in _ST_DTYPES:
                    raise ValueError(f"tensor {key!r} in {name!r}: dtype {h['dtype']} is not one "
                                     f"of {sorted(_ST_DTYPES)}")
                lo, hi = h["data_offsets"]
                self.entries[key] = (name, h["dtype"], tuple(h["shape"]), 8 + n + lo, 8 + n + hi)

    def names(self) -> set[str]:
        return set(self.entries)

    def rename(self, pattern: str, replacement: str) -> None:
        """Reads the tensors whose name matches ``pattern`` under ``re.sub``'s new name."""
        self.entries = {re.sub(pattern, replacement, k): v for k, v in self.entries.items()}

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][2]

    def __getitem__(self, key: str) -> np.ndarray:
        file, dt, shape, lo, hi = self.entries[key]
        if file not in self._maps:
            self._maps[file] = np.memmap(self.path / file, dtype=np.uint8, mode="r")
        dtype = _ST_DTYPES[dt]
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        return np.ndarray(shape, dtype, buffer=self._maps[file], offset=lo)


# ---------------------------------------------------------------------------------------------
# The tensor map: our parameter <- transformers' tensors (import), and back (export)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    """Our parameter ``ours`` (relative to its layer) from HF tensors ``hf`` (full names, each
    with its expected shape) by ``build(*arrays) -> ours``; or, for routed experts (our array's
    leading axis), by ``experts(range of experts, read(name)) -> those experts' rows``, so a
    device holding some experts reads only theirs."""

    ours: str
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    build: Callable[..., np.ndarray] | None
    experts: Callable[[range, Callable[[str], np.ndarray]], np.ndarray] | None = None


def _t(x):
    return np.asarray(x).T


def _linear(out_shape):
    """transformers' Linear weight [prod(out), in] -> our Dense kernel [in, *out]."""
    return lambda w: np.asarray(w).T.reshape(w.shape[1], *out_shape)


def _conv(H, K):
    """Depthwise Conv1d weight [H*K, 1, W] -> our ShortConv weight [W, H, K]."""
    return lambda w: np.asarray(w)[:, 0, :].T.reshape(w.shape[2], H, K)


def _layer_links(spec: ModelSpec, layer: int, layout: str) -> list[Link]:
    """The links of HF layer ``layer`` (0-based) for ``layout``."""
    D = spec.d_model
    p = f"model.layers.{layer}."
    links = [Link("mixer_norm/scale", ((p + "input_layernorm.weight", (D,)),), np.asarray),
             Link("mlp_norm/scale", ((p + "post_attention_layernorm.weight", (D,)),), np.asarray)]
    a = p + "self_attn."
    if spec.pattern[layer] == "K":
        H, K, W = spec.kda.num_heads, spec.kda.head_dim, spec.kda.conv_width
        HK = H * K
        fg = a + ("forget_gate." if layout == "transformers" else "")
        links += [
            Link("mixer/q_proj/kernel", ((a + "q_proj.weight", (HK, D)),), _linear((H, K))),
            Link("mixer/k_proj/kernel", ((a + "k_proj.weight", (HK, D)),), _linear((H, K))),
            Link("mixer/v_proj/kernel", ((a + "v_proj.weight", (HK, D)),), _linear((H, K))),
            Link("mixer/f_down/kernel", ((fg + "f_a_proj.weight", (K, D)),), _t),
            Link("mixer/f_up/kernel", ((fg + "f_b_proj.weight", (HK, K)),), _linear((H, K))),
            Link("mixer/A_log", ((fg + "A_log", (1, 1, H, 1)),), lambda w: np.reshape(w, (H,))),
            Link("mixer/dt_bias", ((fg + "dt_bias", (HK,)),), lambda w: np.reshape(w, (H, K))),
            Link("mixer/b_proj/kernel", ((a + "b_proj.weight", (H, D)),), _t),
            Link("mixer/g_down/kernel", ((a + "g_a_proj.weight", (K, D)),), _t),
            Link("mixer/g_up/kernel", ((a + "g_b_proj.weight", (HK, K)),), _linear((H, K))),
            Link("mixer/o_norm/scale", ((a + "o_norm.weight", (K,)),), np.asarray),
            Link("mixer/o_proj/kernel", ((a + "o_proj.weight", (D, HK)),),
                 lambda w: np.asarray(w).T.reshape(H, K, D)),
        ]
        for i, c in enumerate("qkv"):
            if layout == "released":
                links.append(Link(f"mixer/{c}_conv/weight", ((a + f"{c}_conv1d.weight", (HK, 1, W)),),
                                  _conv(H, K)))
            else:  # one convolution over [q; k; v]
                links.append(Link(f"mixer/{c}_conv/weight", ((a + "conv1d.weight", (3 * HK, 1, W)),),
                                  lambda w, i=i: _conv(H, K)(np.asarray(w)[i * HK:(i + 1) * HK])))
    else:
        m = spec.mla
        H, dn, ds, dv, R, rq = (m.num_heads, m.qk_nope_head_dim, m.shared_head_dim, m.v_head_dim,
                                m.kv_lora_rank, m.q_lora_rank)
        if rq:
            links += [
                Link("mixer/q_down/kernel", ((a + "q_a_proj.weight", (rq, D)),), _t),
                Link("mixer/q_norm/scale", ((a + "q_a_layernorm.weight", (rq,)),), np.asarray),
                Link("mixer/q_up/kernel", ((a + "q_b_proj.weight", (H * (dn + ds), rq)),),
                     _linear((H, dn + ds))),
            ]
        else:
            links.append(Link("mixer/q_proj/kernel", ((a + "q_proj.weight", (H * (dn + ds), D)),),
                              _linear((H, dn + ds))))
        kv_a = ((a + "kv_a_proj_with_mqa.weight", (R + ds, D)),)
        kv_b = ((a + "kv_b_proj.weight", (H * (dn + dv), R)),)
        # kv_b's rows are per head [k_nope (dn) ; v (dv)].
        kv_b_heads = lambda w: np.asarray(w).reshape(H, dn + dv, R).transpose(2, 0, 1)
        links += [
            Link("mixer/kv_down/kernel", kv_a, lambda w: np.asarray(w)[:R].T),
            Link("mixer/k_shared/kernel", kv_a, lambda w: np.asarray(w)[R:].T),
            Link("mixer/kv_norm/scale", ((a + "kv_a_layernorm.weight", (R,)),), np.asarray),
            Link("mixer/k_up/kernel", kv_b, lambda w: kv_b_heads(w)[..., :dn]),
            Link("mixer/v_up/kernel", kv_b, lambda w: kv_b_heads(w)[..., dn:]),
            Link("mixer/o_proj/kernel", ((a + "o_proj.weight", (D, H * dv)),),
                 lambda w: np.asarray(w).T.reshape(H, dv, D)),
        ]
    moe = spec.moe
    if moe is None or layer < moe.first_k_dense:
        F, f = spec.mlp_dim, p + "mlp."
        links += [
            Link("mlp/wi/kernel", ((f + "gate_proj.weight", (F, D)), (f + "up_proj.weight", (F, D))),
                 lambda g, u: np.stack([np.asarray(g).T, np.asarray(u).T], axis=1)),
            Link("mlp/wo/kernel", ((f + "down_proj.weight", (D, F)),), _t),
        ]
        return links
    E, F = moe.num_experts, moe.expert_dim
    f = p + ("mlp." if layout == "transformers" else "block_sparse_moe.")
    links += [
        Link("mlp/router/kernel", ((f + "gate.weight", (E, D)),), _t),
        Link("mlp/bias", ((f + "gate.e_score_correction_bias", (E,)),), np.asarray),
    ]
    # Ours: wi [E, D, (gate, up), F], wo [E, F, D].
    if layout == "transformers":  # gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]
        gu, dp = f + "experts.gate_up_proj", f + "experts.down_proj"
        links += [
            Link("mlp/experts/wi", ((gu, (E, 2 * F, D)),), None, lambda es, read: np.asarray(
                read(gu)[es.start:es.stop]).reshape(len(es), 2, F, D).transpose(0, 3, 1, 2)),
            Link("mlp/experts/wo", ((dp, (E, D, F)),), None, lambda es, read: np.asarray(
                read(dp)[es.start:es.stop]).transpose(0, 2, 1)),
        ]
    else:  # per expert: w1 (gate) [F, D], w3 (up) [F, D], w2 (down) [D, F]
        w = {n: [f + f"experts.{e}.{n}.weight" for e in range(E)] for n in ("w1", "w2", "w3")}
        links += [
            Link("mlp/experts/wi", tuple((n, (F, D)) for n in w["w1"] + w["w3"]), None,
                 lambda es, read: np.stack([np.stack([np.asarray(read(w["w1"][e])).T,
                                                      np.asarray(read(w["w3"][e])).T], axis=1)
                                            for e in es])),
            Link("mlp/experts/wo", tuple((n, (D, F)) for n in w["w2"]), None,
                 lambda es, read: np.stack([np.asarray(read(w["w2"][e])).T for e in es])),
        ]
    S = moe.shared_dim
    s = f + "shared_experts."
    if S:
        links += [
            Link("mlp/shared/wi/kernel", ((s + "gate_proj.weight", (S, D)), (s + "up_proj.weight", (S, D))),
                 lambda g, u: np.stack([np.asarray(g).T, np.asarray(u).T], axis=1)),
            Link("mlp/shared/wo/kernel", ((s + "down_proj.weight", (D, S)),), _t),
        ]
    return links


def _top_links(spec: ModelSpec) -> list[Link]:
    V, D = spec.vocab_size, spec.d_model
    return [Link("embed/embedding", (("model.embed_tokens.weight", (V, D)),), np.asarray),
            Link("final_norm/scale", (("model.norm.weight", (D,)),), np.asarray),
            Link("head/proj/kernel", (("lm_head.weight", (V, D)),), _t)]


def _empty_shared(spec: ModelSpec, layout: str) -> dict[str, tuple[int, ...]]:
    """With no shared expert transformers still has a SwiGLU of width 0, and save_pretrained
    writes its empty weights: allowed (not required) in a checkpoint, written on export."""
    if spec.moe is None or spec.moe.shared_dim:
        return {}
    D, out = spec.d_model, {}
    f = "mlp." if layout == "transformers" else "block_sparse_moe."
    for layer in range(spec.moe.first_k_dense, spec.num_layers):
        s = f"model.layers.{layer}.{f}shared_experts."
        out.update({s + "gate_proj.weight": (0, D), s + "up_proj.weight": (0, D),
                    s + "down_proj.weight": (D, 0)})
    return out


def detect_layout(names: set[str]) -> str:
    """"transformers" when a name only that layout has is present, else "released" (a model
    with neither KDA layers nor experts has the same names in both)."""
    ours = {n for n in names if ".forget_gate." in n or n.endswith("self_attn.conv1d.weight")
            or n.endswith(".experts.gate_up_proj") or n.endswith(".experts.down_proj")}
    released = {n for n in names if ".block_sparse_moe." in n or "_conv1d.weight" in n
                or (".self_attn.f_a_proj." in n)}
    if ours and released:
        raise ValueError(f"the checkpoint mixes the two weight layouts: {sorted(ours)[0]!r} "
                         f"(transformers' modules) and {sorted(released)[0]!r} (released)")
    return "transformers" if ours else "released"


def _leaf_layers(spec: ModelSpec, path: tuple) -> tuple[tuple[int, ...] | None, str]:
    """(HF layer indices of a parameter path: one per slice when stacked over the scan, None for
    the embedding / final norm / head, the path relative to its layer)."""
    path = tuple(str(p) for p in path)
    n_prefix, n_unit = len(spec.scan_prefix), len(spec.scan_unit)
    if path[0] == "prefix":
        return (int(path[1]),), "/".join(path[2:])
    if path[0] == "groups":
        i = int(path[2])
        return (tuple(n_prefix + r * n_unit + i for r in range(spec.scan_repeats)),
                "/".join(path[3:]))
    if path[0] == "tail":
        return (n_prefix + spec.scan_repeats * n_unit + int(path[1]),), "/".join(path[2:])
    return None, "/".join(path)


def _plan(spec: ModelSpec, tree: dict, layout: str) -> dict[tuple, tuple[bool, list[Link]]]:
    """Per leaf path of ``tree`` (our parameters and routing biases): (stacked over the scan?,
    its link per layer)."""
    links = {None: {k.ours: k for k in _top_links(spec)}}
    out = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(tree):
        keys = _keys(path)
        layers, rel = _leaf_layers(spec, keys)
        found = []
        for layer in layers or (None,):
            if layer not in links:
                links[layer] = {k.ours: k for k in _layer_links(spec, layer, layout)}
            if rel not in links[layer]:
                raise ValueError(f"kimi_k3.hf: our parameter {'/'.join(map(str, keys))} has no "
                                 f"Kimi Linear tensor (an option transformers lacks?)")
            found.append(links[layer][rel])
        out[keys] = (keys[0] == "groups", found)
    return out


def check_tensors(folder: SafetensorsFolder, plans: list[dict], spec: ModelSpec,
                  layout: str) -> None:
    """Every tensor the plans read is in ``folder`` with its shape, and ``folder`` holds no
    other; else ValueError naming the tensors. Nothing is read but the headers."""
    want = {}
    for plan in plans:
        for _, links in plan.values():
            for link in links:
                want.update(dict(link.hf))
    have = folder.names()
    optional = {k: v for k, v in _empty_shared(spec, layout).items() if k in have}
    want.update(optional)
    missing = sorted(set(want) - have)
    extra = sorted(have - set(want))
    shapes = sorted(k for k in set(want) & have if tuple(folder.shape(k)) != tuple(want[k]))
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (the first: {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} not in the model config.json describes (the first: "
                         f"{extra[:3]})")
        if shapes:
            parts.append("wrong shapes: " + "; ".join(
                f"{k} is {list(folder.shape(k))}, expected {list(want[k])}" for k in shapes[:3]))
        raise ValueError(f"{str(folder.path)!r} ({layout} layout) does not match its "
                         f"config.json: " + "; ".join(parts))


def _read_array(folder: SafetensorsFolder, stacked: bool, links: list[Link], abstract, sharding):
    """One parameter on ``sharding``, each device's block built from the mapped tensors: one
    layer of one tensor at a time (of routed experts, only the device's experts)."""
    dtype = abstract.dtype

    def layer_block(link, index):
        if link.experts is None:
            return np.asarray(link.build(*(folder[name] for name, _ in link.hf)))[index]
        num = abstract.shape[1 if stacked else 0]
        es = range(*index[0].indices(num))
        return np.asarray(link.experts(es, folder.__getitem__))[(slice(None), *index[1:])]

    def block(index):
        if not stacked:
            return np.asarray(layer_block(links[0], index), dtype=dtype)
        rows = range(*index[0].indices(len(links)))
        return np.stack([np.asarray(layer_block(links[r], index[1:]), dtype=dtype) for r in rows])

    return jax.make_array_from_callback(abstract.shape, sharding, block)


def _fill(folder, plan: dict, abstract_tree: dict, shardings) -> dict:
    """``abstract_tree``'s arrays read from ``folder`` onto ``shardings`` (a matching tree;
    None: the first device)."""
    flat_sh = dict(_flat(shardings)) if shardings is not None else None
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def one(path, x):
        keys = _keys(path)
        stacked, links = plan[keys]
        return _read_array(folder, stacked, links, x, flat_sh[keys] if flat_sh else default)

    return jax.tree_util.tree_map_with_path(one, abstract_tree)


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _flat(tree):
    for path, x in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding)):
        yield _keys(path), x


def read_hf_config(path) -> dict:
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r}: no config.json")
    return json.loads(file.read_text())


def load_hf_params(path, model_config, shardings=None) -> tuple[dict, dict]:
    """(parameters, routing biases) as pure dicts in ``HybridLM(model_config)``'s layout, read
    from the safetensors in ``path`` (either layout). ``shardings``: {"params": tree,
    "model_state": tree} of shardings (the trainer's ``state_shardings``); default: the first
    device. Every tensor is checked (names, shapes) before any is read."""
    folder, trees, plans = open_checked(path, model_config)
    out = {k: _fill(folder, plans[k], t, shardings.get(k) if shardings else None)
           for k, t in trees.items()}
    return out["params"], out["model_state"]


def open_checked(path, model_config):
    """(the folder, our abstract {"params", "model_state"} trees, their plans) after checking
    every tensor's name and shape against ``model_config`` (headers only; nothing is read)."""
    spec = model_spec(model_config)
    folder = SafetensorsFolder(path)
    layout = detect_layout(folder.names())
    if layout == "released":
        # A dense FFN is "mlp." in the published checkpoints and "block_sparse_moe." in what
        # save_pretrained writes (it renames every "mlp." back); transformers reads both.
        folder.rename(DENSE_UNDER_MOE, r"\1mlp.\2")
    abstract = nnx.eval_shape(lambda: HybridLM(spec, rngs=nnx.Rngs(0)))
    _, abs_params, abs_biases, _ = nnx.split(abstract, nnx.Param, ExpertBias, ...)
    trees = {"params": nnx.to_pure_dict(abs_params), "model_state": nnx.to_pure_dict(abs_biases)}
    plans = {k: _plan(spec, t, layout) for k, t in trees.items()}
    check_tensors(folder, list(plans.values()), spec, layout)
    return folder, trees, plans


def model_from_params(model_config, params: dict, biases: dict) -> HybridLM:
    """A HybridLM holding ``params`` and ``biases`` (pure dicts); its other state (the MoE
    measurements a forward pass overwrites) zeros."""
    spec = model_spec(model_config)
    abstract = nnx.eval_shape(lambda: HybridLM(spec, rngs=nnx.Rngs(0)))
    graphdef, abs_params, abs_biases, abs_rest = nnx.split(abstract, nnx.Param, ExpertBias, ...)
    nnx.replace_by_pure_dict(abs_params, params)
    if biases:
        nnx.replace_by_pure_dict(abs_biases, biases)
    abs_stats, abs_other = nnx.split_state(abs_rest, MoeStat, ...)
    if jax.tree.leaves(abs_other):
        raise ValueError("kimi_k3.hf: HybridLM holds state that is neither a parameter, a "
                         "routing bias nor a MoE measurement; the importer does not know it")
    device = jax.devices()[0]
    stats = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=device), abs_stats)
    return nnx.merge(graphdef, abs_params, abs_biases, stats, abs_other)


def load_hf_checkpoint(path, dtype: str = "float32") -> tuple[ml_collections.ConfigDict, HybridLM]:
    """(config.model, a HybridLM holding the weights) from a local Kimi Linear folder:
    ``config.json`` and ``*.safetensors`` (one file, several, or sharded with
    ``model.safetensors.index.json``), in either weight layout.

    ``model(tokens_BxT)`` gives float32 logits [B, T, V]; parameters and compute are in
    ``dtype`` ("float32" | "bfloat16" | "float16"). The weights go to the first device; for a
    mesh, ``load_hf_params`` takes the trainer's shardings.
    """
    model_config = model_config_from_hf(read_hf_config(path), dtype)
    params, biases = load_hf_params(path, model_config)
    return model_config, model_from_params(model_config, params, biases)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def _hf_tensors(spec: ModelSpec, get: Callable[[str, int | None], np.ndarray]):
    """Yields (HF name, array) in the released layout, one at a time; ``get(rel, layer)`` returns
    our parameter ``rel`` of HF layer ``layer`` (None: top level) as a NumPy array."""
    D = spec.d_model
    yield "model.embed_tokens.weight", get("embed/embedding", None)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        yield p + "input_layernorm.weight", get("mixer_norm/scale", layer)
        yield p + "post_attention_layernorm.weight", get("mlp_norm/scale", layer)
        lin = lambda rel, layer=layer: (lambda x: x.reshape(x.shape[0], -1).T)(get(rel, layer))
        if spec.pattern[layer] == "K":
            H, K = spec.kda.num_heads, spec.kda.head_dim
            for name in ("q", "k", "v"):
                yield a + f"{name}_proj.weight", lin(f"mixer/{name}_proj/kernel")
            for name in ("q", "k", "v"):
                w = get(f"mixer/{name}_conv/weight", layer)  # [W, H, K]
                yield a + f"{name}_conv1d.weight", w.reshape(w.shape[0], H * K).T[:, None, :]
            yield a + "f_a_proj.weight", lin("mixer/f_down/kernel")
            yield a + "f_b_proj.weight", lin("mixer/f_up/kernel")
            yield a + "A_log", get("mixer/A_log", layer).reshape(1, 1, H, 1)
            yield a + "dt_bias", get("mixer/dt_bias", layer).reshape(H * K)
            yield a + "b_proj.weight", lin("mixer/b_proj/kernel")
            yield a + "g_a_proj.weight", lin("mixer/g_down/kernel")
            yield a + "g_b_proj.weight", lin("mixer/g_up/kernel")
            yield a + "o_norm.weight", get("mixer/o_norm/scale", layer)
            yield a + "o_proj.weight", get("mixer/o_proj/kernel", layer).reshape(H * K, D).T
        else:
            m = spec.mla
            H, dn, dv, R = m.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
            if m.q_lora_rank:
                yield a + "q_a_proj.weight", lin("mixer/q_down/kernel")
                yield a + "q_a_layernorm.weight", get("mixer/q_norm/scale", layer)
                yield a + "q_b_proj.weight", lin("mixer/q_up/kernel")
            else:
                yield a + "q_proj.weight", lin("mixer/q_proj/kernel")
            yield a + "kv_a_proj_with_mqa.weight", np.concatenate(
                [get("mixer/kv_down/kernel", layer), get("mixer/k_shared/kernel", layer)], axis=1).T
            yield a + "kv_a_layernorm.weight", get("mixer/kv_norm/scale", layer)
            k_up, v_up = get("mixer/k_up/kernel", layer), get("mixer/v_up/kernel", layer)
            yield a + "kv_b_proj.weight", np.concatenate([k_up, v_up], axis=2).transpose(
                1, 2, 0).reshape(H * (dn + dv), R)
            yield a + "o_proj.weight", get("mixer/o_proj/kernel", layer).reshape(H * dv, D).T
        moe = spec.moe
        if moe is None or layer < moe.first_k_dense:
            wi = get("mlp/wi/kernel", layer)  # [D, 2, F]
            # Named as save_pretrained names it (the published checkpoints say "mlp.").
            yield p + "block_sparse_moe.down_proj.weight", get("mlp/wo/kernel", layer).T
            yield p + "block_sparse_moe.gate_proj.weight", wi[:, 0].T
            yield p + "block_sparse_moe.up_proj.weight", wi[:, 1].T
            continue
        f = p + "block_sparse_moe."
        wi, wo = get("mlp/experts/wi", layer), get("mlp/experts/wo", layer)  # [E,D,2,F], [E,F,D]
        for e in range(moe.num_experts):
            yield f + f"experts.{e}.w1.weight", wi[e, :, 0].T
            yield f + f"experts.{e}.w2.weight", wo[e].T
            yield f + f"experts.{e}.w3.weight", wi[e, :, 1].T
        yield f + "gate.e_score_correction_bias", get("mlp/bias", layer)
        yield f + "gate.weight", get("mlp/router/kernel", layer).T
        s = f + "shared_experts."
        if moe.shared_dim:
            swi = get("mlp/shared/wi/kernel", layer)
            yield s + "down_proj.weight", get("mlp/shared/wo/kernel", layer).T
            yield s + "gate_proj.weight", swi[:, 0].T
            yield s + "up_proj.weight", swi[:, 1].T
        else:  # transformers' width-0 shared SwiGLU, as save_pretrained writes it
            dt = get("mlp_norm/scale", layer).dtype
            yield s + "down_proj.weight", np.zeros((D, 0), dt)
            yield s + "gate_proj.weight", np.zeros((0, D), dt)
            yield s + "up_proj.weight", np.zeros((0, D), dt)
    yield "model.norm.weight", get("final_norm/scale", None)
    yield "lm_head.weight", get("head/proj/kernel", None).T


def _write_safetensors(tensors: dict[str, np.ndarray], file: pathlib.Path) -> None:
    """One safetensors file (bfloat16 too: safetensors takes ml_dtypes' bfloat16 arrays)."""
    for name, x in tensors.items():
        if x.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {x.dtype} cannot be written")
    safetensors.numpy.save_file({k: np.ascontiguousarray(x) for k, x in tensors.items()},
                                str(file), metadata={"format": "pt"})


def save_hf_checkpoint(model: HybridLM, model_config, path, *, extra_config: dict | None = None,
                       max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Writes ``config.json`` and the weights of ``model`` (a HybridLM for ``model_config``) to
    the folder ``path`` in the released layout, as ``save_pretrained`` does: one
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``. Tensors keep the parameters' dtype. ``extra_config``:
    further config.json fields (token ids). Returns the files written."""
    spec = model_spec(model_config)
    config = hf_config_from_model(model_config, extra_config)
    _, params, biases, _ = nnx.split(model, nnx.Param, ExpertBias, ...)
    flat = {}
    for tree in (nnx.to_pure_dict(params), nnx.to_pure_dict(biases)):
        for path_, x in jax.tree_util.tree_leaves_with_path(tree):
            keys = _keys(path_)
            layers, rel = _leaf_layers(spec, keys)
            if layers is None:
                flat[(rel, None)] = (x, None)
            else:
                for r, layer in enumerate(layers):
                    flat[(rel, layer)] = (x, r if keys[0] == "groups" else None)

    def get(rel, layer):
        if (rel, layer) not in flat:
            raise ValueError(f"save_hf_checkpoint: the model has no parameter {rel} for layer "
                             f"{layer}; is it the HybridLM of model_config?")
        x, r = flat[(rel, layer)]
        return np.asarray(jax.device_get(x if r is None else x[r]))

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # Shards as the tensors come (one gathered at a time), named once their count is known.
    parts, pending, pending_bytes, owner, total = [], {}, 0, {}, 0

    def flush():
        part = out / f".part-{len(parts):05d}.safetensors"
        _write_safetensors(pending, part)
        parts.append((part, list(pending)))

    for name, x in _hf_tensors(spec, get):
        if pending and pending_bytes + x.nbytes > max_shard_bytes:
            flush()
            pending, pending_bytes = {}, 0
        pending[name] = x
        pending_bytes += x.nbytes
        total += x.nbytes
    flush()
    files = (["model.safetensors"] if len(parts) == 1 else
             [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))])
    for (part, names), file in zip(parts, files, strict=True):
        part.replace(out / file)
        owner.update({name: file for name in names})
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": owner}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["config.json", *files] + (["model.safetensors.index.json"] if len(files) > 1 else [])



# ---------------------------------------------------------------------------------------------
# Command line: a workdir the trainer, eval.py and generate.py read, and back
# ---------------------------------------------------------------------------------------------

FINETUNE_LR = 1e-5  # the imported run's opt.lr: the trainer's default (3e-3) is a from-scratch rate

_RUN_CONFIG = '''"""Kimi Linear imported from {hf_dir} by ``python -m kimi_k3.hf import``.

    python train.py --config={workdir}/config.py --workdir={workdir}    # fine-tunes from step 0
    python eval.py --config={workdir}/config.py --workdir={workdir}/eval --checkpoint={workdir}
    python generate.py --config={workdir}/config.py --workdir={workdir} --prompt_ids=1,2,3
    python -m kimi_k3.hf export --workdir={workdir} --hf_dir=OUT

The model section comes from hf_config.json beside this file (kimi_k3.hf.model_config_from_hf),
the rest from the trainer's defaults (kimi_k3.hf.run_config_from_hf); override fields with
--config.<section>.<field>=... . Step 0 holds a fresh optimizer state for the opt section as
it was at import: changing opt.name afterwards makes that step unreadable.
"""

import json
import pathlib

from kimi_k3.hf import run_config_from_hf


def get_config(arg=None):
    if arg:
        raise ValueError(f"this config takes no argument, got {{arg!r}}")
    hf = json.loads((pathlib.Path(__file__).parent / "hf_config.json").read_text())
    return run_config_from_hf(hf, dtype={dtype!r}, tokenizer={tokenizer!r},
                              param_dtype={param_dtype!r})
'''


def run_config_from_hf(hf: dict, dtype: str = "float32", tokenizer: str = "",
                       param_dtype: str = "float32") -> ml_collections.ConfigDict:
    """A whole run's config for a Kimi Linear checkpoint: ``model`` from config.json (computing
    in ``dtype``, parameters kept in ``param_dtype``), the trainer's defaults around it, its
    end-of-text id as ``data.eos_id`` (when inside the vocabulary), ``tokenizer`` (a tokenizers
    JSON) as ``data.tokenizer``, ``opt.lr`` a fine-tuning rate (FINETUNE_LR)."""
    config = ml_collections.ConfigDict()
    config.model = model_config_from_hf(hf, dtype)
    if param_dtype not in DTYPES:
        raise ValueError(f"param_dtype: {param_dtype!r} is not one of {tuple(DTYPES)}")
    config.model.param_dtype = param_dtype
    add_training_defaults(config)
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(eos, int) and 0 <= eos < config.model.vocab_size:
        config.data.eos_id = eos
    config.data.tokenizer = tokenizer
    config.opt.lr = FINETUNE_LR
    return config


def import_to_workdir(hf_dir, workdir, dtype: str = "float32",
                      param_dtype: str = "float32") -> str:
    """``hf_dir`` (a Kimi Linear folder) -> ``workdir``: ``config.py`` (with ``hf_config.json``
    and, when the folder has one, ``tokenizer.json``) and an Orbax checkpoint at step 0 in the
    trainer's layout (parameters in ``param_dtype``, routing biases, a fresh optimizer state,
    on the trainer's mesh and shardings); the run computes in ``dtype``. Refuses a workdir that
    already holds checkpoints. Returns the step folder."""
    hf_dir = pathlib.Path(hf_dir)
    hf = read_hf_config(hf_dir)
    # Every field and tensor checked before anything is written.
    open_checked(hf_dir, run_config_from_hf(hf, dtype, "", param_dtype).model)
    workdir = pathlib.Path(train_lib.check_workdir(os.fspath(workdir)))
    ckpt_dir = workdir / "checkpoints"
    if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        raise ValueError(f"--workdir: {str(workdir)!r} already holds checkpoints; import into "
                         f"a new folder")
    tokenizer = ""
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copy(hf_dir / "tokenizer.json", workdir / "tokenizer.json")
        tokenizer = os.fspath(workdir / "tokenizer.json")
    config = run_config_from_hf(hf, dtype, tokenizer, param_dtype)
    spec = run_spec(config)
    mesh = mesh_lib.make_mesh(spec.mesh)
    # The whole batch as the micro-batch: nothing is compiled to size one at import.
    with config.unlocked():
        config.train.microbatch_size = config.data.global_batch_size
    setup = train_lib.build(config, mesh)
    shardings = setup.state_shardings
    params, biases = load_hf_params(hf_dir, config.model, shardings)
    with setup.context():
        opt_state = jax.jit(setup.tx.init, out_shardings=shardings["opt_state"])(params)
    state = {"params": params, "opt_state": opt_state,
             "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]),
             "rng": jax.device_put(jax.random.PRNGKey(spec.seed + 1), shardings["rng"])}
    if "model_state" in shardings:
        state["model_state"] = biases
    ckpt = ckpt_lib.Checkpointer(os.fspath(ckpt_dir), spec.checkpoint)
    try:
        ckpt.save(0, state, {"position": 0})
    finally:
        ckpt.close()
    shutil.copy(hf_dir / "config.json", workdir / "hf_config.json")
    (workdir / "config.py").write_text(_RUN_CONFIG.format(
        hf_dir=os.fspath(hf_dir), workdir=os.fspath(workdir), dtype=dtype, tokenizer=tokenizer,
        param_dtype=param_dtype))
    return os.fspath(ckpt_dir / "0")


def _load_config_file(path: pathlib.Path):
    module_spec = importlib.util.spec_from_file_location("kimi_k3_hf_run_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config()


def export_from_workdir(workdir, hf_dir, checkpoint: str | None = None,
                        config_path: str | None = None) -> list[str]:
    """A run's checkpoint (``checkpoint``, default the newest under ``workdir``) -> a Kimi
    Linear folder ``hf_dir``. The config: ``config_path``, default ``workdir/config.py`` (what
    ``import`` writes). Token ids come from ``workdir/hf_config.json`` when there is one, else
    ``data.eos_id``. Returns the files written."""
    workdir = pathlib.Path(workdir)
    path = pathlib.Path(config_path) if config_path else workdir / "config.py"
    if not path.is_file():
        raise FileNotFoundError(f"--config: {str(path)!r} does not exist (import writes "
                                f"workdir/config.py; give --config for another run)")
    config = _load_config_file(path)
    hf_config_from_model(config.model)  # a model transformers cannot run fails before reading
    model, _ = ckpt_lib.restore_model_for_eval(config, checkpoint or os.fspath(workdir),
                                               config_name=os.fspath(path))
    extra = {}
    original = workdir / "hf_config.json"
    if original.is_file():
        hf = json.loads(original.read_text())
        extra = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
    elif "data" in config and config.data.eos_id >= 0:
        extra = {"eos_token_id": config.data.eos_id}
    files = save_hf_checkpoint(model, config.model, hf_dir, extra_config=extra)
    tok = config.data.tokenizer if "data" in config else ""
    if tok and os.path.isfile(tok):
        shutil.copy(tok, pathlib.Path(hf_dir) / "tokenizer.json")
        files.append("tokenizer.json")
    return files


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kimi_k3.hf",
                                     description="Kimi Linear checkpoints: import and export.")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a transformers folder -> a workdir (config.py + step 0)")
    imp.add_argument("--hf_dir", required=True, help="config.json + *.safetensors")
    imp.add_argument("--workdir", required=True, help="the run folder to create")
    imp.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                     help="the run's compute dtype (model.dtype)")
    imp.add_argument("--param_dtype", default="float32", choices=tuple(DTYPES),
                     help="the parameters' dtype in the checkpoint and in training")
    exp = sub.add_parser("export", help="a workdir's checkpoint -> a transformers folder")
    exp.add_argument("--workdir", required=True)
    exp.add_argument("--hf_dir", required=True, help="the folder to write")
    exp.add_argument("--checkpoint", default=None, help="a step folder (default: the newest)")
    exp.add_argument("--config", default=None, help="the run's config file (default: "
                                                    "WORKDIR/config.py)")
    args = parser.parse_args(argv)
    if args.command == "import":
        step = import_to_workdir(args.hf_dir, args.workdir, args.dtype, args.param_dtype)
        print(f"imported {args.hf_dir} -> {step}; config: {args.workdir}/config.py")
    else:
        files = export_from_workdir(args.workdir, args.hf_dir, args.checkpoint, args.config)
        print(f"exported to {args.hf_dir}: {', '.join(files)}")


if __name__ == "__main__":
    main(sys.argv[1:])
