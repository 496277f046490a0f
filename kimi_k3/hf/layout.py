r"""Which tensor of a Kimi Linear checkpoint is which of our parameters, and how it is reshaped.

Two weight layouts are read (``LAYOUTS``, told apart by ``detect_layout``): "released", the one
of the published checkpoints and the one ``save_pretrained`` writes (``self_attn.q_conv1d`` /
``f_a_proj`` / ``A_log`` ..., ``block_sparse_moe.experts.<e>.w1 / w2 / w3``), and
"transformers", the module layout ``KimiLinearForCausalLM.state_dict()`` has after its
conversion mapping (``self_attn.conv1d`` stacking q, k, v; ``self_attn.forget_gate.*``;
``mlp.experts.gate_up_proj`` / ``down_proj``). Export writes "released", as ``save_pretrained``
does (``_hf_tensors``). The tensors (torch Linear weights are [out, in], our Dense kernels
[in, *out]; ``_layer_links``):

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

A ``Link`` is one parameter of one layer: the HF tensors it comes from, each with its expected
shape, and the function that builds it (of routed experts, only the rows asked for). ``_plan``
gives every leaf of our parameter tree its links, one per layer for a leaf stacked over the
scan (``_leaf_layers`` numbers the layers as transformers does); a parameter with no link (an
option transformers lacks) is a ValueError. ``model_from_params`` puts read parameters into a
``HybridLM``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_k3.config import ModelSpec, model_spec
from kimi_k3.layers.moe import ZEROED_STATE, ExpertBias
from kimi_k3.model import HybridLM

LAYOUTS = ("released", "transformers")
# A dense FFN's weights as save_pretrained names them (the published checkpoints say "mlp.").
DENSE_UNDER_MOE = r"^(model\.layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$"


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


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def model_from_params(model_config, params: dict, biases: dict) -> HybridLM:
    """A HybridLM holding ``params`` and ``biases`` (pure dicts); its other state (the MoE
    measurements a forward pass overwrites, the empty gradient sums) zeros."""
    spec = model_spec(model_config)
    abstract = nnx.eval_shape(lambda: HybridLM(spec, rngs=nnx.Rngs(0)))
    graphdef, abs_params, abs_biases, abs_rest = nnx.split(abstract, nnx.Param, ExpertBias, ...)
    nnx.replace_by_pure_dict(abs_params, params)
    if biases:
        nnx.replace_by_pure_dict(abs_biases, biases)
    abs_stats, abs_other = nnx.split_state(abs_rest, ZEROED_STATE, ...)
    if jax.tree.leaves(abs_other):
        raise ValueError("kimi_k3.hf: HybridLM holds state that is neither a parameter, a "
                         "routing bias, a MoE measurement nor a gradient sum; the importer "
                         "does not know it")
    device = jax.devices()[0]
    stats = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=device), abs_stats)
    return nnx.merge(graphdef, abs_params, abs_biases, stats, abs_other)


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
