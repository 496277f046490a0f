"""Inside the hybrid: per-layer statistics of one forward pass over a fixed held-out batch.

    stats = jax.jit(internals_fn(graphdef, rest))(model_part, batch)   # small arrays, per layer
    metrics = flat_metrics(stats)           # {"kda_tau_p50/layer3": 41.2, ...} for metrics.jsonl
    write_plots(stats, spec, workdir)       # internals_*.png

The trainer runs this every ``train.internals_every`` steps (default: at each held-out
evaluation) in a jitted function of its own, never inside the training step; ``eval.py
--internals`` runs it for several checkpoints side by side (``compare``). The model's layers
keep what is needed only on the copy made here (``kimi_k3/layers/capture.py``): a model that
does not capture runs the programs it ran before the hooks existed.

The batch: the first ``rows`` rows (``internals_rows``: 8, or a multiple of the data-parallel
devices) of the held-out split, cut at ``data.seq_len`` as the trainer's evaluation cuts them.
A token counts where its segment id is > 0 (every token of packed data). Per layer (numbers
1-based, as in the pattern string):

KDA (g the per-channel log-decay, so exp g is the share of the state a channel keeps per token):

    tau_{h,d} = -1 / mean_t g_{t,h,d}      tokens until channel d of value head h keeps 1/e of
                                           what it held (exp(n mean g) = 1/e at n = tau); capped
                                           at TAU_CAP (a gate that does not decay at all)
    kda_tau_{p5,p25,p50,p75,p95,max}       quantiles over the HV x K channels, and the largest
    kda_beta_{mean,p5,...,p95}             the write strength beta over tokens x value heads
    kda_out_gate_{mean,p5,...,p95}         the output gate sigmoid(x W_gd W_gu): its mean over
                                           everything, quantiles over the HV x V channels of each
                                           channel's mean over the tokens
    kda_state_norm_{mean,max}              ||S||_F per value head at the last token of every
                                           document (or of the row, where a document is cut),
                                           from the token-by-token recurrence (the definition,
                                           kimi_k3/ops/kda_recurrent.py) on the captured k, v, g,
                                           beta, in float32: mean and max over documents x heads

MLA, per head h, from its queries and keys (plain JAX, never the attention kernels), with
p_ij = softmax_j(q_i . k_j / sqrt(dn + ds)) over the keys j <= i of token i's document:

    mla_entropy/layer<n>/head<h>           mean_i  -sum_j p_ij log p_ij      (nats; a uniform
                                           read of n keys gives log n)
    mla_distance/layer<n>/head<h>          mean_i   sum_j p_ij (i - j)       (tokens back)
    mla_entropy/layer<n>, mla_distance/layer<n>    their means over the heads

Attention Residuals (modes "block" and "full"): each read's softmax weights over its sources,
averaged over the tokens: ``attn_res/<reader>/<source>`` with reader ``layer<n>.mixer``,
``layer<n>.ffn`` or ``final`` and source ``embed`` (b_0) or ``block<j>`` (block j, the current
one being its partial sum; in mode "full" a block is one sublayer). Only sources that exist at
that read are written.

Mixture of experts, per MoE layer, from the forward's own measurements (``MoeStat``) and the
routing bias: ``moe_tokens_{min,max,mean,cv}`` (token-expert assignments per expert, cv =
std / mean), ``moe_bias_{min,max}`` and ``moe_dropped`` (assignments over capacity).

Stack-wide, shown on the console: ``kda_tau_p50`` (median over the KDA layers of theirs),
``kda_beta_mean``, ``mla_entropy`` and ``mla_distance`` (means over the MLA layers),
``moe_tokens_cv`` (largest over the MoE layers).

PNGs (``write_plots``): ``internals_attn_res.png`` (reader x source heat map),
``internals_kda_timescales.png`` (tau quantiles against the layer, log scale),
``internals_mla.png`` (each MLA layer's heads: mean distance against entropy) and
``internals_moe_load.png`` (layer x expert, load over the mean load).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from kimi_k3 import plots
from kimi_k3.config import ModelSpec
from kimi_k3.layers.capture import Captured
from kimi_k3.layers.moe import ExpertBias, MoeStat
from kimi_k3.model import HybridLM, layer_numbers
from kimi_k3.model_state import merge_model

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
QUANTILE_NAMES = ("p5", "p25", "p50", "p75", "p95")
ROWS = 8  # held-out rows per report (rounded up to a multiple of the data-parallel devices)
TAU_CAP = 1e9  # tokens: the timescale of a channel whose mean log-decay is 0 (or above -1e-9)
QUERY_BLOCK = 128  # queries per step of the attention statistics: [B, H, 128, T] at a time

PNG_ATTN_RES = "internals_attn_res.png"
PNG_KDA = "internals_kda_timescales.png"
PNG_MLA = "internals_mla.png"
PNG_MOE = "internals_moe_load.png"
PNG_MLA_DISTANCE = "internals_mla_distance.png"  # eval.py's comparison of several models


def internals_rows(batch_size: int, data_parallel: int, available: int) -> int:
    """Rows of the held-out batch: ``ROWS`` rounded up to a multiple of the data-parallel
    devices, at most one global batch and at most the ``available`` held-out rows (rounded
    down); 0 when not even one row per device is held out."""
    n = min(batch_size, -(-ROWS // data_parallel) * data_parallel)
    return min(n, available // data_parallel * data_parallel)


# ---------------------------------------------------------------------------------------------
# The statistics (pure functions of arrays; each held to a direct computation in the tests)
# ---------------------------------------------------------------------------------------------


def masked_quantiles(x: jax.Array, mask: jax.Array, qs: Sequence[float] = QUANTILES) -> jax.Array:
    """Quantiles (linear interpolation, as ``numpy.quantile``) of the entries of ``x`` where
    ``mask`` (broadcast to x) holds, [len(qs)] float32; NaN when none does."""
    x = jnp.where(jnp.broadcast_to(mask, x.shape), x.astype(jnp.float32), jnp.nan)
    return jnp.nanquantile(x.reshape(-1), jnp.asarray(qs, jnp.float32))


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``x`` over the entries where ``mask`` (broadcast to x) holds."""
    m = jnp.broadcast_to(mask, x.shape)
    return jnp.sum(jnp.where(m, x.astype(jnp.float32), 0.0)) / jnp.maximum(jnp.sum(m), 1)


def decay_timescales(g_BxTxHVxK: jax.Array, valid_BxT: jax.Array) -> jax.Array:
    """tau [HV, K] = -1 / (mean over valid tokens of g), capped at TAU_CAP."""
    w_BxT = valid_BxT.astype(jnp.float32)
    mean_g_HVxK = jnp.einsum("bthk,bt->hk", g_BxTxHVxK.astype(jnp.float32), w_BxT,
                             precision=jax.lax.Precision.HIGHEST) / jnp.maximum(w_BxT.sum(), 1.0)
    return 1.0 / jnp.maximum(-mean_g_HVxK, 1.0 / TAU_CAP)


def kda_layer_stats(g_BxTxHVxK, beta_BxTxHV, gate_BxTxHVxV, valid_BxT) -> dict[str, jax.Array]:
    """One KDA layer's timescales, write strengths and output gate (module docstring)."""
    tau_HVxK = decay_timescales(g_BxTxHVxK, valid_BxT)
    tok_BxTx1 = valid_BxT[..., None]
    w_BxT = valid_BxT.astype(jnp.float32)
    gate_HVxV = jnp.einsum("bthv,bt->hv", gate_BxTxHVxV.astype(jnp.float32), w_BxT,
                           precision=jax.lax.Precision.HIGHEST) / jnp.maximum(w_BxT.sum(), 1.0)
    return {
        "tau_q": jnp.quantile(tau_HVxK.reshape(-1), jnp.asarray(QUANTILES, jnp.float32)),
        "tau_max": jnp.max(tau_HVxK),
        "beta_mean": masked_mean(beta_BxTxHV, tok_BxTx1),
        "beta_q": masked_quantiles(beta_BxTxHV, tok_BxTx1),
        "out_gate_mean": masked_mean(gate_BxTxHVxV, tok_BxTx1[..., None]),
        "out_gate_q": jnp.quantile(gate_HVxV.reshape(-1), jnp.asarray(QUANTILES, jnp.float32)),
    }


def document_ends(segment_ids_BxT: jax.Array) -> jax.Array:
    """bool [B, T]: the last token of each document in its row (a document the row cuts ends
    at the row's last token)."""
    seg = segment_ids_BxT
    nxt = jnp.concatenate([seg[:, 1:], jnp.zeros_like(seg[:, :1])], axis=1)
    last = jnp.arange(seg.shape[1]) == seg.shape[1] - 1
    return (seg > 0) & ((nxt != seg) | last[None, :])


def state_norms(k_LxBxTxHxK, v_LxBxTxHVxV, g_LxBxTxHVxK, beta_LxBxTxHV,
                segment_ids_BxT) -> jax.Array:
    """||S_t||_F [L, B, T, HV] after every token t, for L KDA layers at once: the recurrence
    S <- Diag(exp g_t) S; S <- S + beta_t k_t (v_t - S^T k_t)^T, restarting at each new
    document, in float32 (``lax.scan`` over the tokens; k is repeated over its G = HV / H
    value heads)."""
    f32 = jnp.float32
    L, B, T, H, K = k_LxBxTxHxK.shape
    HV, V = v_LxBxTxHVxV.shape[3:]
    seg = segment_ids_BxT
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    restart_TxB = (seg != prev).T
    time_major = lambda x: jnp.moveaxis(x.astype(f32), 2, 0)  # [T, L, B, ...]
    k = time_major(jnp.repeat(k_LxBxTxHxK, HV // H, axis=3))
    xs = (k, time_major(v_LxBxTxHVxV), time_major(g_LxBxTxHVxK), time_major(beta_LxBxTxHV),
          restart_TxB)
    hi = jax.lax.Precision.HIGHEST

    def step(S, x):
        k_t, v_t, g_t, beta_t, restart_B = x
        S = jnp.where(restart_B[None, :, None, None, None], 0.0, S)
        S = S * jnp.exp(g_t)[..., None]
        pred = jnp.einsum("lbhk,lbhkv->lbhv", k_t, S, precision=hi)
        S = S + beta_t[..., None, None] * k_t[..., None] * (v_t - pred)[..., None, :]
        return S, jnp.sqrt(jnp.sum(S * S, axis=(-2, -1)))

    _, norms_TxLxBxHV = jax.lax.scan(step, jnp.zeros((L, B, HV, K, V), f32), xs)
    return jnp.moveaxis(norms_TxLxBxHV, 0, 2)


def attention_stats(q_BxTxHxQ: jax.Array, k_BxTxHxQ: jax.Array, segment_ids_BxT: jax.Array,
                    scale: float, block: int = QUERY_BLOCK) -> tuple[jax.Array, jax.Array]:
    """(entropy [H], mean attended distance [H]) of causal softmax attention inside documents,
    averaged over the valid queries (module docstring), ``block`` queries at a time so that
    no [B, H, T, T] array is built."""
    B, T, H, _ = q_BxTxHxQ.shape
    block = min(block, T)
    n = -(-T // block)
    pad = n * block - T
    seg = segment_ids_BxT.astype(jnp.int32)
    q = jnp.pad(q_BxTxHxQ, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_seg = jnp.pad(seg, ((0, 0), (0, pad)))
    k_pos = jnp.arange(T)

    def one_block(i):
        q_BxCxHxQ = jax.lax.dynamic_slice_in_dim(q, i * block, block, axis=1)
        qs_BxC = jax.lax.dynamic_slice_in_dim(q_seg, i * block, block, axis=1)
        q_pos = i * block + jnp.arange(block)
        s_BxHxCxT = jnp.einsum("bchd,bthd->bhct", q_BxCxHxQ, k_BxTxHxQ,
                               preferred_element_type=jnp.float32) * scale
        allowed_BxCxT = ((k_pos[None, None, :] <= q_pos[None, :, None])
                         & (qs_BxC[:, :, None] == seg[:, None, :]) & (qs_BxC[:, :, None] > 0))
        allowed = allowed_BxCxT[:, None]
        s = jnp.where(allowed, s_BxHxCxT, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # a query with no key (padding) reads nothing
        e = jnp.where(allowed, jnp.exp(s - m), 0.0)
        z = jnp.sum(e, axis=-1, keepdims=True)
        p = e / jnp.maximum(z, 1e-30)
        lse = (m + jnp.log(jnp.maximum(z, 1e-30)))[..., 0]
        entropy_BxHxC = lse - jnp.sum(p * jnp.where(allowed, s_BxHxCxT, 0.0), axis=-1)
        dist = (q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)
        distance_BxHxC = jnp.sum(p * dist, axis=-1)
        return entropy_BxHxC, distance_BxHxC

    ent_NxBxHxC, dist_NxBxHxC = jax.lax.map(one_block, jnp.arange(n))
    to_BxHxT = lambda x: jnp.moveaxis(x, 0, 2).reshape(B, H, n * block)[:, :, :T]
    valid_Bx1xT = (seg > 0)[:, None, :]
    count = jnp.maximum(jnp.sum(seg > 0), 1)
    mean_H = lambda x: jnp.sum(jnp.where(valid_Bx1xT, to_BxHxT(x), 0.0), axis=(0, 2)) / count
    return mean_H(ent_NxBxHxC), mean_H(dist_NxBxHxC)


def load_stats(load_E: jax.Array) -> dict[str, jax.Array]:
    """Assignments per expert: min, max, mean and coefficient of variation (std / mean)."""
    load = load_E.astype(jnp.float32)
    mean = jnp.mean(load)
    return {"tokens_min": jnp.min(load), "tokens_max": jnp.max(load), "tokens_mean": mean,
            "tokens_cv": jnp.std(load) / jnp.maximum(mean, 1e-9)}


# ---------------------------------------------------------------------------------------------
# The forward pass that captures, and its statistics (one jitted function)
# ---------------------------------------------------------------------------------------------


def _layered(flat: Mapping[tuple, jax.Array], spec: ModelSpec, module: str | None,
             names: Sequence[str]) -> tuple[tuple[int, ...], dict[str, jax.Array]]:
    """(layer numbers, {name: array [L, ...]}) of the arrays ``names`` kept by each layer's
    ``module`` ("mixer", "mlp"; None: the layer itself), in layer order. A scanned path holds
    one slice per repeat; an unrolled one gets a layer axis of 1."""
    depth = 1 if module is None else 2
    paths = sorted({p[:-depth] for p in flat if len(p) > depth and p[-1] == names[0]
                    and (module is None or p[-2] == module)},
                   key=lambda p: layer_numbers(spec, p)[0])
    numbers, arrays = [], {name: [] for name in names}
    for path in paths:
        nums = layer_numbers(spec, path)
        numbers += nums
        for name in names:
            a = flat[path + ((module,) if module else ()) + (name,)]
            arrays[name].append(a if path[0] == "groups" else a[None])
    if not numbers:
        return (), {}
    order = np.argsort(numbers, kind="stable")
    return (tuple(int(numbers[i]) for i in order),
            {n: jnp.concatenate(a)[order] for n, a in arrays.items()})


def capture(model: HybridLM, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array) -> dict:
    """Runs the training-form forward of ``model`` (a copy made inside a jitted function: it is
    changed) with its capture hooks on; returns {state path: array} of what the layers kept,
    with the mixture of experts' measurements (``MoeStat``) and routing biases."""
    model.set_attributes(capture_internals=True)
    targets_BxT = jnp.zeros_like(tokens_BxT)
    model.token_nll(tokens_BxT, targets_BxT, segment_ids_BxT)  # its head is dead code: dropped
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.pop(model, Captured)))
    for kind in (MoeStat, ExpertBias):
        flat.update(traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, kind))))
    return flat


@jax.named_scope("internals")  # every op of it named so (the training step has none)
def measure(model: HybridLM, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array) -> dict:
    """The statistics of the module docstring for one batch, as a nested dict of small arrays:
    {"kda": {"<layer>": {...}}, "mla": {"<layer>": {"entropy" [H], "distance" [H]}},
    "attn_res": {"<reader>": weights [num_slots]}, "moe": {"<layer>": {...}}}; kinds the model
    lacks are left out. Traceable: call it inside ``jax.jit`` (``internals_fn``)."""
    spec = model.spec
    flat = capture(model, tokens_BxT, segment_ids_BxT)
    valid_BxT = segment_ids_BxT > 0
    out = {}
    nums, kda = _layered(flat, spec, "mixer", ("log_decay", "beta", "out_gate", "k", "v"))
    if nums:
        per = jax.vmap(kda_layer_stats, in_axes=(0, 0, 0, None))(
            kda["log_decay"], kda["beta"], kda["out_gate"], valid_BxT)
        norms_LxBxTxHV = state_norms(kda["k"], kda["v"], kda["log_decay"], kda["beta"],
                                     segment_ids_BxT)
        ends_BxTxHV = jnp.broadcast_to(document_ends(segment_ids_BxT)[..., None],
                                       norms_LxBxTxHV.shape[1:])
        per["state_norm_mean"] = jax.vmap(masked_mean, in_axes=(0, None))(norms_LxBxTxHV,
                                                                         ends_BxTxHV)
        per["state_norm_max"] = jnp.max(jnp.where(ends_BxTxHV, norms_LxBxTxHV, 0.0),
                                        axis=(1, 2, 3))
        out["kda"] = {str(n): jax.tree.map(lambda a, i=i: a[i], per)
                      for i, n in enumerate(nums)}
    nums, mla = _layered(flat, spec, "mixer", ("q", "k"))
    if nums:
        scale = (spec.mla.qk_nope_head_dim + spec.mla.shared_head_dim) ** -0.5
        ent_LxH, dist_LxH = jax.lax.map(
            lambda qk: attention_stats(qk[0], qk[1], segment_ids_BxT, scale),
            (mla["q"], mla["k"]))
        out["mla"] = {str(n): {"entropy": ent_LxH[i], "distance": dist_LxH[i]}
                      for i, n in enumerate(nums)}
    if spec.attn_res != "none":
        reads = {}
        for key, name in (("mixer_read", "mixer"), ("mlp_read", "ffn")):
            nums, a = _layered(flat, spec, None, (key,))
            for i, n in enumerate(nums):
                reads[f"layer{n}.{name}"] = a[key][i]
        reads["final"] = flat[("final_read",)]
        out["attn_res"] = {r: jax.vmap(masked_mean, in_axes=(0, None))(a_NxBxT, valid_BxT)
                           for r, a_NxBxT in reads.items()}
    nums, moe = _layered(flat, spec, "mlp", ("load", "dropped", "bias"))
    if nums:
        per = jax.vmap(load_stats)(moe["load"])
        per.update(load=moe["load"], dropped=moe["dropped"], bias_min=moe["bias"].min(-1),
                   bias_max=moe["bias"].max(-1))
        out["moe"] = {str(n): jax.tree.map(lambda a, i=i: a[i], per) for i, n in enumerate(nums)}
    return out


def internals_fn(graphdef, rest):
    """internals(model, batch) -> ``measure``'s dict, to be jitted: ``model`` the trainer's
    ``{"params"[, "model_state"]}`` (``train_lib.model_part``), ``batch`` {"tokens",
    "segment_ids"} [B, T]. The model is merged afresh inside, so the caller's is never
    changed."""

    def internals(model, batch):
        merged = merge_model(graphdef, model["params"], rest, model.get("model_state"))
        return measure(merged, batch["tokens"], batch["segment_ids"])

    return internals


def measure_model(model: HybridLM, batch: Mapping[str, np.ndarray],
                  compiled: dict | None = None) -> dict:
    """``measure`` of a ready model (eval.py: a restored checkpoint on one device) on a host
    batch, jitted; host numpy arrays out. ``compiled`` ({graphdef: jitted function}, the
    caller's) lets models of one architecture share one compilation."""
    graphdef, state = nnx.split(model)
    # Committed to one device whether restored there or initialised: one program for both.
    state = jax.device_put(state, jax.devices()[0])
    compiled = {} if compiled is None else compiled
    if graphdef not in compiled:
        compiled[graphdef] = jax.jit(lambda state, tokens, segs: measure(
            nnx.merge(graphdef, state, copy=True), tokens, segs))
    out = compiled[graphdef](state, jnp.asarray(batch["tokens"]),
                             jnp.asarray(batch["segment_ids"]))
    return jax.tree.map(np.asarray, jax.device_get(out))


# ---------------------------------------------------------------------------------------------
# Host side: names, a summary, plots
# ---------------------------------------------------------------------------------------------


def _layer_key(n: str) -> int:
    return int(n)


def _reader_order(reader: str) -> tuple[int, int]:
    if reader == "final":
        return (10**9, 0)
    layer, part = reader.split(".")
    return (int(layer[len("layer"):]), 0 if part == "mixer" else 1)


def source_name(slot: int) -> str:
    """Attention Residual slot -> its name in the metrics: 0 "embed", j "block<j>"."""
    return "embed" if slot == 0 else f"block{slot}"


def attn_res_sources(spec: ModelSpec) -> dict[str, int]:
    """Reader name -> how many sources it mixes (model._attn_res_sources, by name)."""
    S = 1 if spec.attn_res == "full" else spec.attn_res_block_size
    readers = [f"layer{l // 2 + 1}.{'mixer' if l % 2 == 0 else 'ffn'}"
               for l in range(2 * spec.num_layers)] + ["final"]
    return {r: 1 + l // S + (1 if l % S else 0) for l, r in enumerate(readers)}


def flat_metrics(stats: Mapping, spec: ModelSpec) -> dict[str, float]:
    """``measure``'s dict (host arrays) as {stable name: float} (module docstring's names),
    stack-wide summaries first."""
    f = lambda x: float(np.asarray(x))
    per: dict[str, float] = {}
    summary: dict[str, float] = {}
    kda = stats.get("kda", {})
    for n in sorted(kda, key=_layer_key):
        s = kda[n]
        for q, v in zip(QUANTILE_NAMES, np.asarray(s["tau_q"]), strict=True):
            per[f"kda_tau_{q}/layer{n}"] = f(v)
        per[f"kda_tau_max/layer{n}"] = f(s["tau_max"])
        for part in ("beta", "out_gate"):
            per[f"kda_{part}_mean/layer{n}"] = f(s[f"{part}_mean"])
            for q, v in zip(QUANTILE_NAMES, np.asarray(s[f"{part}_q"]), strict=True):
                per[f"kda_{part}_{q}/layer{n}"] = f(v)
        for part in ("mean", "max"):
            per[f"kda_state_norm_{part}/layer{n}"] = f(s[f"state_norm_{part}"])
    if kda:
        summary["kda_tau_p50"] = float(np.median([np.asarray(s["tau_q"])[2] for s in kda.values()]))
        summary["kda_beta_mean"] = float(np.mean([f(s["beta_mean"]) for s in kda.values()]))
    mla = stats.get("mla", {})
    for n in sorted(mla, key=_layer_key):
        for part in ("entropy", "distance"):
            heads = np.asarray(mla[n][part])
            per[f"mla_{part}/layer{n}"] = float(heads.mean())
            per.update({f"mla_{part}/layer{n}/head{h}": float(v) for h, v in enumerate(heads)})
    if mla:
        for part in ("entropy", "distance"):
            summary[f"mla_{part}"] = float(np.mean([np.asarray(s[part]).mean()
                                                    for s in mla.values()]))
    reads = stats.get("attn_res", {})
    if reads:
        counts = attn_res_sources(spec)
        for r in sorted(reads, key=_reader_order):
            w = np.asarray(reads[r])
            per.update({f"attn_res/{r}/{source_name(j)}": float(w[j])
                        for j in range(counts[r])})
    moe = stats.get("moe", {})
    for n in sorted(moe, key=_layer_key):
        s = moe[n]
        for key in ("tokens_min", "tokens_max", "tokens_mean", "tokens_cv", "bias_min",
                    "bias_max", "dropped"):
            per[f"moe_{key}/layer{n}"] = f(s[key])
    if moe:
        summary["moe_tokens_cv"] = max(f(s["tokens_cv"]) for s in moe.values())
    return {**summary, **per}


def _layers(section: Mapping) -> list[str]:
    return sorted(section, key=_layer_key)


def attn_res_grid(stats: Mapping, spec: ModelSpec) -> tuple[list[str], list[str], np.ndarray]:
    """(reader labels, source labels, weights [readers, slots] with NaN where no source is)."""
    reads = stats["attn_res"]
    readers = sorted(reads, key=_reader_order)
    counts = attn_res_sources(spec)
    slots = len(np.asarray(reads[readers[0]]))
    grid = np.full((len(readers), slots), np.nan)
    for i, r in enumerate(readers):
        grid[i, :counts[r]] = np.asarray(reads[r])[:counts[r]]
    return readers, [source_name(j) for j in range(slots)], grid


def write_plots(stats: Mapping, spec: ModelSpec, folder: str, title: str = "",
                suffix: str = "") -> list[str]:
    """The PNGs of the module docstring for one model, in ``folder`` (``suffix`` before
    ".png": one set per checkpoint in eval.py); returns their paths. Each replaces its file
    whole (a viewer never reads half a picture)."""
    head = f"{title}: " if title else ""
    out = []

    def save(fig, name):
        path = os.path.join(folder, name.replace(".png", f"{suffix}.png"))
        tmp = path + ".tmp"
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
        out.append(path)

    if stats.get("attn_res"):
        readers, sources, grid = attn_res_grid(stats, spec)
        R, C = grid.shape
        save(plots.heatmap_figure(
            grid, row_labels=_thin(readers), col_labels=sources, annotate=R * C <= 400,
            title=f"{head}Attention Residual weights\n(mean over tokens)",
            xlabel="source (embed = b0; block j: its sublayers' sum)", ylabel="reading sublayer",
            colorbar_label="softmax weight", figsize=_grid_size(R, C)), PNG_ATTN_RES)
    kda = stats.get("kda", {})
    if kda:
        layers = _layers(kda)
        xs = [int(n) for n in layers]
        tau = np.array([np.asarray(kda[n]["tau_q"]) for n in layers])  # [L, q]
        series = {f"tau {q}": (xs, tau[:, i].tolist()) for i, q in enumerate(QUANTILE_NAMES)}
        series["tau max"] = (xs, [float(np.asarray(kda[n]["tau_max"])) for n in layers])
        save(_integer_x(plots.line_figure(
            series, title=f"{head}KDA memory timescales per layer", xlabel="layer",
            ylabel="tau = -1 / mean log-decay (tokens)", logy=True,
            note="quantiles over each layer's value heads x channels; tau is the number of "
                 "tokens after which a channel keeps 1/e of its state")), PNG_KDA)
    mla = stats.get("mla", {})
    if mla:
        series = {f"layer {n}": (np.asarray(mla[n]["entropy"]).tolist(),
                                 np.asarray(mla[n]["distance"]).tolist()) for n in _layers(mla)}
        save(_scatter_figure(series, title=f"{head}MLA heads: how far back and how spread",
                             xlabel="attention entropy (nats)",
                             ylabel="mean attended distance (tokens)"), PNG_MLA)
    moe = stats.get("moe", {})
    if moe:
        layers = _layers(moe)
        load = np.array([np.asarray(moe[n]["load"]) for n in layers])
        rel = load / np.maximum(load.mean(-1, keepdims=True), 1e-9)
        E = rel.shape[1]
        save(plots.heatmap_figure(
            rel, row_labels=_thin([f"layer {n}" for n in layers]),
            col_labels=_thin([str(e) for e in range(E)], 24),
            title=f"{head}expert load (assignments over the layer's mean)", xlabel="expert",
            ylabel="MoE layer", vmin=0.0, vmax=max(2.0, float(np.nanmax(rel))),
            colorbar_label="load / mean load", annotate=len(layers) * E <= 200,
            figsize=_grid_size(len(layers), E)), PNG_MOE)
    return out


def _integer_x(fig):
    """``fig`` with whole numbers only on its x axis (layers)."""
    from matplotlib.ticker import MaxNLocator

    fig.axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _thin(labels: Sequence[str], most: int = 48) -> list[str]:
    """Every k-th label kept (the others blank) so that at most about ``most`` are written:
    a heat map of K3's 187 readers or 896 experts stays readable."""
    k = -(-len(labels) // most)
    return [label if i % k == 0 else "" for i, label in enumerate(labels)]


def _grid_size(rows: int, cols: int) -> tuple[float, float]:
    """A heat map's size in inches: cells as plots.heatmap draws them, within 16 x 12."""
    return (min(16.0, max(4.5, 1.0 + 0.9 * cols)), min(12.0, max(3.0, 1.4 + 0.45 * rows)))


def _scatter_figure(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, title: str,
                    xlabel: str, ylabel: str):
    """One marker set per series ({label: (xs, ys)}): points, no lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, linestyle="none", marker="o", markersize=5, label=str(label))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.35)
    ax.legend(fontsize=8)
    plots.finish(fig)
    return fig


# ---------------------------------------------------------------------------------------------
# Several models side by side (eval.py --internals)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """One checkpoint's internals: its label, where it came from, its spec and statistics."""

    label: str
    checkpoint: str
    step: int | None
    spec: ModelSpec
    stats: dict


def file_label(label: str) -> str:
    """A label as a file-name part: anything but letters, digits, '-' and '.' becomes '_'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", label).strip("_") or "model"


def compare_table(reports: Sequence[ModelReport]) -> str:
    """One line per checkpoint: its pattern, the KDA layers' median tau (the median over
    layers of each layer's p50), their mean beta, the MLA layers' mean entropy and distance."""
    cells = [("model", "pattern", "KDA tau p50", "KDA beta", "MLA entropy", "MLA distance")]
    for r in reports:
        m = flat_metrics(r.stats, r.spec)
        cells.append((r.label, r.spec.pattern, *(f"{m[k]:.4g}" if k in m else "-" for k in (
            "kda_tau_p50", "kda_beta_mean", "mla_entropy", "mla_distance"))))
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in cells)


def write_comparison(reports: Sequence[ModelReport], folder: str, batch_rows: int,
                     seq_len: int) -> dict:
    """eval.py's internals outputs in ``folder``: ``internals.json`` (per checkpoint its
    metrics under the trainer's names), ``internals_kda_timescales.png`` and
    ``internals_mla_distance.png`` (one line per checkpoint against the layer), and each
    checkpoint's own PNGs with ``_<label>`` before ".png". Returns the JSON-able report."""
    os.makedirs(folder, exist_ok=True)
    report = {"rows": batch_rows, "seq_len": seq_len, "quantiles": list(QUANTILES),
              "models": []}
    kda_series, kda_bands, mla_series, files = {}, {}, {}, []
    for r in reports:
        report["models"].append({"label": r.label, "checkpoint": r.checkpoint, "step": r.step,
                                 "pattern": r.spec.pattern,
                                 "metrics": flat_metrics(r.stats, r.spec)})
        kda, mla = r.stats.get("kda", {}), r.stats.get("mla", {})
        if kda:
            xs = [int(n) for n in _layers(kda)]
            q = np.array([np.asarray(kda[n]["tau_q"]) for n in _layers(kda)])
            kda_series[r.label] = (xs, q[:, 2].tolist())
            kda_bands[r.label] = (q[:, 1].tolist(), q[:, 3].tolist())
        if mla:
            mla_series[r.label] = ([int(n) for n in _layers(mla)],
                                   [float(np.asarray(mla[n]["distance"]).mean())
                                    for n in _layers(mla)])
        files += write_plots(r.stats, r.spec, folder, title=r.label,
                             suffix=f"_{file_label(r.label)}")
    if kda_series:
        files.append(plots.save(_integer_x(plots.line_figure(
            kda_series, bands=kda_bands, logy=True,
            title="KDA memory timescales: median channel per layer (shaded: p25 to p75)",
            xlabel="layer", ylabel="tau (tokens)")), os.path.join(folder, PNG_KDA)))
    if mla_series:
        files.append(plots.save(_integer_x(plots.line_figure(
            mla_series, title="MLA: mean attended distance per layer (mean over heads)",
            xlabel="layer", ylabel="tokens back")),
            os.path.join(folder, PNG_MLA_DISTANCE)))
    report["files"] = [os.path.basename(f) for f in files]
    return report
