"""eval.py's machinery: perplexity, piecewise vs whole-sequence scoring, the short-document rule,
outputs (JSON, CSV, valid PNGs), checkpoint errors, and the long-context memory benchmark."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import eval_scoring, evaluation, plots
from kimi_k3.checkpoint import Checkpointer, restore_model_for_eval
from kimi_k3.model import HybridLM
from kimi_k3.model_state import split_model
from tests.helpers import build, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UniformModel:
    """Follows the HybridLM contract; every logit is 0, so every token has probability 1/V."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def init_cache(self, batch_size, max_len):
        return {"pos": jnp.zeros((), jnp.int32)}

    def prefill(self, tokens_BxT, cache):
        return jnp.zeros((*tokens_BxT.shape, self.vocab_size)), {"pos": cache["pos"] + tokens_BxT.shape[1]}

    def __call__(self, tokens_BxT):
        return jnp.zeros((*tokens_BxT.shape, self.vocab_size))




def random_docs(rng, lengths, vocab):
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


# ---------------------------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------------------------


def test_uniform_logits_score_perplexity_equal_to_vocab_size(rng, tmp_path):
    V = 37
    docs = random_docs(rng, [100, 40, 250], V)
    opts = eval_scoring.EvalOptions(context_lengths=(16, 64), piece_len=8, batch_size=2,
                                    short_docs="concat", max_windows=0)
    report = evaluation.run(tiny_config(vocab=V), [evaluation.CheckpointSpec("init", "uniform")], opts,
                            str(tmp_path), docs=docs, models={"uniform": UniformModel(V)}, progress=False)
    for L in ("16", "64"):
        r = report["models"][0]["results"][L]
        assert r["perplexity"] == pytest.approx(V, rel=1e-5)
        assert all(b["loss"] == pytest.approx(math.log(V), rel=1e-5) for b in r["buckets"])
        assert sum(b["targets"] for b in r["buckets"]) == r["targets"] == r["windows_used"] * int(L)


@pytest.fixture(scope="module")
def tiny_model():
    """One small real HybridLM and windows [2, 49]: every real-model test here uses these
    shapes, so the jitted functions compile once (they are shared per architecture)."""
    cfg = tiny_config("KKM")
    tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, 49)).astype(np.int32)
    return cfg, build(cfg.model, 1), tokens


def test_real_model_with_zero_weights_scores_vocab_size(tiny_model):
    """The real HybridLM, every parameter zeroed, gives uniform logits through prefill pieces."""
    cfg, model, tokens = tiny_model
    graphdef, state = nnx.split(model)
    zeroed = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, state))
    nll = eval_scoring.Scorer(zeroed).piecewise_nll(tokens, piece_len=16)
    assert nll.shape == (2, 48)
    np.testing.assert_allclose(np.exp(nll.mean()), cfg.model.vocab_size, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Piecewise (cache carried) against the whole-sequence pass
# ---------------------------------------------------------------------------------------------


def test_piecewise_matches_whole_sequence(tiny_model):
    cfg, model, tokens = tiny_model
    scorer = eval_scoring.Scorer(model)
    whole = scorer.whole_sequence_nll(tokens)
    pieces = scorer.piecewise_nll(tokens, piece_len=16)
    assert pieces.shape == whole.shape == (2, 48)
    np.testing.assert_allclose(pieces, whole, atol=2e-5, rtol=2e-5)
    # 40 tokens in pieces of 16: the last piece is padded to 16 (the cache to 48). Causality:
    # the first 40 NLLs of the whole pass are the reference.
    padded = scorer.piecewise_nll(tokens[:, :41], piece_len=16)
    np.testing.assert_allclose(padded, whole[:, :40], atol=2e-5, rtol=2e-5)
    # And through evaluate_windows, which also reports the difference it measured.
    windows = eval_scoring.make_windows(list(tokens), 48, "skip")
    opts = eval_scoring.EvalOptions((48,), piece_len=16, batch_size=2, whole_check_max_len=64)
    res = eval_scoring.evaluate_windows(scorer, windows, opts)
    assert res["whole_vs_piecewise_max_abs_nll_diff"] < 1e-4
    assert res["loss"] == pytest.approx(float(whole.mean()), rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(float(whole.mean())), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Windows, the short-document rule, position buckets
# ---------------------------------------------------------------------------------------------


def test_short_document_rule_counts():
    docs = [np.arange(n, dtype=np.int32) for n in (5, 17, 33, 8)]
    skip = eval_scoring.make_windows(docs, 8, "skip")
    # Windows of 9 tokens with stride 8: 5 -> 0 (skipped), 17 -> 2, 33 -> 4, 8 -> 0 (skipped).
    assert (skip.docs_total, skip.docs_skipped, skip.docs_used, skip.num_windows) == (4, 2, 2, 6)
    np.testing.assert_array_equal(skip.tokens_NxL1[1], np.arange(8, 17))
    assert "2 of 4 documents shorter than 9 tokens skipped" in skip.describe()

    concat = eval_scoring.make_windows(docs, 8, "concat")
    assert concat.num_windows == (5 + 17 + 33 + 8 - 1) // 8 == 7
    assert concat.docs_skipped == 0 and concat.docs_used == 4
    np.testing.assert_array_equal(concat.tokens_NxL1[0], np.concatenate(docs)[:9])

    # Against the plain definition, with empty and one-token documents among random ones.
    rng = np.random.default_rng(0)
    many = [rng.integers(0, 9, n).astype(np.int32) for n in rng.integers(0, 30, 40)] + [np.zeros(0, np.int32)]
    stream = np.concatenate(many)
    for L in (1, 7, 16):
        w = eval_scoring.make_windows(many, L, "concat")
        expect = np.stack([stream[i * L : i * L + L + 1] for i in range((len(stream) - 1) // L)])
        np.testing.assert_array_equal(w.tokens_NxL1, expect)
        s = eval_scoring.make_windows(many, L, "skip", max_windows=5)
        assert s.num_windows == min(5, s.windows_available)
        assert all(any(np.array_equal(row, d[j : j + L + 1]) for d in many for j in range(0, len(d) - L, L))
                   for row in s.tokens_NxL1)

    capped = eval_scoring.make_windows(docs, 8, "concat", max_windows=3)
    assert (capped.num_windows, capped.windows_available) == (3, 7)
    none = eval_scoring.make_windows(docs, 64, "skip")
    assert none.num_windows == 0 and none.docs_skipped == 4
    with pytest.raises(ValueError, match="short_docs"):
        eval_scoring.make_windows(docs, 8, "truncate")


def test_position_buckets_are_log_spaced_and_cover_every_position():
    assert eval_scoring.position_buckets(10) == [(1, 1), (2, 3), (4, 7), (8, 10)]
    b = eval_scoring.position_buckets(2048)
    assert b[-2:] == [(1024, 2047), (2048, 2048)]
    assert sum(hi - lo + 1 for lo, hi in b) == 2048


# ---------------------------------------------------------------------------------------------
# Outputs: console table, JSON, CSV, PNGs; one line per checkpoint
# ---------------------------------------------------------------------------------------------


class UnigramModel(UniformModel):
    """Logits = log of fixed token frequencies: a second, different line on the plots."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.logp = jnp.log(jnp.linspace(1.0, 2.0, vocab_size) / jnp.linspace(1.0, 2.0, vocab_size).sum())

    def prefill(self, tokens_BxT, cache):
        logits, cache = super().prefill(tokens_BxT, cache)
        return logits + self.logp, cache

    def __call__(self, tokens_BxT):
        return super().__call__(tokens_BxT) + self.logp


def test_outputs_written_and_plots_are_valid_pngs(rng, tmp_path, capsys):
    V = 64
    docs = random_docs(rng, [300, 20, 90], V)
    specs = [evaluation.CheckpointSpec.parse("uniform=init"), evaluation.CheckpointSpec.parse("unigram=init")]
    models = {"uniform": UniformModel(V), "unigram": UnigramModel(V)}
    opts = eval_scoring.EvalOptions((16, 48, 128), piece_len=16, batch_size=2, short_docs="skip")
    report = evaluation.run(tiny_config(vocab=V), specs, opts, str(tmp_path), docs=docs, models=models,
                            progress=False)
    out = capsys.readouterr().out
    assert "short_docs=skip: 1 of 3 documents shorter than 49 tokens skipped" in out
    assert "L=128" in out and "perplexity" in out

    with open(tmp_path / "eval.json") as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(report))
    assert saved["short_docs"] == "skip" and [m["label"] for m in saved["models"]] == ["uniform", "unigram"]
    assert saved["windows"]["128"]["docs_skipped"] == 2 and saved["windows"]["128"]["windows_used"] == 2
    with open(tmp_path / "eval_perplexity.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["label"], r["context_length"]) for r in rows} == {
        (m, L) for m in ("uniform", "unigram") for L in ("16", "48", "128")}
    with open(tmp_path / "eval_loss_by_position.csv") as f:
        assert {int(r["position_hi"]) for r in csv.DictReader(f) if r["context_length"] == "128"} == {
            1, 3, 7, 15, 31, 63, 127, 128}
    for name in ("eval_perplexity.png", "eval_loss_by_position.png"):
        assert plots.is_png(tmp_path / name)


def test_plot_is_a_png_matplotlib_can_read(tmp_path):
    import matplotlib.image

    path = plots.line_plot(tmp_path / "p.png", {"a": ([1, 2, 4], [3.0, 2.0, float("nan")])},
                           title="t", xlabel="x", ylabel="y", logx=True, token_axis=True)
    assert plots.is_png(path)
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    (tmp_path / "bad.png").write_bytes(b"not a png at all, just bytes....")
    assert not plots.is_png(tmp_path / "bad.png")


# ---------------------------------------------------------------------------------------------
# Checkpoints: restore, a missing path, a config that does not match
# ---------------------------------------------------------------------------------------------


def _save_checkpoint(cfg, run_dir, step=3):
    """A checkpoint in the trainer's layout (<run>/checkpoints/<step>/state with "params")."""
    graphdef, params, rest = split_model(build(cfg.model, 7))
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoint)
    ckpt.save(step, {"params": params, "step": jnp.asarray(step, jnp.int32)}, {"position": 0})
    ckpt.close()
    return params


def test_restore_checkpoint_and_errors_name_the_problem(tmp_path):
    cfg = tiny_config("KKM")
    cfg.checkpoint.async_save = False
    run_dir = str(tmp_path / "run")
    params = _save_checkpoint(cfg, run_dir)

    for path in (f"{run_dir}/checkpoints/3", f"{run_dir}/checkpoints", run_dir):
        model, step = restore_model_for_eval(cfg, path)
        assert step == 3
        restored = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        jax.tree.map(np.testing.assert_array_equal, restored, params)

    missing = str(tmp_path / "no_such_run" / "checkpoints" / "100")
    with pytest.raises(FileNotFoundError, match="no_such_run"):
        evaluation.main(cfg, str(tmp_path / "out"), [missing], [16], progress=False)
    with pytest.raises(FileNotFoundError, match="checkpoints"):
        evaluation.main(cfg, str(tmp_path / "empty_workdir"), [], [16], progress=False)

    other = tiny_config("KMM")  # the second layer is MLA here, KDA in the checkpoint
    with pytest.raises(ValueError) as err:
        restore_model_for_eval(other, f"{run_dir}/checkpoints/3", config_name="configs/other.py")
    msg = str(err.value)
    assert f"{run_dir}/checkpoints/3" in msg and "configs/other.py" in msg and "mixer" in msg


def test_checkpoint_spec_parsing():
    s = evaluation.CheckpointSpec.parse("r3=runs/r3/checkpoints/2000@configs/ablate_ratio.py:ratio=3")
    assert (s.label, s.path) == ("r3", "runs/r3/checkpoints/2000")
    assert s.config == "configs/ablate_ratio.py:ratio=3"
    s = evaluation.CheckpointSpec.parse("runs/r3/checkpoints/2000")
    assert (s.label, s.config) == ("r3@2000", None)
    with pytest.raises(ValueError, match="--checkpoint"):
        evaluation.CheckpointSpec.parse("label=")


# ---------------------------------------------------------------------------------------------
# The long-context memory benchmark runs (toy sizes) and writes its table and plots
# ---------------------------------------------------------------------------------------------


def _load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "long_context_memory", os.path.join(REPO, "benchmarks", "long_context_memory.py"))
    lcm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lcm)
    return lcm


def test_long_context_memory_smoke(tmp_path):
    lcm = _load_benchmark()
    rows = lcm.main(["--smoke", f"--out_dir={tmp_path}", "--variants=3:1", "--seq_lens=32"])
    assert {(r["variant"], r["pattern"], r["mode"], r["seq_len"]) for r in rows} == {
        ("3:1", "KM", m, 32) for m in lcm.MODES}
    assert all(r["status"] == "ok" and r["seconds"] > 0 and r["xla_bytes"] > 0 for r in rows)
    with open(tmp_path / "long_context_memory.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert plots.is_png(tmp_path / "long_context_time.png")
    assert plots.is_png(tmp_path / "long_context_memory.png")
    assert "| 3:1 | prefill | 32 | ok |" in (tmp_path / "long_context_memory.md").read_text()


def test_long_context_cache_is_flat_for_kda_and_grows_for_mla():
    lcm = _load_benchmark()
    args = lcm.parse_args(["--smoke", "--num_layers=4"])
    size = {}
    for variant in lcm.VARIANTS:
        cfg = lcm.model_config(args, variant)
        model = nnx.eval_shape(lambda cfg=cfg: HybridLM(cfg, rngs=nnx.Rngs(0)))  # shapes only
        size[variant] = [lcm.cache_bytes(model, T) for T in (1024, 4096)]
    assert size["all-KDA"][0] == size["all-KDA"][1]  # a fixed state per layer
    assert size["all-MLA"][1] > 3.9 * size["all-MLA"][0]  # a latent per token per layer
    assert size["all-KDA"][1] < size["3:1"][1] < size["all-MLA"][1]
    assert lcm.pattern_for("3:1", 8) == "KKKMKKKM" and lcm.pattern_for("3:1", 6) == "KKKMKM"
