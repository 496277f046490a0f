"""The internals report (kimi_k3/internals.py): each statistic against a direct float64
computation, on tiny models whose weights make the answer known (a constant KDA gate gives its
exact timescale, zero MLA queries read uniformly, zero Attention Residual queries mix
uniformly, a zero router sends every token to the largest biases); finite for every layer;
written by the trainer to metrics.jsonl and PNGs; compared across checkpoints by eval.py; and
the training step the same program whether it is on or off."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from kimi_k3 import evaluation, internals, plots, train_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import model as model_lib
from kimi_k3.config import run_spec
from kimi_k3.layers import kda_layer, mla
from kimi_k3.model import HybridLM
from tests.helpers import build, load_config, run_once_compiles, tiny_config
from tests.kda_numpy import kda_numpy


def with_weights(model: HybridLM, edit) -> HybridLM:
    """A copy of ``model`` whose state, as a flat {path: numpy array} dict, ``edit`` changed."""
    graphdef, state = nnx.split(model)
    flat = {k: np.array(v) for k, v in
            traverse_util.flatten_dict(nnx.to_pure_dict(state)).items()}
    edit(flat)
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(
        {k: jnp.asarray(v) for k, v in flat.items()}))
    return nnx.merge(graphdef, state)


def documents(rng, B: int, T: int, pad: int = 0) -> np.ndarray:
    """Segment ids [B, T]: each row random documents (ids 1, 2, ...), its last ``pad`` tokens
    padding (id 0)."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T - pad), size=rng.integers(1, 4), replace=False))
        seg[b, :T - pad] = 1 + np.searchsorted(cuts, np.arange(T - pad), side="right")
    return seg


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def source_counts(num_layers: int, block: int) -> list[int]:
    """Sources each Attention Residual read mixes, by walking the blocks: b_0, the finished
    blocks and the current block's partial sum once it holds a sublayer."""
    counts, finished, in_block = [], 0, 0
    for _ in range(2 * num_layers):
        counts.append(1 + finished + (1 if in_block else 0))
        in_block += 1
        if in_block == block:
            finished, in_block = finished + 1, 0
    return counts + [1 + finished + (1 if in_block else 0)]


# ---------------------------------------------------------------------------------------------
# The statistics alone
# ---------------------------------------------------------------------------------------------


def test_document_end_state_norms_follow_the_recurrence(rng):
    """||S||_F at each document's last token (and at a row's end) equals the float64
    recurrence run on that document alone (tests/kda_numpy.py), for two layers at once, with
    grouped value heads."""
    L, B, T, H, HV, K, V = 2, 2, 24, 1, 2, 8, 8
    k = rng.standard_normal((L, B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((L, B, T, HV, V))
    g = -5.0 * sigmoid(rng.standard_normal((L, B, T, HV, K)))
    beta = sigmoid(rng.standard_normal((L, B, T, HV)))
    seg = documents(rng, B, T, pad=3)
    norms = np.asarray(jax.jit(internals.state_norms)(
        *(jnp.asarray(x, jnp.float32) for x in (k, v, g, beta)), jnp.asarray(seg)))
    ends = np.asarray(internals.document_ends(jnp.asarray(seg)))
    want_ends = []
    for b in range(B):
        for doc in np.unique(seg[b][seg[b] > 0]):
            t = np.flatnonzero(seg[b] == doc)
            want_ends.append((b, t[-1]))
            for layer in range(L):
                k_, v_, g_, beta_ = (x[layer, b:b + 1, t[0]:t[-1] + 1] for x in (k, v, g, beta))
                _, S = kda_numpy(k_, k_, v_, g_, beta_)
                np.testing.assert_allclose(norms[layer, b, t[-1]],
                                           np.linalg.norm(S[0], axis=(-2, -1)), rtol=1e-4)
    assert sorted(zip(*np.nonzero(ends), strict=True)) == sorted(want_ends)


def test_attention_statistics_match_a_direct_softmax(rng):
    """Entropy and attended distance per head against a float64 softmax over each query's own
    document, in query blocks that do not divide the tokens; padding queries left out."""
    B, T, H, Q, scale = 2, 37, 3, 8, 0.4
    q, k = (rng.standard_normal((B, T, H, Q)) for _ in range(2))
    seg = documents(rng, B, T, pad=4)
    ent, dist = jax.jit(internals.attention_stats, static_argnums=(3, 4))(
        jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(seg), scale, 8)
    sum_e, sum_d, n = np.zeros(H), np.zeros(H), 0
    for b in range(B):
        for i in np.flatnonzero(seg[b] > 0):
            j = np.flatnonzero((seg[b] == seg[b, i]) & (np.arange(T) <= i))
            s = np.einsum("hd,jhd->hj", q[b, i], k[b, j]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            sum_e += -(p * np.log(p)).sum(-1)
            sum_d += (p * (i - j)).sum(-1)
            n += 1
    np.testing.assert_allclose(ent, sum_e / n, rtol=1e-4)
    np.testing.assert_allclose(dist, sum_d / n, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Whole models with known weights
# ---------------------------------------------------------------------------------------------


def test_known_weights_give_known_statistics_in_a_scanned_stack(rng):
    """"KMKM" scanned as "KM" x 2, block Attention Residuals, a mixture of experts in every
    layer. KDA's gate projection zeroed: each channel decays by the constant g = g_min
    sigmoid(exp(A_log) dt_bias), so tau = -1/g exactly, layer by layer; beta and the output
    gate of layer 1 (whose input is the normalised embedding alone) from the weights directly;
    MLA's queries zeroed: every token reads its document's past uniformly (entropy log n,
    distance (n - 1) / 2); the depth queries zeroed: every read mixes its sources uniformly;
    the router zeroed: every token's scores tie, so the bias alone chooses, and all B T tokens
    go to the top_k largest biases. All finite."""
    cfg = tiny_config("KMKM")
    cfg.model.kda.impl = "recurrent"
    E, k = 4, 2
    m = cfg.model.moe
    m.num_experts, m.top_k, m.expert_dim, m.first_k_dense = E, k, 16, 0
    model = build(cfg.model, int(rng.integers(2**31)))
    spec = model.spec
    assert (spec.scan_unit, spec.scan_repeats, spec.scan_tail) == ("KM", 2, "")
    HV, K = spec.kda.num_v_heads, spec.kda.head_dim
    A_log = rng.normal(0.0, 0.5, (2, HV))
    dt_bias = rng.normal(0.0, 2.0, (2, HV, K))
    bias = rng.permutation(E * 4).reshape(2, 2, E) * 0.1  # [position in unit, repeat, E]
    layer = lambda i: ("groups", "layers", i)

    def edit(w):
        w[layer(0) + ("mixer", "f_up", "kernel")][...] = 0.0
        w[layer(0) + ("mixer", "A_log")], w[layer(0) + ("mixer", "dt_bias")] = A_log, dt_bias
        w[layer(1) + ("mixer", "q_proj", "kernel")][...] = 0.0
        for i in (0, 1):
            w[layer(i) + ("mlp", "router", "kernel")][...] = 0.0
            w[layer(i) + ("mlp", "bias")] = bias[i]
        for path, value in w.items():
            if path[-2:-1] in (("mixer_query",), ("mlp_query",), ("final_query",)):
                value[...] = 0.0

    model = with_weights(model, edit)
    B, T = 3, 40
    tokens = rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32)
    seg = documents(rng, B, T, pad=5)
    stats = internals.measure_model(model, {"tokens": tokens, "segment_ids": seg})
    metrics = internals.flat_metrics(stats, spec)
    valid = seg > 0

    # KDA: the exact timescales of layers 1 and 3 (repeats 0 and 1 of the scan)
    g_min = spec.kda.lower_bound
    for r, n in enumerate((1, 3)):
        tau = -1.0 / (g_min * sigmoid(np.exp(A_log[r])[:, None] * dt_bias[r]))
        want = np.quantile(tau.reshape(-1), internals.QUANTILES)
        got = [metrics[f"kda_tau_{q}/layer{n}"] for q in internals.QUANTILE_NAMES]
        np.testing.assert_allclose(got, want, rtol=1e-4)
        assert metrics[f"kda_tau_max/layer{n}"] == pytest.approx(tau.max(), rel=1e-4)
    # beta and the output gate of layer 1, from its input RMSNorm(embedding)
    w = {p: np.asarray(v, np.float64) for p, v in
         traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model))).items()}
    layer1 = lambda *p: w[layer(0) + p][0]
    x1 = rms_norm(w[("embed", "embedding")][tokens], layer1("mixer_norm", "scale"), spec.norm_eps)
    beta = sigmoid(x1 @ layer1("mixer", "b_proj", "kernel"))[valid]
    assert metrics["kda_beta_mean/layer1"] == pytest.approx(beta.mean(), rel=1e-4)
    np.testing.assert_allclose([metrics[f"kda_beta_{q}/layer1"] for q in internals.QUANTILE_NAMES],
                               np.quantile(beta, internals.QUANTILES), rtol=1e-4)
    gate = sigmoid(np.einsum("btr,rhv->bthv", x1 @ layer1("mixer", "g_down", "kernel"),
                             layer1("mixer", "g_up", "kernel")))[valid]
    assert metrics["kda_out_gate_mean/layer1"] == pytest.approx(gate.mean(), rel=1e-4)
    np.testing.assert_allclose(
        [metrics[f"kda_out_gate_{q}/layer1"] for q in internals.QUANTILE_NAMES],
        np.quantile(gate.mean(0).reshape(-1), internals.QUANTILES), rtol=1e-4)
    # MLA: uniform reads of each document's past
    n_keys = np.concatenate([np.arange(1, (seg[b] == d).sum() + 1) for b in range(B)
                             for d in np.unique(seg[b][seg[b] > 0])]).astype(np.float64)
    for n in (2, 4):
        for h in range(spec.mla.num_heads):
            assert metrics[f"mla_entropy/layer{n}/head{h}"] == pytest.approx(
                np.log(n_keys).mean(), rel=1e-4)
            assert metrics[f"mla_distance/layer{n}/head{h}"] == pytest.approx(
                ((n_keys - 1) / 2).mean(), rel=1e-4)
    # Attention Residuals: uniform over the sources each read has
    readers = [f"layer{i // 2 + 1}.{'mixer' if i % 2 == 0 else 'ffn'}" for i in range(8)]
    for reader, count in zip(readers + ["final"], source_counts(4, 2), strict=True):
        got = [metrics.get(f"attn_res/{reader}/{internals.source_name(j)}") for j in range(5)]
        assert got[count:] == [None] * (5 - count), reader  # no source there yet
        assert got[:count] == pytest.approx([1.0 / count] * count, rel=1e-5), reader
    # the mixture of experts: every token to the top_k largest biases of its layer
    for n in (1, 2, 3, 4):
        b = bias[(n - 1) % 2, (n - 1) // 2]
        load = np.zeros(E)
        load[np.argsort(b)[-k:]] = B * T
        np.testing.assert_allclose(stats["moe"][str(n)]["load"], load)
        assert metrics[f"moe_tokens_min/layer{n}"] == 0
        assert metrics[f"moe_tokens_max/layer{n}"] == B * T
        assert metrics[f"moe_tokens_cv/layer{n}"] == pytest.approx(load.std() / load.mean(),
                                                                   rel=1e-5)
        assert metrics[f"moe_bias_min/layer{n}"] == pytest.approx(b.min(), rel=1e-5, abs=1e-7)
        assert metrics[f"moe_bias_max/layer{n}"] == pytest.approx(b.max(), rel=1e-5)
        assert metrics[f"moe_dropped/layer{n}"] == 0
    assert metrics["kda_state_norm_max/layer3"] >= metrics["kda_state_norm_mean/layer3"] > 0
    assert all(math.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------------------------------------
# Nothing in the training step
# ---------------------------------------------------------------------------------------------


def lowered_step(config) -> tuple[str, train_lib.Setup]:
    """The training step's StableHLO, with its source locations and scope names, and the
    setup it came from."""
    spec = run_spec(config)
    setup = train_lib.build(config, mesh_lib.make_mesh(spec.mesh))
    B, T = spec.data.global_batch_size, spec.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=setup.batch_sharding)
             for k in ("tokens", "segment_ids")}
    with setup.context():
        return setup.train_step.lower(setup.abstract_state, batch).as_text(debug_info=True), setup


def internals_ops(text: str) -> list[str]:
    """The locations in a lowered program's text that come from the internals: an op under
    the "internals" scope, a line of kimi_k3/internals.py or of a capture hook."""
    return re.findall(r'"[^"]*(?:/internals/|kimi_k3/internals\.py|_keep_internals|'
                      r'_keep_read_weights)[^"]*"', text)


def test_the_training_step_is_the_same_program_with_internals_on_or_off(monkeypatch):
    """No capture hook runs while the training step is traced (each would raise), the step's
    program is the same text whether ``train.internals_every`` is 0 or not, and it holds no op
    of the internals (every one of which is named "internals"); a step that did compute them
    would be told apart by both checks."""
    def refuse(*args):
        raise AssertionError(f"a capture hook ran inside the training step: {args[1]}")

    for module in (kda_layer, mla, model_lib):
        monkeypatch.setattr(module, "keep", refuse)
    config = load_config("tiny.py")
    config.model.num_layers, config.model.kda.impl = 2, "recurrent"
    config.data.seq_len, config.data.global_batch_size = 32, 4
    texts = {}
    for every in (0, 3):  # one call site: the text holds the caller's line in its locations
        config.train.internals_every = every
        texts[every], setup = lowered_step(config)
    off = texts[0]
    assert texts[3] == off and not internals_ops(off)
    # the checks see a step that computes the internals beside its update
    monkeypatch.undo()
    measure = jax.jit(lambda state, batch: (
        setup.train_step(state, batch),
        internals.internals_fn(setup.graphdef, setup.rest)(train_lib.model_part(state), batch)))
    batch = {k: jax.ShapeDtypeStruct((4, 32), jnp.int32, sharding=setup.batch_sharding)
             for k in ("tokens", "segment_ids")}
    with setup.context():
        both = measure.lower(setup.abstract_state, batch).as_text(debug_info=True)
    assert internals_ops(both) and both != off


# ---------------------------------------------------------------------------------------------
# The trainer's report and eval.py's comparison
# ---------------------------------------------------------------------------------------------


def test_the_trainer_writes_the_report_and_eval_compares_checkpoints(tmp_path, rng):
    """train.py at each evaluation (internals_every=-1, the default) and at the end: a
    metrics.jsonl line of split "internals" with every layer's statistics, finite, and the
    PNGs in the run folder; then eval.py --internals --noperplexity on two of its checkpoints
    side by side: internals.json, the comparison and per-checkpoint PNGs."""
    docs = [np.append(rng.integers(1, 64, rng.integers(20, 60)), 0) for _ in range(200)]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "corpus.bin")
    config = load_config("tiny.py")
    config.model.vocab_size, config.model.num_layers = 64, 2
    config.model.kda_per_mla, config.model.kda.impl = 1, "recurrent"
    config.data.source, config.data.paths = "tokens", str(tmp_path / "corpus.bin")
    config.data.eos_id, config.data.seq_len, config.data.global_batch_size = 0, 32, 4
    config.train.steps, config.train.log_every, config.train.eval_every = 3, 1, 2
    config.train.eval_batches, config.train.progress_bar = 1, False
    config.checkpoint.every_steps = 2
    run = tmp_path / "run"
    with run_once_compiles():  # 3 steps, 2 evaluations
        train_lib.train(config, str(run))

    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    reports = [r for r in rows if r["split"] == "internals"]
    assert [r["step"] for r in reports] == [2, 3]
    for r in reports:
        for name in ("kda_tau_p50/layer1", "kda_beta_mean/layer1", "kda_out_gate_mean/layer1",
                     "kda_state_norm_mean/layer1", "mla_entropy/layer2/head0",
                     "mla_distance/layer2", "attn_res/final/embed", "kda_tau_p50"):
            assert math.isfinite(r[name]), name
        assert all(math.isfinite(v) for k, v in r.items() if k not in ("step", "split"))
        # an unrolled stack ("KM" does not repeat): each read's weights over its sources
        for reader, count in zip(("layer1.mixer", "layer1.ffn", "layer2.mixer", "layer2.ffn",
                                  "final"), source_counts(2, 4), strict=True):
            got = [r[f"attn_res/{reader}/{internals.source_name(j)}"] for j in range(count)]
            assert sum(got) == pytest.approx(1.0, rel=1e-5) and min(got) > 0, reader
    for name in (internals.PNG_ATTN_RES, internals.PNG_KDA, internals.PNG_MLA):
        assert plots.is_png(run / name), name

    out = tmp_path / "ev"
    with run_once_compiles():
        report = evaluation.main(config, str(out), [f"last={run}", f"early={run}/checkpoints/2"],
                                 [32], progress=False, internals=True, perplexity=False)
    saved = json.loads((out / "internals.json").read_text())
    assert [m["label"] for m in saved["models"]] == ["last", "early"] == [
        m["label"] for m in report["internals"]["models"]]
    assert [m["step"] for m in saved["models"]] == [3, 2]
    assert saved["models"][0]["pattern"] == "KM"
    last, early = (m["metrics"] for m in saved["models"])
    assert last.keys() == early.keys() and last != early
    for name in (internals.PNG_KDA, internals.PNG_MLA_DISTANCE, "internals_attn_res_last.png",
                 "internals_mla_early.png"):
        assert plots.is_png(out / name), name
    assert not (out / "eval.json").exists()  # --noperplexity
