"""The K3-style hybrid language model: KDA and Gated MLA layers, SwiGLU MLPs, Attention Residuals.

    x_0 = Embed(tokens)                                           [B, T, D]
    for each layer l (kind K = KDA or M = Gated MLA, from ``layer_pattern(cfg)``):
        h = AttnRes_read(sources)            x += Mixer_l(RMSNorm(h))      (sublayer 2l)
        h = AttnRes_read(sources)            x += SwiGLU_l(RMSNorm(h))     (sublayer 2l + 1)
    logits = Head(RMSNorm(AttnRes_read(sources)))                 [B, T, V] float32

With ``attn_res="none"`` the reads are the plain residual stream; otherwise see
layers/attn_res.py. Nothing positional anywhere: KDA's recurrence carries order.

Layer pattern: ``kda_per_mla = r`` gives r KDA layers then one MLA, repeating; ``final_mla``
makes the last layer MLA; r = 0 is all MLA; an explicit ``pattern`` string ("KKKM...") overrides.
Compile time does not grow with depth: the pattern is split into a repeating unit (e.g. "KKKM"),
scanned over with ``nnx.scan`` (parameters stacked along a "layers" axis), and a short unrolled
tail (e.g. K3's final "M"). ``remat`` rematerialises each scanned unit / tail layer.

Decoding: ``init_cache`` / ``prefill`` / ``step`` carry per-layer state (KDA state and conv
tails, MLA latent cache) and a position counter, so a sequence processed in pieces gives the same
logits as in one pass.

The model section of every config comes from :func:`default_model_config`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from kimi_k3.layers.attention import ATTN_IMPLS
from kimi_k3.layers.attn_res import ATTN_RES_MODES, DepthQuery, DepthResidual
from kimi_k3.layers.embed import Embed, OutputHead
from kimi_k3.layers.kda_layer import GATES, KDALayer
from kimi_k3.layers.mla import GatedMLA
from kimi_k3.layers.mlp import SwiGLU
from kimi_k3.layers.norms import RMSNorm
from kimi_k3.ops import IMPLS as KDA_IMPLS
from kimi_k3.sharding import BTD, BTV, constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


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

    cfg.mlp_dim = 384  # SwiGLU hidden width F
    cfg.attn_res = "block"  # "none" | "full" | "block"
    cfg.attn_res_block_size = 4  # sublayers per block (a layer is 2 sublayers)
    cfg.tie_embeddings = True  # output head = embedding^T / sqrt(D)
    cfg.norm_eps = 1e-6
    cfg.dtype = "float32"  # compute dtype: "float32" | "bfloat16" | "float16"
    cfg.param_dtype = "float32"  # parameter storage dtype
    cfg.remat = "none"  # "none" | "full" | "dots": rematerialisation of each scanned unit
    cfg.scan_layers = True  # scan over the repeating unit of the pattern
    return cfg


def _fail(field: str, got, allowed: str):
    raise ValueError(f"config.model.{field}: {allowed}, got {got!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _kda_dims(cfg) -> tuple[int, int, int]:
    """(H, K, HV) with the 0 = derived conventions resolved."""
    H = cfg.num_heads
    K = cfg.kda.head_dim or cfg.d_model // H
    HV = cfg.kda.num_v_heads or H
    return H, K, HV


def _mla_dims(cfg) -> tuple[int, int, int, int, int, int]:
    """(H, q_lora, R, dn, ds, dv) with the 0 = derived conventions resolved."""
    m = cfg.mla
    H = m.num_heads
    return (H, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim or cfg.d_model // H,
            m.shared_head_dim, m.v_head_dim or cfg.d_model // H)


def validate_model_config(cfg) -> None:
    """Raises ValueError naming the first bad field of ``config.model``."""
    for field in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim"):
        v = cfg[field]
        if not (_is_int(v) and v > 0):
            _fail(field, v, "must be a positive integer")
    if not (_is_int(cfg.kda_per_mla) and cfg.kda_per_mla >= 0):
        _fail("kda_per_mla", cfg.kda_per_mla, "must be an integer >= 0 (0 = all MLA)")
    if not isinstance(cfg.final_mla, bool):
        _fail("final_mla", cfg.final_mla, "must be a bool")
    if not isinstance(cfg.pattern, str):
        _fail("pattern", cfg.pattern, "must be a string of 'K' and 'M'")
    if cfg.pattern:
        bad = sorted(set(cfg.pattern) - {"K", "M"})
        if bad:
            _fail("pattern", cfg.pattern, f"may only contain 'K' (KDA) and 'M' (MLA), found {bad}")
        if len(cfg.pattern) != cfg.num_layers:
            _fail("pattern", cfg.pattern, f"must have num_layers={cfg.num_layers} letters")

    k = cfg.kda
    if not (_is_int(k.head_dim) and k.head_dim >= 0):
        _fail("kda.head_dim", k.head_dim, "must be an integer >= 0 (0 = d_model // num_heads)")
    if k.head_dim == 0 and cfg.d_model % cfg.num_heads:
        _fail("num_heads", cfg.num_heads,
              f"must divide d_model={cfg.d_model} when kda.head_dim=0 derives the head dim")
    if not (_is_int(k.num_v_heads) and k.num_v_heads >= 0):
        _fail("kda.num_v_heads", k.num_v_heads, "must be an integer >= 0 (0 = num_heads)")
    if k.num_v_heads % cfg.num_heads:
        _fail("kda.num_v_heads", k.num_v_heads, f"must be a multiple of num_heads={cfg.num_heads}")
    if not (_is_int(k.conv_width) and k.conv_width >= 1):
        _fail("kda.conv_width", k.conv_width, "must be an integer >= 1")
    if k.gate not in GATES:
        _fail("kda.gate", k.gate, f"must be one of {GATES}")
    if not (isinstance(k.gate_lower_bound, int | float) and math.isfinite(k.gate_lower_bound)
            and k.gate_lower_bound < 0):
        _fail("kda.gate_lower_bound", k.gate_lower_bound, "must be a finite number < 0")
    if not (_is_int(k.chunk_size) and k.chunk_size > 0 and k.chunk_size & (k.chunk_size - 1) == 0):
        _fail("kda.chunk_size", k.chunk_size, "must be a positive power of two")
    if k.impl not in KDA_IMPLS:
        _fail("kda.impl", k.impl, f"must be one of {KDA_IMPLS}")

    m = cfg.mla
    if not (_is_int(m.num_heads) and m.num_heads > 0):
        _fail("mla.num_heads", m.num_heads, "must be a positive integer")
    for field in ("qk_nope_head_dim", "v_head_dim"):
        v = m[field]
        if not (_is_int(v) and v >= 0):
            _fail(f"mla.{field}", v, "must be an integer >= 0 (0 = d_model // mla.num_heads)")
        if v == 0 and cfg.d_model % m.num_heads:
            _fail("mla.num_heads", m.num_heads,
                  f"must divide d_model={cfg.d_model} when mla.{field}=0 derives the head dim")
    if not (_is_int(m.q_lora_rank) and m.q_lora_rank >= 0):
        _fail("mla.q_lora_rank", m.q_lora_rank, "must be an integer >= 0 (0 = no low-rank queries)")
    if not (_is_int(m.kv_lora_rank) and m.kv_lora_rank > 0):
        _fail("mla.kv_lora_rank", m.kv_lora_rank, "must be a positive integer")
    if not (_is_int(m.shared_head_dim) and m.shared_head_dim >= 0):
        _fail("mla.shared_head_dim", m.shared_head_dim, "must be an integer >= 0")
    if not isinstance(m.output_gate, bool):
        _fail("mla.output_gate", m.output_gate, "must be a bool")
    if m.attn_impl not in ATTN_IMPLS:
        _fail("mla.attn_impl", m.attn_impl, f"must be one of {ATTN_IMPLS}")
    if not (_is_int(m.attn_block_size) and m.attn_block_size > 0 and m.attn_block_size % 8 == 0):
        _fail("mla.attn_block_size", m.attn_block_size, "must be a positive multiple of 8")

    if cfg.attn_res not in ATTN_RES_MODES:
        _fail("attn_res", cfg.attn_res, f"must be one of {ATTN_RES_MODES}")
    if not (_is_int(cfg.attn_res_block_size) and cfg.attn_res_block_size > 0):
        _fail("attn_res_block_size", cfg.attn_res_block_size,
              "must be a positive integer (sublayers per block)")
    for field in ("tie_embeddings", "scan_layers"):
        if not isinstance(cfg[field], bool):
            _fail(field, cfg[field], "must be a bool")
    if not (isinstance(cfg.norm_eps, float) and cfg.norm_eps > 0):
        _fail("norm_eps", cfg.norm_eps, "must be a positive float")
    for field in ("dtype", "param_dtype"):
        if cfg[field] not in DTYPES:
            _fail(field, cfg[field], f"must be one of {tuple(DTYPES)}")
    if cfg.remat not in REMAT_POLICIES:
        _fail("remat", cfg.remat, f"must be one of {tuple(REMAT_POLICIES)}")


def layer_pattern(cfg) -> str:
    """The stack as a string, one letter per layer: "K" = KDA, "M" = Gated MLA.

    K3 (93 layers, r = 3, final_mla): "KKKM" * 23 + "M", MLA at layers 4, 8, ..., 92, 93.
    """
    if not (_is_int(cfg.kda_per_mla) and cfg.kda_per_mla >= 0):
        _fail("kda_per_mla", cfg.kda_per_mla, "must be an integer >= 0 (0 = all MLA)")
    if cfg.pattern:
        bad = sorted(set(cfg.pattern) - {"K", "M"})
        if bad:
            _fail("pattern", cfg.pattern, f"may only contain 'K' (KDA) and 'M' (MLA), found {bad}")
        return cfg.pattern
    L, r = cfg.num_layers, cfg.kda_per_mla
    unit = "K" * r + "M"
    pattern = (unit * (L // len(unit) + 1))[:L]
    if cfg.final_mla:
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


# ----------------------------------------------------------------------------------------------
# FLOPs and parameters
# ----------------------------------------------------------------------------------------------


def _matmul_params(cfg) -> dict[str, int]:
    """Weights that multiply activations, per layer kind and for the head."""
    D = cfg.d_model
    H, K, HV = _kda_dims(cfg)
    kda = (2 * D * H * K + D * HV * K  # q, k, v
           + D * K + K * HV * K  # decay gate, rank K
           + D * HV  # beta
           + D * K + K * HV * K  # output gate, rank V = K
           + HV * K * D)  # output projection
    Hm, rq, R, dn, ds, dv = _mla_dims(cfg)
    q = D * rq + rq * Hm * (dn + ds) if rq else D * Hm * (dn + ds)
    mla = q + D * R + D * ds + R * Hm * dn + R * Hm * dv + Hm * dv * D
    if cfg.mla.output_gate:
        mla += D * Hm * dv
    return {"K": kda, "M": mla, "mlp": 3 * D * cfg.mlp_dim, "head": D * cfg.vocab_size}


def _attn_res_sources(cfg) -> list[int]:
    """Number of sources each depth read mixes (every sublayer, then the final readout)."""
    n_sub = 2 * cfg.num_layers
    if cfg.attn_res == "none":
        return []
    S = 1 if cfg.attn_res == "full" else cfg.attn_res_block_size
    return [1 + l // S + (1 if l % S else 0) for l in range(n_sub + 1)]


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs (forward + backward = 3 x forward) per token at sequence length seq_len.

    Counts: every weight matmul (2 FLOPs per weight per token, the output head included, the
    embedding lookup not); KDA's chunked core, HV * (6 K^2 + 3 C K + C^2) per token (notes/kda.md,
    C = chunk size); causal MLA attention over on average (seq_len + 1) / 2 keys,
    2 H (dn + ds + dv) per key; and the Attention Residual reads, 4 D per source. Norms,
    convolutions and elementwise work are left out.
    """
    if not (_is_int(seq_len) and seq_len > 0):
        raise ValueError(f"flops_per_token: seq_len must be a positive integer, got {seq_len!r}")
    pattern = layer_pattern(cfg)
    n_k, n_m = pattern.count("K"), pattern.count("M")
    p = _matmul_params(cfg)
    fwd = 2.0 * (n_k * p["K"] + n_m * p["M"] + cfg.num_layers * p["mlp"] + p["head"])
    _, K, HV = _kda_dims(cfg)
    C = cfg.kda.chunk_size
    fwd += n_k * HV * (6 * K * K + 3 * C * K + C * C)
    Hm, _, _, dn, ds, dv = _mla_dims(cfg)
    fwd += n_m * 2.0 * Hm * (dn + ds + dv) * (seq_len + 1) / 2
    fwd += 4.0 * cfg.d_model * sum(_attn_res_sources(cfg))
    return 3.0 * fwd


def count_params(cfg) -> int:
    """Parameter count from ``nnx.eval_shape`` (allocates nothing; fine for K3)."""
    abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


def _query(q: DepthQuery | None) -> jax.Array | None:
    return None if q is None else q.w[...]


class DecoderLayer(nnx.Module):
    """One layer = mixer sublayer (KDA for kind "K", Gated MLA for "M") + SwiGLU sublayer.

    Each sublayer reads its input from the depth residual (plain sum or Attention Residuals),
    applies RMSNorm then itself, and writes its output back.
    """

    def __init__(self, kind: str, cfg, *, rngs: nnx.Rngs):
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        D = cfg.d_model
        self.kind = kind
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=pdtype)
        self.mixer_norm = RMSNorm(D, **norm)
        if kind == "K":
            H, K, HV = _kda_dims(cfg)
            k = cfg.kda
            self.mixer = KDALayer(
                D, num_heads=H, head_dim=K, num_v_heads=HV, conv_width=k.conv_width,
                gate=k.gate, gate_lower_bound=k.gate_lower_bound, chunk_size=k.chunk_size,
                impl=k.impl, rngs=rngs, dtype=dtype, param_dtype=pdtype,
            )
        elif kind == "M":
            H, rq, R, dn, ds, dv = _mla_dims(cfg)
            self.mixer = GatedMLA(
                D, num_heads=H, q_lora_rank=rq, kv_lora_rank=R, qk_nope_head_dim=dn,
                shared_head_dim=ds, v_head_dim=dv, output_gate=cfg.mla.output_gate,
                attn_impl=cfg.mla.attn_impl, attn_block_size=cfg.mla.attn_block_size,
                rngs=rngs, dtype=dtype, param_dtype=pdtype,
            )
        else:
            raise ValueError(f"DecoderLayer: kind must be 'K' or 'M', got {kind!r}")
        self.mlp_norm = RMSNorm(D, **norm)
        self.mlp = SwiGLU(D, cfg.mlp_dim, rngs=rngs, dtype=dtype, param_dtype=pdtype)
        if cfg.attn_res != "none":
            self.mixer_query = DepthQuery(D, param_dtype=pdtype)
            self.mlp_query = DepthQuery(D, param_dtype=pdtype)
        else:
            self.mixer_query = self.mlp_query = None

    def init_cache(self, batch_size: int, max_len: int) -> dict[str, jax.Array]:
        if self.kind == "K":
            return self.mixer.init_cache(batch_size)
        return self.mixer.init_cache(batch_size, max_len)

    def __call__(self, state, depth: DepthResidual, segment_ids_BxT=None, cache=None, pos=0):
        """(depth state, cache or None) -> (depth state, new cache or None)."""
        h_BxTxD = depth.read(state, _query(self.mixer_query))
        if self.kind == "K":
            out_BxTxD, cache = self.mixer(self.mixer_norm(h_BxTxD), segment_ids_BxT, cache)
        else:
            out_BxTxD, cache = self.mixer(self.mixer_norm(h_BxTxD), segment_ids_BxT, cache, pos)
        state = depth.write(state, constrain(out_BxTxD, BTD))
        h_BxTxD = depth.read(state, _query(self.mlp_query))
        state = depth.write(state, constrain(self.mlp(self.mlp_norm(h_BxTxD)), BTD))
        return state, cache


class LayerGroup(nnx.Module):
    """The repeating unit of the pattern (e.g. "KKKM"): one step of the scan over depth."""

    def __init__(self, unit: str, cfg, *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(kind, cfg, rngs=rngs) for kind in unit])

    def init_cache(self, batch_size: int, max_len: int) -> tuple:
        return tuple(layer.init_cache(batch_size, max_len) for layer in self.layers)

    def __call__(self, state, depth, segment_ids_BxT=None, caches=None, pos=0):
        new_caches = []
        for i, layer in enumerate(self.layers):
            state, c = layer(state, depth, segment_ids_BxT, None if caches is None else caches[i],
                             pos)
            new_caches.append(c)
        return state, (None if caches is None else tuple(new_caches))


class HybridLM(nnx.Module):
    """The language model. ``cfg`` is the ``config.model`` ConfigDict (validated here).

    ``model(tokens_BxT, segment_ids_BxT=None) -> logits_BxTxV`` (float32) for training;
    ``init_cache`` / ``prefill`` / ``step`` for evaluation in pieces and decoding.

    Build it inside ``nnx.jit`` / ``jax.jit`` (or ``sharding.create_sharded``), not eagerly: each
    initialiser would otherwise compile on its own. On CPU, ``nnx.Rngs(jax.random.key(seed,
    impl="rbg"))`` compiles the initialisers several times faster than the default threefry
    keys (XLA:CPU is slow to compile threefry: 15 s against 3.5 s for one KDA layer here).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        validate_model_config(cfg)
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        D = cfg.d_model
        self.pattern = layer_pattern(cfg)
        self.unit, self.repeats, tail = scan_plan(self.pattern, cfg.scan_layers)
        self.remat = cfg.remat
        self.depth = DepthResidual(cfg.attn_res, 2 * cfg.num_layers, cfg.attn_res_block_size,
                                   cfg.norm_eps)
        self.embed = Embed(cfg.vocab_size, D, rngs=rngs, dtype=dtype, param_dtype=pdtype)
        if self.repeats:
            unit = self.unit

            @nnx.split_rngs(splits=self.repeats)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_groups(rngs):
                return LayerGroup(unit, cfg, rngs=rngs)

            self.groups = make_groups(rngs)
        else:
            self.groups = None
        self.tail = nnx.List([DecoderLayer(kind, cfg, rngs=rngs) for kind in tail])
        self.final_query = DepthQuery(D, param_dtype=pdtype) if cfg.attn_res != "none" else None
        self.final_norm = RMSNorm(D, eps=cfg.norm_eps, dtype=dtype, param_dtype=pdtype)
        self.head = None if cfg.tie_embeddings else OutputHead(
            D, cfg.vocab_size, rngs=rngs, dtype=dtype, param_dtype=pdtype)

    # -- the stack --------------------------------------------------------------------------

    def _maybe_remat(self, fn, training: bool):
        if not training or self.remat == "none":
            return fn
        return nnx.remat(fn, policy=REMAT_POLICIES[self.remat], prevent_cse=False)

    def _forward(self, x_BxTxD, segment_ids_BxT, cache):
        if x_BxTxD.ndim != 3:
            raise ValueError(f"HybridLM: embeddings must be [B, T, D], got shape {x_BxTxD.shape}")
        if segment_ids_BxT is not None and segment_ids_BxT.shape != x_BxTxD.shape[:2]:
            raise ValueError(f"HybridLM: segment_ids {segment_ids_BxT.shape} must be [B, T] = "
                             f"{x_BxTxD.shape[:2]}")
        training = cache is None
        pos = 0 if training else cache["pos"]
        depth = self.depth
        state = depth.init(constrain(x_BxTxD, BTD))
        # Same structure as init_cache, so a jitted prefill compiles once for every piece.
        new_cache = None if training else {"pos": pos + x_BxTxD.shape[1], "groups": None,
                                           "tail": ()}

        if self.groups is not None:
            def group_step(group, state, caches):
                return group(state, depth, segment_ids_BxT, caches, pos)

            group_step = self._maybe_remat(group_step, training)

            @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def scan_groups(group, state, caches):
                return group_step(group, state, caches)

            state, group_caches = scan_groups(self.groups, state,
                                              None if training else cache["groups"])
            if not training:
                new_cache["groups"] = group_caches

        tail_caches = []
        for i, layer in enumerate(self.tail):
            def layer_step(layer, state, c):
                return layer(state, depth, segment_ids_BxT, c, pos)

            state, c = self._maybe_remat(layer_step, training)(
                layer, state, None if training else cache["tail"][i])
            tail_caches.append(c)
        if not training:
            new_cache["tail"] = tuple(tail_caches)

        h_BxTxD = self.final_norm(depth.read(state, _query(self.final_query)))
        if self.head is None:
            logits_BxTxV = self.embed.attend(h_BxTxD)
        else:
            logits_BxTxV = self.head(h_BxTxD)
        return constrain(logits_BxTxV.astype(jnp.float32), BTV), new_cache

    # -- public API -------------------------------------------------------------------------

    def _embed(self, tokens_BxT):
        if tokens_BxT.ndim != 2:
            raise ValueError(f"HybridLM: tokens must be [B, T], got shape {tokens_BxT.shape}")
        return self.embed(tokens_BxT)

    def __call__(self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None):
        """Training forward: logits [B, T, V] float32. ``segment_ids`` [B, T] int marks packed
        documents: no token sees another document (KDA state resets, MLA masks, convs mask)."""
        return self._forward(self._embed(tokens_BxT), segment_ids_BxT, None)[0]

    def from_embeddings(self, x_BxTxD: jax.Array, segment_ids_BxT: jax.Array | None = None):
        """The forward from input embeddings [B, T, D] instead of tokens (soft prompts, and
        gradients with respect to each input position)."""
        return self._forward(x_BxTxD.astype(self.embed.dtype), segment_ids_BxT, None)[0]

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """Empty cache for ``batch_size`` rows of up to ``max_len`` tokens:

        {"pos": int32 scalar (tokens seen so far),
         "groups": per layer of the scanned unit, its cache stacked over the repeats,
         "tail": per unrolled layer, its cache}
        KDA layer cache: state [B, HV, K, V] f32, conv_q / conv_k / conv_v [B, W-1, heads, dim];
        MLA layer cache: latent_kv [B, max_len, kv_lora_rank + shared_head_dim] (compute dtype).
        """
        cache = {"pos": jnp.zeros((), jnp.int32), "groups": None, "tail": ()}
        if self.groups is not None:
            # Cache shapes depend on static attributes only: any slice of the stack will do.
            one = self.groups.init_cache(batch_size, max_len)
            cache["groups"] = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (self.repeats, *x.shape)), one)
        cache["tail"] = tuple(layer.init_cache(batch_size, max_len) for layer in self.tail)
        return cache

    def prefill(self, tokens_BxT: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """Continues the cached sequences with T more tokens (positions pos .. pos+T-1).

        Returns (logits [B, T, V] float32, the cache after them). pos + T must not exceed the
        cache's max_len (MLA writes its latents there).
        """
        return self._forward(self._embed(tokens_BxT), None, cache)

    def step(self, token_B: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """One decoding step: ``prefill`` of one token. Returns (logits [B, V] float32, cache)."""
        logits_Bx1xV, cache = self.prefill(token_B[:, None], cache)
        return logits_Bx1xV[:, 0], cache
