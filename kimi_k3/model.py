"""The K3-style hybrid language model: KDA and Gated MLA layers, SwiGLU or mixture-of-experts
FFNs, Attention Residuals.

    x_0 = Embed(tokens)                                           [B, T, D]
    for each layer l (kind K = KDA or M = Gated MLA, from ``spec.pattern``):
        h = AttnRes_read(sources)            x += Mixer_l(RMSNorm(h))      (sublayer 2l)
        h = AttnRes_read(sources)            x += FFN_l(RMSNorm(h))        (sublayer 2l + 1)
    logits = Head(RMSNorm(AttnRes_read(sources)))                 [B, T, V] float32

FFN_l is the dense SwiGLU, or with ``spec.moe`` the mixture of experts (layers/moe.py) in every
layer after the first ``moe.first_k_dense``, which keep the dense SwiGLU.

With ``attn_res="none"`` the reads are the plain residual stream; otherwise see
layers/attn_res.py. Nothing positional anywhere: KDA's recurrence carries order.

Layer pattern (resolved in kimi_k3/config.py): ``kda_per_mla = r`` gives r KDA layers then one
MLA, repeating; ``final_mla`` makes the last layer MLA; r = 0 is all MLA; an explicit
``pattern`` string ("KKKM...") overrides. Compile time does not grow with depth: the pattern is
split into a repeating unit (e.g. "KKKM"), scanned over with ``nnx.scan`` (parameters stacked
along a "layers" axis), and a short unrolled tail (e.g. K3's final "M"). A mixture of experts'
dense-FFN first layers run unrolled before the scan (``spec.scan_prefix``), so every scanned
layer has the same FFN. ``remat`` rematerialises each scanned unit / unrolled layer.

Decoding: ``init_cache`` / ``prefill`` / ``step`` carry per-layer state (KDA state and conv
tails, MLA latent cache) and a position counter, so a sequence processed in pieces gives the same
logits as in one pass. ``step`` is ``prefill`` of one token in the form a decoding step wants:
every layer unrolled (a scanned model's repeats too), the KDA recurrence's one-token form and
MLA's one-pass read of its latent cache, each cache array updated where it lies, so a jitted
step with the cache donated reads each weight and cache entry once and copies no cache.

The model takes a ``ModelSpec`` (``kimi_k3.config.model_spec(config.model)``), checked once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_k3.config import ModelSpec, model_spec, scan_plan
from kimi_k3.layers.attn_res import DepthQuery, DepthResidual
from kimi_k3.layers.capture import keep
from kimi_k3.layers.embed import Embed, OutputHead, chunked_nll
from kimi_k3.layers.kda_layer import KDALayer
from kimi_k3.layers.mla import GatedMLA
from kimi_k3.layers.mlp import SwiGLU
from kimi_k3.layers.moe import MoE
from kimi_k3.layers.norms import RMSNorm
from kimi_k3.sharding import BTD, BTV, constrain, rules_in_force
from pallas_kernels.device import jit_per_choices

# The mixers by layer letter, and which part of the spec configures each. Every mixer has the
# same constructor and call signature (see KDALayer), so the stack never asks which it holds.
MIXERS = {"K": (KDALayer, "kda"), "M": (GatedMLA, "mla")}

# The cache counts positions in int32 ("pos"): a cached sequence (prefill, decoding) holds at
# most this many tokens. Entry points check lengths against it before anything runs.
MAX_POSITIONS = 2**31 - 1


# ----------------------------------------------------------------------------------------------
# FLOPs and parameters
# ----------------------------------------------------------------------------------------------


def _matmul_params(spec: ModelSpec) -> dict[str, int]:
    """Weights that multiply activations, per layer kind and for the head."""
    D, k, m = spec.d_model, spec.kda, spec.mla
    H, K, HV = k.num_heads, k.head_dim, k.num_v_heads
    kda = (2 * D * H * K + D * HV * K  # q, k, v
           + D * K + K * HV * K  # decay gate, rank K
           + D * HV  # beta
           + D * K + K * HV * K  # output gate, rank V = K
           + HV * K * D)  # output projection
    Hm, rq, R = m.num_heads, m.q_lora_rank, m.kv_lora_rank
    dn, ds, dv = m.qk_nope_head_dim, m.shared_head_dim, m.v_head_dim
    q = D * rq + rq * Hm * (dn + ds) if rq else D * Hm * (dn + ds)
    mla = q + D * R + D * ds + R * Hm * dn + R * Hm * dv + Hm * dv * D
    if m.output_gate:
        mla += D * Hm * dv
    out = {"K": kda, "M": mla, "mlp": 3 * D * spec.mlp_dim, "head": D * spec.vocab_size}
    if spec.moe is not None:  # what one token multiplies: router, k routed and the shared expert
        e = spec.moe  # (LatentMoE: the k routed in the latent width, plus down and up)
        L = e.latent_dim or D
        out["moe"] = (D * e.num_experts + 3 * L * e.top_k * e.expert_dim + 3 * D * e.shared_dim
                      + (2 * D * L if e.latent_dim else 0))
    return out


def ffn_kinds(spec: ModelSpec) -> str:
    """One letter per layer: "d" = dense SwiGLU, "e" = mixture of experts."""
    k = spec.num_layers if spec.moe is None else spec.moe.first_k_dense
    return "d" * k + "e" * (spec.num_layers - k)


def _attn_res_sources(spec: ModelSpec) -> list[int]:
    """Number of sources each depth read mixes (every sublayer, then the final readout)."""
    n_sub = 2 * spec.num_layers
    if spec.attn_res == "none":
        return []
    S = 1 if spec.attn_res == "full" else spec.attn_res_block_size
    return [1 + l // S + (1 if l % S else 0) for l in range(n_sub + 1)]


def layer_numbers(spec: ModelSpec, path: tuple) -> tuple[int, ...]:
    """The 1-based numbers of the layers a model-state path lies in: ("prefix", i, ...) and
    ("tail", j, ...) one layer each, ("groups", "layers", i, ...) one per repeat of the scan
    (its arrays are stacked over them)."""
    n_prefix, n_unit = len(spec.scan_prefix), len(spec.scan_unit)
    if path[0] == "prefix":
        return (int(path[1]) + 1,)
    if path[0] == "groups":
        return tuple(n_prefix + r * n_unit + int(path[2]) + 1 for r in range(spec.scan_repeats))
    if path[0] == "tail":
        return (n_prefix + spec.scan_repeats * n_unit + int(path[1]) + 1,)
    raise ValueError(f"layer_numbers: {path!r} is not inside a layer")


def flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs (forward + backward = 3 x forward) per token at sequence length seq_len.

    ``spec``: a ModelSpec, or the ``config.model`` ConfigDict (checked into one). Counts: every
    weight matmul a token goes through (2 FLOPs per weight per token, the output head included,
    the embedding lookup not; of a mixture of experts the router, the k chosen and the shared
    experts); KDA's chunked core, HV * (6 K^2 + 3 C K + C^2) per token (C = chunk size: the
    intra-chunk scores, the WY products and the state pass); causal MLA attention over on
    average (seq_len + 1) / 2 keys, 2 H (dn + ds + dv) per key; and the Attention Residual
    reads, 4 D per source. Norms, convolutions and elementwise work are left out. The count is
    the same whatever ``matmul_format``: an FP8 run's MFU is on these bf16-equivalent FLOPs,
    against the card's dense bf16 peak.
    """
    spec = model_spec(spec)
    if not (isinstance(seq_len, int) and seq_len > 0):
        raise ValueError(f"flops_per_token: seq_len must be a positive integer, got {seq_len!r}")
    n_k, n_m = spec.pattern.count("K"), spec.pattern.count("M")
    p = _matmul_params(spec)
    ffn = ffn_kinds(spec)
    fwd = 2.0 * (n_k * p["K"] + n_m * p["M"] + ffn.count("d") * p["mlp"]
                 + ffn.count("e") * p.get("moe", 0) + p["head"])
    k, m = spec.kda, spec.mla
    C, K = k.chunk_size, k.head_dim
    fwd += n_k * k.num_v_heads * (6 * K * K + 3 * C * K + C * C)
    fwd += n_m * 2.0 * m.num_heads * (m.qk_nope_head_dim + m.shared_head_dim + m.v_head_dim) * (
        seq_len + 1) / 2
    fwd += 4.0 * spec.d_model * sum(_attn_res_sources(spec))
    return 3.0 * fwd


def count_params(spec: ModelSpec, active: bool = False) -> int:
    """Parameter count from ``nnx.eval_shape`` (allocates nothing; fine for K3). ``spec``: a
    ModelSpec or the ``config.model`` ConfigDict.

    ``active=True``: the parameters one token uses: all of them less, in every mixture-of-experts
    layer, the E - k routed experts it does not choose (the embedding table counts whole, as in
    the published "active" figures). The routing bias is model state, not a parameter."""
    spec = model_spec(spec)
    abstract = nnx.eval_shape(lambda: HybridLM(spec, rngs=nnx.Rngs(0)))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    return total - unused_expert_params(spec) if active else total


def unused_expert_params(spec: ModelSpec) -> int:
    """Routed-expert weights one token leaves out: E - k experts of 3 D F in each MoE layer
    (3 l F in the latent width l with ``moe.latent_dim``)."""
    if spec.moe is None:
        return 0
    e = spec.moe
    per_layer = (e.num_experts - e.top_k) * 3 * (e.latent_dim or spec.d_model) * e.expert_dim
    return ffn_kinds(spec).count("e") * per_layer


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


def _query(q: DepthQuery | None) -> jax.Array | None:
    return None if q is None else q.w[...]


def _keep_read_weights(module: nnx.Module, name: str, depth: DepthResidual, state,
                      query: DepthQuery | None) -> None:
    """Keeps an Attention Residual read's mixing weights [num_slots, B, T] for
    kimi_k3/internals.py (nothing with plain residuals)."""
    if query is not None:
        keep(module, name, depth.weights(state, query.w[...]))


def _apply_module(graphdef, rules, params, rest, args):
    del rules  # a cache key only: the trace reads the rules in force (sharding.constrain)
    module = nnx.merge(graphdef, params, rest)
    out = module(*args)
    return out, nnx.state(module, nnx.Not(nnx.Param))


# Traces kept per kernel choices too (a program for a TPU topology traces afresh).
_apply_module_once = jit_per_choices(_apply_module, static_argnums=(0, 1))


def traced_once(module: nnx.Module, *args):
    """``module(*args)`` as a call of one jitted function keyed by the module's structure and
    the axis rules in force, so the same-shaped layers of one kind in an unrolled stack are traced
    and lowered once per program instead of once per layer (XLA inlines the call: the compiled
    program is the one an inline call gives). State the call writes (a mixture of experts' load
    counts) is written back to ``module``."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    out, rest = _apply_module_once(graphdef, rules_in_force(), params, rest, args)
    nnx.update(module, rest)
    return out


class DecoderLayer(nnx.Module):
    """One layer = mixer sublayer (KDA for kind "K", Gated MLA for "M") + FFN sublayer (the dense
    SwiGLU, or with ``experts`` the mixture of experts of ``spec.moe``).

    Each sublayer reads its input from the depth residual (plain sum or Attention Residuals),
    applies RMSNorm then itself, and writes its output back.
    """

    # Set by kimi_k3/internals.py on its copy of a model: each Attention Residual read then
    # keeps its mixing weights (kimi_k3/layers/capture.py).
    capture_internals = False

    def __init__(self, kind: str, spec: ModelSpec, *, rngs: nnx.Rngs, experts: bool = False):
        dtype, pdtype = spec.compute_dtype, spec.storage_dtype
        D = spec.d_model
        self.kind = kind
        norm = dict(eps=spec.norm_eps, dtype=dtype, param_dtype=pdtype)
        self.mixer_norm = RMSNorm(D, **norm)
        mixer_cls, part = MIXERS[kind]
        self.mixer = mixer_cls(D, getattr(spec, part), rngs=rngs, dtype=dtype, param_dtype=pdtype,
                               fp8=spec.fp8)
        self.mlp_norm = RMSNorm(D, **norm)
        if experts:
            self.mlp = MoE(D, spec.moe, rngs=rngs, dtype=dtype, param_dtype=pdtype, fp8=spec.fp8)
        else:
            self.mlp = SwiGLU(D, spec.mlp_dim, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                              impl=spec.mlp_impl, fp8=spec.fp8)
        if spec.attn_res != "none":
            self.mixer_query = DepthQuery(D, param_dtype=pdtype)
            self.mlp_query = DepthQuery(D, param_dtype=pdtype)
        else:
            self.mixer_query = self.mlp_query = None

    def init_cache(self, batch_size: int, max_len: int) -> dict[str, jax.Array]:
        return self.mixer.init_cache(batch_size, max_len)

    def __call__(self, state, depth: DepthResidual, segment_ids_BxT=None, cache=None, pos=0):
        """(depth state, cache or None) -> (depth state, new cache or None)."""
        if self.capture_internals:
            _keep_read_weights(self, "mixer_read", depth, state, self.mixer_query)
        # Scoring and prefill trace each kind of sublayer once (``traced_once``); training
        # keeps the inline calls its remat policy sees through.
        call = (traced_once if cache is not None and not self.capture_internals
                else lambda module, *args: module(*args))
        x_BxTxD = depth.read_norm(state, _query(self.mixer_query), self.mixer_norm)
        out_BxTxD, cache = call(self.mixer, x_BxTxD, segment_ids_BxT, cache, pos)
        state = depth.write(state, constrain(out_BxTxD, BTD))
        if self.capture_internals:
            _keep_read_weights(self, "mlp_read", depth, state, self.mlp_query)
        x_BxTxD = depth.read_norm(state, _query(self.mlp_query), self.mlp_norm)
        state = depth.write(state, constrain(call(self.mlp, x_BxTxD), BTD))
        return state, cache

    def step(self, state, depth: DepthResidual, cache, pos, layer: int | None = None):
        """One decoding step of this layer, the token at position ``pos``: (depth state, its
        cache after the token), the mixer's ``step`` in place of its sequence form (``layer``:
        the cache is a stack over a scanned model's repeats, this layer's being ``layer``)."""
        x_Bx1xD = depth.read_norm(state, _query(self.mixer_query), self.mixer_norm)
        out_Bx1xD, cache = self.mixer.step(x_Bx1xD, cache, pos, layer)
        state = depth.write(state, out_Bx1xD)
        x_Bx1xD = depth.read_norm(state, _query(self.mlp_query), self.mlp_norm)
        return depth.write(state, self.mlp(x_Bx1xD)), cache


class LayerGroup(nnx.Module):
    """The repeating unit of the pattern (e.g. "KKKM"): one step of the scan over depth."""

    def __init__(self, unit: str, spec: ModelSpec, *, rngs: nnx.Rngs):
        experts = spec.moe is not None
        self.layers = nnx.List([DecoderLayer(kind, spec, rngs=rngs, experts=experts)
                                for kind in unit])

    def init_cache(self, batch_size: int, max_len: int) -> tuple:
        return tuple(layer.init_cache(batch_size, max_len) for layer in self.layers)

    def __call__(self, state, depth, segment_ids_BxT=None, caches=None, pos=0):
        new_caches = []
        for i, layer in enumerate(self.layers):
            state, c = layer(state, depth, segment_ids_BxT, None if caches is None else caches[i],
                             pos)
            new_caches.append(c)
        return state, (None if caches is None else tuple(new_caches))


def _stacked_groups(unit: str, repeats: int, spec: ModelSpec, rngs: nnx.Rngs) -> LayerGroup:
    """``repeats`` copies of the unit's layers built under ``nnx.vmap``: every parameter stacked
    along a leading "layers" axis, each copy from its own split of ``rngs``."""

    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_groups(rngs):
        return LayerGroup(unit, spec, rngs=rngs)

    return make_groups(rngs)


def _unrolled_layers(spec: ModelSpec, rngs: nnx.Rngs) -> list[DecoderLayer]:
    """The layers after the prefix of an unrolled stack (``scan_layers=False``), initialised as
    the scan would initialise them: the repeating unit is built once for all its repeats under
    ``nnx.vmap`` (so its random initialisers compile once, not once per layer;
    benchmarks/init_compile.py times it) and then cut into layers. The same seed gives the
    scanned model's weights, layer for layer."""
    unit, repeats, tail = scan_plan(spec.pattern[len(spec.scan_prefix):], True)
    experts = spec.moe is not None
    layers = []
    if repeats:
        stacked = nnx.to_pure_dict(nnx.state(_stacked_groups(unit, repeats, spec, rngs)))
        # Each unit position's layer structure and variable metadata (no initialisers run),
        # filled with slice r of the stacked values for repeat r.
        shapes = [nnx.split(nnx.eval_shape(lambda kind=kind: DecoderLayer(
            kind, spec, rngs=nnx.Rngs(0), experts=experts))) for kind in unit]
        for r in range(repeats):
            for i, (graphdef, state) in enumerate(shapes):
                nnx.replace_by_pure_dict(
                    state, jax.tree.map(lambda x, r=r: x[r], stacked["layers"][i]))
                layers.append(nnx.merge(graphdef, state, copy=True))  # its own Variables
    return layers + [DecoderLayer(kind, spec, rngs=rngs, experts=experts) for kind in tail]


class HybridLM(nnx.Module):
    """The language model. ``spec``: a ModelSpec, or the ``config.model`` ConfigDict (checked
    into one here, once).

    ``model(tokens_BxT, segment_ids_BxT=None) -> logits_BxTxV`` (float32) for training;
    ``init_cache`` / ``prefill`` / ``step`` for evaluation in pieces and decoding.

    Build it inside ``nnx.jit`` / ``jax.jit`` (or ``sharding.create_sharded``), not eagerly: each
    initialiser would otherwise compile on its own. On CPU, ``nnx.Rngs(jax.random.key(seed,
    impl="rbg"))`` compiles the initialisers several times faster than the default threefry
    keys (XLA:CPU is slow to compile threefry).
    """

    capture_internals = False  # as DecoderLayer's: the final readout's weights (kimi_k3/internals.py)

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        spec = model_spec(spec)
        self.spec = spec
        dtype, pdtype = spec.compute_dtype, spec.storage_dtype
        D = spec.d_model
        self.pattern = spec.pattern
        self.unit, self.repeats = spec.scan_unit, spec.scan_repeats
        self.remat = spec.remat
        self.depth = DepthResidual(spec.attn_res, 2 * spec.num_layers, spec.attn_res_block_size,
                                   spec.norm_eps, spec.attn_res_impl)
        self.embed = Embed(spec.vocab_size, D, rngs=rngs, dtype=dtype, param_dtype=pdtype)
        # Dense-FFN first layers of a mixture of experts, unrolled (empty otherwise).
        self.prefix = nnx.List([DecoderLayer(kind, spec, rngs=rngs) for kind in spec.scan_prefix])
        experts = spec.moe is not None
        if self.repeats:
            self.groups = _stacked_groups(self.unit, self.repeats, spec, rngs)
            tail = [DecoderLayer(kind, spec, rngs=rngs, experts=experts) for kind in spec.scan_tail]
        else:
            self.groups = None
            tail = _unrolled_layers(spec, rngs)
        self.tail = nnx.List(tail)
        self.final_query = DepthQuery(D, param_dtype=pdtype) if spec.attn_res != "none" else None
        self.final_norm = RMSNorm(D, eps=spec.norm_eps, dtype=dtype, param_dtype=pdtype)
        self.head = None if spec.tie_embeddings else OutputHead(
            D, spec.vocab_size, rngs=rngs, dtype=dtype, param_dtype=pdtype)

    # -- the stack --------------------------------------------------------------------------

    def _maybe_remat(self, fn, training: bool):
        if not training or self.remat == "none":
            return fn
        return nnx.remat(fn, policy=self.spec.remat_policy, prevent_cse=False)

    def _unrolled(self, layers, state, depth, segment_ids_BxT, caches, pos, training):
        """Layers one after the other (the prefix before the scan, the tail after it)."""
        new_caches = []
        for i, layer in enumerate(layers):
            def layer_step(layer, state, c):
                return layer(state, depth, segment_ids_BxT, c, pos)

            state, c = self._maybe_remat(layer_step, training)(
                layer, state, None if training else caches[i])
            new_caches.append(c)
        return state, tuple(new_caches)

    def _forward(self, x_BxTxD, segment_ids_BxT, cache):
        if x_BxTxD.ndim != 3:
            raise ValueError(f"HybridLM: embeddings must be [B, T, D], got shape {x_BxTxD.shape}")
        if segment_ids_BxT is not None and segment_ids_BxT.shape != x_BxTxD.shape[:2]:
            raise ValueError(f"HybridLM: segment_ids {segment_ids_BxT.shape} must be [B, T] = "
                             f"{x_BxTxD.shape[:2]}")
        training = cache is None
        pos = 0 if training else cache["pos"]
        depth = self.depth
        # Without a scan every layer is traced on its own, so the Attention Residual state can
        # be a list of separate sources whose block structure is known while tracing.
        state = depth.init(constrain(x_BxTxD, BTD), unrolled=self.groups is None)
        part = lambda key: None if training else cache[key]

        state, prefix_caches = self._unrolled(self.prefix, state, depth, segment_ids_BxT,
                                              part("prefix"), pos, training)
        group_caches = None
        if self.groups is not None:
            def group_step(group, state, caches):
                return group(state, depth, segment_ids_BxT, caches, pos)

            group_step = self._maybe_remat(group_step, training)

            @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def scan_groups(group, state, caches):
                return group_step(group, state, caches)

            state, group_caches = scan_groups(self.groups, state, part("groups"))
        state, tail_caches = self._unrolled(self.tail, state, depth, segment_ids_BxT,
                                            part("tail"), pos, training)
        # Same structure as init_cache, so a jitted prefill compiles once for every piece.
        new_cache = None if training else {"pos": pos + x_BxTxD.shape[1], "prefix": prefix_caches,
                                           "groups": group_caches, "tail": tail_caches}

        if self.capture_internals:
            _keep_read_weights(self, "final_read", depth, state, self.final_query)
        return depth.read_norm(state, _query(self.final_query), self.final_norm), new_cache

    def logits(self, h_BxTxD: jax.Array) -> jax.Array:
        """The output head: final hidden states [B, T, D] -> logits [B, T, V] float32."""
        if self.head is None:
            logits_BxTxV = self.embed.attend(h_BxTxD)
        else:
            logits_BxTxV = self.head(h_BxTxD)
        return constrain(logits_BxTxV.astype(jnp.float32), BTV)

    # -- public API -------------------------------------------------------------------------

    def _embed(self, tokens_BxT):
        if tokens_BxT.ndim != 2:
            raise ValueError(f"HybridLM: tokens must be [B, T], got shape {tokens_BxT.shape}")
        return self.embed(tokens_BxT)

    def __call__(self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None):
        """Training forward: logits [B, T, V] float32. ``segment_ids`` [B, T] int marks packed
        documents: no token sees another document (KDA state resets, MLA masks, convs mask)."""
        return self.logits(self._forward(self._embed(tokens_BxT), segment_ids_BxT, None)[0])

    def from_embeddings(self, x_BxTxD: jax.Array, segment_ids_BxT: jax.Array | None = None):
        """The forward from input embeddings [B, T, D] instead of tokens (soft prompts, and
        gradients with respect to each input position)."""
        return self.logits(
            self._forward(x_BxTxD.astype(self.embed.dtype), segment_ids_BxT, None)[0])

    def token_nll(self, tokens_BxT: jax.Array, targets_BxT: jax.Array,
                  segment_ids_BxT: jax.Array | None = None, cache: dict | None = None):
        """-log p(target_t | tokens_<=t) [B, T] float32 for every position, and the cache after
        the tokens (None when none was given: the training forward).

        The same numbers as ``logsumexp(model(tokens)) - logits[target]``, but the head and the
        loss run ``spec.head_chunk`` tokens of each row at a time (``layers.embed.chunked_nll``),
        so the forward never holds [B, T, V] float32 logits at once: the trainer's loss and
        eval's scoring at long context go through here. With a cache, the tokens continue the
        cached sequence as in ``prefill``.
        """
        h_BxTxD, cache = self._forward(self._embed(tokens_BxT), segment_ids_BxT, cache)
        # Under "full" remat the backward recomputes each chunk's logits; every other policy
        # keeps matmul outputs, the head's included: memory for one head matmul fewer.
        nll_BxT = chunked_nll(h_BxTxD, self.logits, targets_BxT, self.spec.head_chunk,
                              keep_logits=self.spec.remat != "full")
        return nll_BxT, cache

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """Empty cache for ``batch_size`` rows of up to ``max_len`` tokens:

        {"pos": int32 scalar (tokens seen so far),
         "prefix": per unrolled layer before the scan, its cache,
         "groups": per layer of the scanned unit, its cache stacked over the repeats,
         "tail": per unrolled layer after it, its cache}
        KDA layer cache: state [B, HV, K, V] f32, conv_q / conv_k / conv_v [B, W-1, heads, dim];
        MLA layer cache: latent_kv [B, max_len, kv_lora_rank + shared_head_dim] (compute dtype).
        """
        cache = {"pos": jnp.zeros((), jnp.int32), "prefix": (), "groups": None, "tail": ()}
        cache["prefix"] = tuple(layer.init_cache(batch_size, max_len) for layer in self.prefix)
        if self.groups is not None:
            # Cache shapes depend on static attributes only: any slice of the stack will do.
            one = self.groups.init_cache(batch_size, max_len)
            cache["groups"] = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (self.repeats, *x.shape)), one)
        cache["tail"] = tuple(layer.init_cache(batch_size, max_len) for layer in self.tail)
        return cache

    def prefill(self, tokens_BxT: jax.Array, cache: dict,
                last_only: bool = False) -> tuple[jax.Array, dict]:
        """Continues the cached sequences with T more tokens (positions pos .. pos+T-1).

        Returns (logits [B, T, V] float32, the cache after them); with ``last_only``, the
        logits after the last token only, [B, 1, V] (decoding: the head runs on one position,
        not on a whole long prompt piece). pos + T must not exceed the cache's max_len (MLA
        writes its latents there).
        """
        h_BxTxD, cache = self._forward(self._embed(tokens_BxT), None, cache)
        if last_only:
            h_BxTxD = h_BxTxD[:, -1:]
        return self.logits(h_BxTxD), cache

    def step(self, token_B: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """One decoding step, the token after the cached ones: (logits [B, V] float32, the
        cache after it), the numbers of ``prefill(token_B[:, None], cache)`` (tests hold it to
        that, token for token) in the form that makes a step cost what it reads.

        Every layer runs in turn, unrolled, with its mixer's one-token form (``KDALayer.step``,
        ``GatedMLA.step``) and the Attention Residual state as separate sources
        (``DepthResidual.init(unrolled=True)``); a scanned model's repeats too, each with its
        weights sliced from the stack (which XLA may copy: a model built to decode fast has
        ``scan_layers=False``, as configs/1b.py). Each cache array is updated where it lies:
        the KDA states rewritten, one MLA entry written at ``pos``, a scanned model's stacked
        caches written at their repeat, so under ``jit`` with the cache donated no cache is
        copied (tests/test_generate.py counts the compiled step's buffers).
        """
        x_Bx1xD = self._embed(token_B[:, None])
        pos, depth = cache["pos"], self.depth
        state = depth.init(x_Bx1xD, unrolled=True)
        new = {"pos": pos + 1, "prefix": [], "groups": None, "tail": []}
        for layer, c in zip(self.prefix, cache["prefix"], strict=True):
            state, c = layer.step(state, depth, c, pos)
            new["prefix"].append(c)
        if self.groups is not None:
            stacks = list(cache["groups"])
            graphdef, weights = nnx.split(self.groups)
            for r in range(self.repeats):
                group = nnx.merge(graphdef, jax.tree.map(lambda w, r=r: w[r], weights))
                for i, layer in enumerate(group.layers):
                    state, stacks[i] = layer.step(state, depth, stacks[i], pos, layer=r)
            new["groups"] = tuple(stacks)
        for layer, c in zip(self.tail, cache["tail"], strict=True):
            state, c = layer.step(state, depth, c, pos)
            new["tail"].append(c)
        h_Bx1xD = depth.read_norm(state, _query(self.final_query), self.final_norm)
        new["prefix"], new["tail"] = tuple(new["prefix"]), tuple(new["tail"])
        return self.logits(h_Bx1xD)[:, 0], new
