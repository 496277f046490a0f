r"""config.json (transformers' ``KimiLinearConfig``) <-> our ``config.model``; a run's config.

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

Which layer is which comes from ``layer_types`` / ``mlp_layer_types`` (what ``save_pretrained``
writes), else from the released form's ``linear_attn_config`` (1-based ``kda_layers`` /
``full_attn_layers``) and ``first_k_dense_replace``, else transformers' default (every fourth
layer after the first MLA).

Every field of config.json either maps onto one of ours (by its ``KimiLinearConfig`` name or
the alias ``save_pretrained`` writes, ``HF_ALIASES``; left out, transformers' default,
``HF_DEFAULTS``), is checked to hold the only value we compute (``HF_FIXED``:
``attention_bias=false``, ``hidden_act="silu"``, ...), or is one that does not change the
logits (token ids, ``initializer_range``, ``use_cache``, ...; listed in ``NO_EFFECT``). Any
other field is a ValueError naming it. ``hf_config_from_model`` goes back, in the form
``save_pretrained`` writes, and names the field of ``config.model`` that Kimi Linear cannot
express (attention residuals, a tied head, an output gate, ...).

``run_config_from_hf`` puts the trainer's defaults around the model section, with a fine-tuning
rate (``FINETUNE_LR``); the config.py that ``python -m kimi_k3.hf import`` writes calls it.
"""

from __future__ import annotations

import ml_collections

from kimi_k3.config import DTYPES, add_training_defaults, default_model_config, model_spec

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
_LINEAR_ATTN_KEYS = {"head_dim", "num_heads", "short_conv_kernel_size", "kda_layers",
                     "full_attn_layers"}


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
        need("moe.latent_dim", e.latent_dim, e.latent_dim == 0,
             "must be 0 (Kimi Linear's experts run at the model width)")
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


FINETUNE_LR = 1e-5  # the imported run's opt.lr: the trainer's default (3e-3) is a from-scratch rate


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
