"""eval.py's machinery: perplexity, piecewise vs whole-sequence scoring, the short-document rule,
outputs (JSON, CSV, valid PNGs), checkpoint errors, and the long-context memory benchmark."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import eval_scoring, evaluation, model_state, plots, runtime
from kimi_k3.checkpoint import INIT_CHECKPOINT, Checkpointer, restore_model_for_eval
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




class CountModel(UniformModel):
    """A cache model: the next token's logit is log(1 + its count among the tokens read so far in
    the window). It uses all of its context, so on documents of skewed token frequencies its
    loss falls with the context length."""

    def init_cache(self, batch_size, max_len):
        return {"counts": jnp.zeros((batch_size, self.vocab_size))}

    def prefill(self, tokens_BxT, cache):
        counts = cache["counts"][:, None] + jnp.cumsum(jax.nn.one_hot(tokens_BxT, self.vocab_size), axis=1)
        return jnp.log1p(counts), {"counts": counts[:, -1]}

    def __call__(self, tokens_BxT):
        return self.prefill(tokens_BxT, self.init_cache(tokens_BxT.shape[0], 0))[0]


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
        # Byte tokens (the config's data): one byte per target, so bits per byte = log2(V).
        assert r["bytes"] == r["targets"] and r["bits_per_byte"] == pytest.approx(math.log2(V), rel=1e-5)
        assert r["perplexity_ci"] == pytest.approx([V, V], rel=1e-5)


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


def test_the_timeline_splits_the_whole_run_into_its_stages(tiny_model, tmp_path, capsys):
    """The report's stages cover the process's time without overlap or gap: with the closing
    line's writing they add up to the seconds since the process started (read again after the
    run), compiling is the scorer's compile time (moved out of scoring), and the line says each."""
    cfg, model, tokens = tiny_model
    opts = eval_scoring.EvalOptions((48,), piece_len=16, batch_size=2, short_docs="skip")
    before = runtime.process_seconds()
    report = evaluation.run(cfg, [evaluation.CheckpointSpec.parse("m=init")], opts,
                            str(tmp_path), docs=list(tokens), models={"m": model}, progress=False)
    after = runtime.process_seconds()
    stages = report["timeline"]
    assert list(stages) == [s for s in evaluation.Timeline.STAGES if s != "writing"]
    result = report["models"][0]["results"]["48"]
    assert stages["compiling"] == pytest.approx(result["compile_seconds"]) and stages["compiling"] > 0
    assert stages["scoring"] + stages["compiling"] >= result["seconds"]
    assert all(v >= 0 for v in stages.values())
    tick = 0.02  # /proc counts in hundredths of a second
    assert before - tick <= stages["startup"] <= after + tick
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("time: ")][-1]
    said = dict((name, float(v)) for v, name in
                ((m.split()[1], m.split()[0]) for m in line.split(": ", 2)[2].split(", ")))
    assert list(said) == list(evaluation.Timeline.STAGES)
    total = float(line.split()[1])
    assert total == pytest.approx(sum(said.values()), abs=0.35)  # each rounded to 0.1 s
    assert abs(total - after) <= 0.1 + tick


# ---------------------------------------------------------------------------------------------
# Windows, the short-document rule, position buckets
# ---------------------------------------------------------------------------------------------


def test_short_document_rule_counts():
    docs = [np.arange(n, dtype=np.int32) for n in (5, 17, 33, 8)]
    skip = eval_scoring.make_windows(docs, 8, "skip")
    # Windows of 9 tokens with stride 8: 5 -> 0 (skipped), 17 -> 2, 33 -> 4, 8 -> 0 (skipped).
    assert (skip.docs_total, skip.docs_skipped, skip.docs_used, skip.num_windows) == (4, 2, 2, 6)
    np.testing.assert_array_equal(skip.tokens_NxL1[1], np.arange(8, 17))
    assert "4 documents = 2 shorter than 9 tokens + 2 scored" in skip.describe()
    one = eval_scoring.make_windows(docs, 8, "skip", max_windows=1)
    assert ("4 documents = 2 shorter than 9 tokens + 1 left out by --max_windows=1 + 1 scored"
            in one.describe())

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


def test_every_document_is_counted_under_every_rule(rng):
    docs = random_docs(rng, rng.integers(1, 120, 40), 50)
    stream_ends = np.cumsum([len(d) for d in docs])
    for rule in eval_scoring.SHORT_DOC_RULES:
        for L in (3, 16, 40):
            cap = int(rng.integers(0, 12))
            w = eval_scoring.make_windows(docs, L, rule, cap, span=64 if rule == "same" else None)
            assert w.docs_total == w.docs_skipped + w.docs_dropped + w.docs_used == len(docs)
            need = {"same": 65, "skip": L + 1, "concat": 0}[rule]
            assert w.docs_skipped == sum(len(d) < need for d in docs)
            if rule == "concat":  # used: the documents holding a target of a kept window
                picked = np.round(np.linspace(0, w.windows_available - 1, cap)).astype(int) if (
                    0 < cap < w.windows_available) else np.arange(w.windows_available)
                doc_of = lambda t: np.searchsorted(stream_ends, t, side="right")  # token t's document
                targets = np.concatenate([np.arange(i * L + 1, i * L + L + 1) for i in picked])
                assert w.docs_used == len(set(doc_of(targets).tolist()))
                np.testing.assert_array_equal(w.doc_of_window, doc_of(picked * L + 1))
            else:
                assert w.docs_used == len(set(w.doc_of_window.tolist()))
            if not cap:
                assert w.num_windows == w.windows_available
            assert f"{w.docs_total} documents" in w.describe()


def test_same_rule_scores_the_same_targets_at_every_length(rng):
    longest = 64
    lengths = sorted({int(x) for x in rng.choice([1, 4, 8, 16, 32], 2, replace=False)} | {3, longest})
    docs = random_docs(rng, [*rng.integers(1, 200, 30), 300], 50)
    cap = int(rng.integers(0, 6))
    ws = eval_scoring.cut_windows(docs, lengths, "same", cap)
    spans = ws[longest].tokens_NxL1  # [S, 65]
    assert len(spans) == (min(cap, ws[longest].windows_available) if cap else ws[longest].windows_available)
    for row, d in zip(spans, ws[longest].doc_of_window, strict=True):  # each span is a slice of its document
        assert any(np.array_equal(row, docs[d][o : o + longest + 1])
                   for o in range(0, len(docs[d]) - longest, longest))
    for L, w in ws.items():
        k = longest // L
        assert w.num_windows == k * len(spans) and w.windows_per_span == k
        assert (w.docs_used, w.docs_skipped, w.docs_dropped) == (
            ws[longest].docs_used, sum(len(d) < longest + 1 for d in docs), ws[longest].docs_dropped)
        # The windows of a span, in order, score its first k * L targets: all of them when L
        # divides the longest length, the first 63 of 64 at L = 3.
        targets = w.tokens_NxL1[:, 1:].reshape(len(spans), k * L)
        np.testing.assert_array_equal(targets, spans[:, 1 : k * L + 1])
        np.testing.assert_array_equal(w.tokens_NxL1[:, 0].reshape(len(spans), k), spans[:, 0 : k * L : L])


def test_same_rule_without_a_long_enough_document_says_what_to_do(rng):
    docs = random_docs(rng, rng.integers(1, 100, 10), 50)
    with pytest.raises(ValueError, match=r"--short_docs=same: no held-out document holds 129 tokens .* "
                                         r"--short_docs=concat"):
        eval_scoring.cut_windows(docs, [16, 128], "same", 8)


def test_position_buckets_hold_the_minimum_count_and_cover_every_position(rng):
    MIN = eval_scoring.MIN_BUCKET_TARGETS
    for _ in range(200):
        L, N = int(rng.integers(1, 5000)), int(rng.integers(1, 300))
        b = eval_scoring.scored_buckets(L, N)
        assert b[0][0] == 1 and b[-1][1] == L
        assert all(b[i][1] + 1 == b[i + 1][0] for i in range(len(b) - 1))
        edges = {lo for lo, _ in eval_scoring.position_buckets(L)}
        assert {lo for lo, _ in b} <= edges  # unions of the log-spaced buckets
        if len(b) > 1:
            assert all((hi - lo + 1) * N >= MIN for lo, hi in b), (L, N, b)
            assert b[-1][1] - b[-1][0] + 1 >= b[-1][0] / 2  # no sliver at the end
    # Enough windows: only the last bucket, position 2048 alone, is merged.
    assert eval_scoring.scored_buckets(2048, 1000) == [*eval_scoring.position_buckets(2048)[:-2],
                                                       (1024, 2048)]


# ---------------------------------------------------------------------------------------------
# Intervals: a bootstrap over documents, reproducible, and the paired change between lengths
# ---------------------------------------------------------------------------------------------


def test_the_bootstrap_interval_covers_the_truth_at_about_its_level(rng):
    """300 experiments of 40 documents, each document's tokens sharing its own level around a
    known mean (so tokens are not independent; resampling documents accounts for that). A 95%
    interval should hold the mean in about 95% of them (the percentile bootstrap runs a little
    under at this size); one from tokens or windows alone would hold it far less often."""
    hits = 0
    for _ in range(300):
        sizes = rng.integers(50, 200, 40).astype(float)
        levels = rng.normal(3.0, 0.5, 40)
        nll = levels * sizes + rng.normal(0.0, 1.0, 40) * np.sqrt(sizes)
        (lo, hi), = eval_scoring.bootstrap_ci(nll[:, None], sizes[:, None])
        hits += lo <= 3.0 <= hi
    assert 0.88 <= hits / 300 <= 0.99, hits
    again = eval_scoring.bootstrap_ci(nll[:, None], sizes[:, None])
    np.testing.assert_array_equal(again, eval_scoring.bootstrap_ci(nll[:, None], sizes[:, None]))
    assert np.isnan(eval_scoring.bootstrap_ci(nll[:1, None], sizes[:1, None])).all()  # one unit: none


def test_same_text_at_every_length_pairs_the_change_between_lengths(rng, tmp_path, capsys):
    """Documents of very different difficulty (skewed or flat token frequencies) make each
    length's interval wide; the change from the shortest length, over the same documents, is
    sure: a cache model gains from context on every skewed document."""
    V = 32
    docs = [rng.choice(V, size=int(n), p=rng.dirichlet(np.full(V, a))).astype(np.int32)
            for n, a in zip(rng.integers(300, 600, 12), [0.05, 0.5, 5.0] * 4, strict=True)]
    docs.append(rng.integers(0, V, 100).astype(np.int32))  # too short for the longest length
    opts = eval_scoring.EvalOptions((8, 32, 256), piece_len=64, batch_size=8, max_windows=0)
    assert opts.short_docs == "same"  # the default
    report = evaluation.run(tiny_config(vocab=V), [evaluation.CheckpointSpec("init", "counts")], opts,
                            str(tmp_path), docs=docs, models={"counts": CountModel(V)}, progress=False)
    res = report["models"][0]["results"]
    assert len({r["targets"] for r in res.values()}) == 1  # the same targets at every length
    for r in res.values():
        assert (r["docs_used"], r["docs_skipped"], r["ci_unit"], r["ci_units"]) == (12, 1, "documents", 12)
        lo, hi = r["perplexity_ci"]
        assert lo < r["perplexity"] < hi
    assert "loss_change" not in res["8"]
    for L in ("32", "256"):
        change = res[L]["loss_change"]
        assert change["from"] == 8
        assert change["value"] == pytest.approx(res[L]["loss"] - res["8"]["loss"], abs=1e-9)
        lo, hi = change["ci"]
        assert lo <= change["value"] <= hi < 0
        assert hi - lo < res[L]["loss_ci"][1] - res[L]["loss_ci"][0]
    assert all("_units" not in r for r in res.values())  # the per-document sums are not kept
    json.dumps(report)
    out = capsys.readouterr().out
    assert "change in loss from L=8, nats [95% paired bootstrap interval" in out
    assert "12 documents" in out and "13 documents = 1 shorter than 257 tokens + 12 scored" in out
    with open(tmp_path / "eval_perplexity.csv") as f:
        rows = {r["context_length"]: r for r in csv.DictReader(f)}
    assert rows["8"]["loss_change"] == "" and float(rows["256"]["loss_change_ci_hi"]) < 0


# ---------------------------------------------------------------------------------------------
# Bits per byte
# ---------------------------------------------------------------------------------------------


def test_bits_per_byte_counts_the_bytes_behind_the_tokens(rng, tmp_path, capsys):
    from ml_collections import ConfigDict
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # A byte-level BPE over text with characters of 1 to 4 UTF-8 bytes: tokens that hold part
    # of a character count the bytes they hold.
    alphabet = [*"abcdefgh ,.\n", "é", "ß", "ж", "中", "🙂"]
    texts = ["".join(rng.choice(alphabet, int(rng.integers(20, 80)))) for _ in range(40)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "bpe.json"))
    table, how = eval_scoring.token_byte_lengths(
        ConfigDict({"source": "text", "tokenizer": str(tmp_path / "bpe.json")}))
    assert "bpe.json" in how
    for text in [*texts[:10], "".join(rng.choice(alphabet, 300))]:
        assert table[bpe.encode(text).ids].sum() == len(text.encode())
    assert table[bpe.token_to_id("<eos>")] == 0

    # Another decoder (SentencePiece-style spaces): each id's bytes after a fixed token, so a
    # text's count is its length, plus the space the decoder drops at its start.
    sp = Tokenizer(models.BPE())
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    words = ["".join(rng.choice(list("abcdefgh"), int(rng.integers(1, 7)))) for _ in range(60)]
    sp.train_from_iterator([" ".join(words)], trainers.BpeTrainer(vocab_size=120, show_progress=False))
    sp.save(str(tmp_path / "sp.json"))
    sp_table = eval_scoring.tokenizer_byte_lengths(str(tmp_path / "sp.json"))
    text = " ".join(rng.choice(words, 30))
    assert sp_table[sp.encode(text).ids].sum() - len(text.encode()) in (0, 1)

    ones, how = eval_scoring.token_byte_lengths(ConfigDict({"source": "stdlib", "tokenizer": ""}))
    assert ones.tolist() == [1] * 256 and "one byte" in how
    # Token files without their tokenizer: no text, no bits per byte; the report says why.
    none, why = eval_scoring.token_byte_lengths(ConfigDict({"source": "tokens", "tokenizer": ""}))
    assert none is None and "data.tokenizer" in why
    cfg = tiny_config(vocab=64)
    cfg.data.source = "tokens"
    opts = eval_scoring.EvalOptions((16,), piece_len=16, max_windows=4)
    report = evaluation.run(cfg, [evaluation.CheckpointSpec("init", "u")], opts, str(tmp_path / "ev"),
                            docs=random_docs(rng, [200, 100], 64), models={"u": UniformModel(64)},
                            progress=False)
    r = report["models"][0]["results"]["16"]
    assert r["bits_per_byte"] is None and r["bytes"] is None
    assert "bits per byte: not computed: data.source='tokens'" in capsys.readouterr().out


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


def test_outputs_written_and_plots_are_valid_pngs(rng, tmp_path, capsys, monkeypatch):
    events = []  # (what, thread name) in the order they happened

    def warm_up():  # slower than this scoring: the files must wait for it
        time.sleep(1.0)
        events.append(("warmed", threading.current_thread().name))

    write_outputs = evaluation.write_outputs

    def logged_write_outputs(*args, **kwargs):
        events.append(("writing", threading.current_thread().name))
        return write_outputs(*args, **kwargs)

    monkeypatch.setattr(plots, "warm_up", warm_up)
    monkeypatch.setattr(evaluation, "write_outputs", logged_write_outputs)
    V = 64
    docs = random_docs(rng, [300, 20, 90], V)
    specs = [evaluation.CheckpointSpec.parse("uniform=init"), evaluation.CheckpointSpec.parse("unigram=init")]
    models = {"uniform": UniformModel(V), "unigram": UnigramModel(V)}
    opts = eval_scoring.EvalOptions((16, 48, 128), piece_len=16, batch_size=2, short_docs="skip")
    report = evaluation.run(tiny_config(vocab=V), specs, opts, str(tmp_path), docs=docs, models=models,
                            progress=False)
    out = capsys.readouterr().out
    assert ("short_docs=skip: 3 documents = 1 shorter than 49 tokens + 0 left out by --max_windows=64 "
            "+ 2 scored") in out
    assert "L=128" in out and "perplexity" in out
    assert "bits per byte (byte tokens, one byte each)" in out
    unigram = report["models"][1]["results"]["48"]
    assert f"{unigram['perplexity']:.3f} [{unigram['perplexity_ci'][0]:.3f}, " in out

    with open(tmp_path / "eval.json") as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(report))
    assert saved["short_docs"] == "skip" and [m["label"] for m in saved["models"]] == ["uniform", "unigram"]
    assert saved["windows"]["128"]["docs_skipped"] == 2 and saved["windows"]["128"]["windows_used"] == 2
    with open(tmp_path / "eval_perplexity.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["label"], r["context_length"]) for r in rows} == {
        (m, L) for m in ("uniform", "unigram") for L in ("16", "48", "128")}
    for r in rows:
        assert float(r["perplexity_ci_lo"]) <= float(r["perplexity"]) <= float(r["perplexity_ci_hi"])
        assert int(r["docs_total"]) == int(r["docs_skipped"]) + int(r["docs_dropped"]) + int(r["docs_used"])
    with open(tmp_path / "eval_loss_by_position.csv") as f:
        buckets = [r for r in csv.DictReader(f) if r["context_length"] == "128"]
    # Two windows at L=128: 2 targets per position, buckets of at least 100 targets, the last
    # (a single position, 128) merged into the one before.
    assert [(int(r["position_lo"]), int(r["position_hi"])) for r in buckets if r["label"] == "uniform"] == [
        (1, 63), (64, 128)]
    assert all(int(r["targets"]) >= eval_scoring.MIN_BUCKET_TARGETS for r in buckets)
    for name in ("eval_perplexity.png", "eval_loss_by_position.png"):
        assert plots.is_png(tmp_path / name)
    # matplotlib warmed up once, in its own thread while scoring, finished before the files
    # (an order of events, not of clocks: a file's mtime comes from a coarser clock than time.time)
    assert events == [("warmed", "matplotlib warm-up"), ("writing", threading.current_thread().name)]


def test_a_long_footer_stays_inside_the_figure_below_the_axes(rng):
    note = " ".join("".join(rng.choice(list("abcdefghij"), int(rng.integers(2, 12)))) for _ in range(80))
    figures = [
        plots.line_figure({"a": ([1, 2, 4], [3.0, 2.0, 1.0])}, title="t", xlabel="x", ylabel="y",
                          note=note),
        plots.heatmap_figure([[0.1, 0.5]], row_labels=["r"], col_labels=["1K", "2K"], title="t",
                             xlabel="x", ylabel="y", colorbar_label="c", note=note, chance=0.1),
    ]
    for fig in figures:
        renderer = fig.canvas.get_renderer()
        (text,) = fig.texts
        assert text.get_text().replace("\n", " ") == note and "\n" in text.get_text()
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width and 0 <= box.y0 and box.y1 <= fig.bbox.height
        for ax in fig.axes:  # the axes, with their labels, sit above the footer
            assert ax.get_tightbbox(renderer).y0 >= box.y1


def test_bands_and_reference_lines_are_drawn(tmp_path):
    nan = float("nan")
    fig = plots.line_figure({"a": ([1, 2, 4], [3.0, 2.0, 1.0]), "b": ([1, 2, 4], [1.0, 1.0, 1.0])},
                            title="t", xlabel="x", ylabel="y",
                            bands={"a": ([2.5, nan, 0.5], [3.5, nan, 1.5])}, hlines={"chance": 0.25})
    ax = fig.axes[0]
    (band,) = ax.collections  # one shaded band, for "a"
    ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
    assert ys.min() == pytest.approx(0.5) and ys.max() == pytest.approx(3.5)
    assert any(line.get_linestyle() == "--" and line.get_ydata()[0] == 0.25 for line in ax.lines)
    assert "chance" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="band 'a' has 2 lows"):
        plots.line_figure({"a": ([1, 2, 4], [3.0, 2.0, 1.0])}, title="t", xlabel="x", ylabel="y",
                          bands={"a": ([1, 2], [2, 3])})
    assert plots.is_png(plots.line_plot(tmp_path / "b.png", {"a": ([1, 2], [1.0, 2.0])}, title="t",
                                        xlabel="x", ylabel="y", bands={"a": ([0.5, 1.5], [1.5, 2.5])}))


def test_plot_is_a_png_matplotlib_can_read(tmp_path):
    import matplotlib.image

    plots.warm_up()  # what eval runs in a thread while it scores
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


@pytest.mark.parametrize("source", ["checkpoint", "init"])
def test_the_first_lengths_piece_program_compiles_while_the_weights_load(tmp_path, monkeypatch,
                                                                          source):
    """A checkpoint eval.py loads itself has its first length's piece program compiled in a
    thread meanwhile (eval_scoring.CompiledAhead): its first piece compiles nothing, the next
    length compiles as before, and the losses are those of the program compiled at the first
    piece (compiling ahead failing, which only warns). For ``init`` the abstract model comes
    from the initialiser's own trace: the model is built once."""
    cfg = tiny_config("KKM")
    cfg.checkpoint.async_save = False
    path = str(tmp_path / "run") if source == "checkpoint" else INIT_CHECKPOINT
    if source == "checkpoint":
        _save_checkpoint(cfg, path)
    rng = np.random.default_rng()
    docs = [rng.integers(0, cfg.model.vocab_size, 120).astype(np.int32) for _ in range(3)]
    opts = eval_scoring.EvalOptions((32, 48), piece_len=16, batch_size=2, short_docs="skip")
    make_model, built = model_state.make_model, []
    monkeypatch.setattr(model_state, "make_model",
                        lambda *args: built.append(args) or make_model(*args))

    def run(workdir):
        report = evaluation.run(cfg, [evaluation.CheckpointSpec.parse(f"m={path}")], opts,
                                str(tmp_path / workdir), docs=docs, progress=False)
        return report["models"][0]

    ahead = run("ahead")
    assert len(built) == (1 if source == "init" else 0)
    assert ahead["compiled_ahead_seconds"] > 0
    assert ahead["results"]["32"]["compile_seconds"] == 0
    assert ahead["results"]["48"]["compile_seconds"] > 0

    def fail(*args):
        raise RuntimeError("no")

    monkeypatch.setattr(eval_scoring.Scorer, "prepare", fail)
    with pytest.warns(UserWarning, match="compiles at the first piece instead"):
        at_first_piece = run("at_first_piece")
    assert at_first_piece["results"]["32"]["compile_seconds"] > 0
    for L in ("32", "48"):
        assert ahead["results"][L]["loss"] == at_first_piece["results"][L]["loss"]


def test_a_program_compiled_ahead_goes_only_to_a_model_of_its_shapes(tiny_model):
    cfg, model, tokens = tiny_model
    abstract = eval_scoring.Scorer(nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(0))))
    abstract.prepare(2, 16, 48)
    same = abstract.with_weights(model)
    assert len(same._compiled) == 1
    np.testing.assert_array_equal(same.piecewise_nll(tokens, 16),
                                  eval_scoring.Scorer(model).piecewise_nll(tokens, 16))
    wider = tiny_config("KKM")
    wider.model.mlp_dim = 2 * cfg.model.mlp_dim
    assert not abstract.with_weights(build(wider.model, 0))._compiled
    halves = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                          nnx.state(model))
    assert not abstract.with_weights(nnx.merge(nnx.graphdef(model), halves))._compiled


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


def test_scoring_progress_in_a_log_says_pieces_rate_eta_and_the_scoring_time(monkeypatch):
    """In a log (not a terminal): a line after the first piece, then at most every ``every``
    seconds before the last, each with pieces done, tokens/s and the time left at that rate;
    at the end the scoring time and its compiling part. On a terminal only the last line."""
    import io

    clock = iter([0.0, 4.0, 5.0, 6.0, 7.0, 30.0])  # start, then the end of each piece
    monkeypatch.setattr(eval_scoring.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    progress = eval_scoring.ScoringProgress("L=4,096", 5, 1024, every=1.5, stream=log)
    for _ in range(5):
        progress.piece()
    progress.done(30.0, 2.5, 0.5)
    lines = log.getvalue().splitlines()
    assert lines == [
        "L=4,096: 1/5 pieces, 256 tokens/s (first piece, compiling included), ETA 16 s",
        "L=4,096: 3/5 pieces, 1,024 tokens/s (after the first piece), ETA 2 s",
        "L=4,096: 5 pieces (5,120 tokens) scored in 30.0 s, 2.5 s of it compiling (0.5 s "
        "tracing), first piece 4.0 s, the others 6.50 s each: 171 tokens/s"]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    clock = iter([0.0, 4.0, 5.0])
    tty = Terminal()
    progress = eval_scoring.ScoringProgress("L=4,096", 2, 1024, stream=tty)
    progress.piece()
    progress.piece()
    progress.done(5.0, 0.0)
    assert tty.getvalue().count("\n") == 1 and "scored in 5.0 s" in tty.getvalue()


def test_piece_flops_grow_by_the_keys_each_piece_reads_and_sum_to_the_window():
    """A window's pieces weigh their forward FLOPs: summed, the window's L tokens at
    flops_per_token(L) / 3 (causal attention over (L + 1) / 2 keys on average); each piece
    one block of P x P keys more than the one before, per MLA layer 2 H (dn + ds + dv) FLOPs
    a key; with no MLA layer all pieces alike. The last piece of an L that P does not divide
    counts whole (it is padded)."""
    from kimi_k3.model import flops_per_token

    rng = np.random.default_rng()
    cfg = tiny_config("KKMKM")
    m = cfg.model.mla
    per_key = 2 * 2 * m.num_heads * (m.qk_nope_head_dim + m.shared_head_dim + m.v_head_dim)
    P = int(rng.integers(3, 40))
    n = int(rng.integers(2, 9))
    f = eval_scoring.piece_flops(cfg.model, n * P, P)
    assert f.shape == (n,)
    np.testing.assert_allclose(f.sum(), n * P * flops_per_token(cfg.model, n * P) / 3, rtol=1e-12)
    np.testing.assert_allclose(np.diff(f), P * P * per_key, rtol=1e-12)
    ragged = eval_scoring.piece_flops(cfg.model, n * P - 1, P)
    np.testing.assert_allclose(ragged, f, rtol=1e-12)
    flat = eval_scoring.piece_flops(tiny_config("KKK").model, n * P, P)
    np.testing.assert_allclose(flat, flat[0], rtol=1e-12)
    np.testing.assert_allclose(eval_scoring.scoring_flops(cfg.model, n * P, P, 5, 2),
                               np.tile(f, 3) * 2, rtol=1e-12)
    assert np.all(eval_scoring.scoring_flops(None, n * P, P, 5, 2) == np.ones(3 * n))


def test_scoring_progress_weighs_the_time_left_by_the_pieces_costs(monkeypatch):
    """With costs, the time left is the time per unit of cost after the first piece times the
    cost still to come (pieces that grow cost more than the mean so far); the same costs
    scaled give the same line; costs of the wrong length or not positive are refused."""
    import io

    costs = [1.0, 2.0, 3.0, 4.0, 5.0]
    lines = []
    for scale in (1.0, 1e12):
        clock = iter([0.0, 4.0, 6.0, 9.0, 13.0, 18.0])  # each piece 1 s per unit after the first
        monkeypatch.setattr(eval_scoring.time, "perf_counter", lambda c=clock: next(c))
        log = io.StringIO()
        progress = eval_scoring.ScoringProgress("L=4,096", 5, 1024, every=0.0, stream=log,
                                                costs=[c * scale for c in costs])
        for _ in range(4):
            progress.piece()
        lines.append(log.getvalue().splitlines())
    assert lines[0] == lines[1]
    assert lines[0] == [
        "L=4,096: 1/5 pieces, 256 tokens/s (first piece, compiling included), ETA 56 s",
        "L=4,096: 2/5 pieces, 512 tokens/s (after the first piece), ETA 12 s",
        "L=4,096: 3/5 pieces, 410 tokens/s (after the first piece), ETA 9 s",
        "L=4,096: 4/5 pieces, 341 tokens/s (after the first piece), ETA 5 s"]
    for bad in ([1.0] * 4, [1.0, 0.0, 1.0, 1.0, 1.0]):
        with pytest.raises(ValueError, match="costs must be 5 positive numbers"):
            eval_scoring.ScoringProgress("L=4,096", 5, 1024, costs=bad)


def test_the_eval_bar_fills_by_flops_and_counts_pieces(monkeypatch):
    """eval.py's terminal bar: its text counts pieces, its fill the pieces' FLOPs; whole at the
    end."""
    import io

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    flops = {8: np.array([1.0, 3.0]), 16: np.array([2.0, 4.0, 6.0, 8.0])}
    with evaluation.ScoringBar("init", flops, enabled=True) as bar:
        bar.length(8)
        for f in flops[8]:
            bar.advance(f)
        assert bar.bar.n == 4.0 and bar.done == 2
        bar.length(16)
        for f in flops[16]:
            bar.advance(f)
        assert bar.bar.n == bar.bar.total == 24.0
    text = err.getvalue()
    assert "6/6 pieces]" in text and "eval init, L=16: 100%" in text and "FLOP/s" in text


@pytest.mark.parametrize("user", ["scorer", "decoder"])
def test_the_empty_cache_is_built_as_one_program(user):
    """Scorer.init_cache and Decoder.init_cache (model_state.empty_cache_fn): the model's own
    empty cache (same nesting, shapes, dtypes, zeros), compiled as one program rather than
    one per array dtype and shape, and not again for the next window of the same shape."""
    from jax import monitoring

    from kimi_k3 import generate

    model = build(tiny_config("KKMKM").model, int(np.random.default_rng().integers(1 << 30)))
    holder = eval_scoring.Scorer(model) if user == "scorer" else generate.Decoder(model)
    B, S = 2, int(np.random.default_rng().integers(40, 400))  # a shape no other test compiled
    compiles = []

    def count(name, _secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    monitoring.register_event_duration_secs_listener(count)
    try:
        got = jax.block_until_ready(holder.init_cache(B, S))
        assert len(compiles) == 1, compiles
        jax.block_until_ready(holder.init_cache(B, S))
        assert len(compiles) == 1, compiles
    finally:
        monitoring.unregister_event_duration_listener(count)
    want = model.init_cache(B, S)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and not np.any(np.asarray(g))


def test_the_compiled_scoring_piece_copies_no_cache():
    """The jitted piece function of long-context scoring (the cache donated) on an unrolled
    stack (configs/1b.py's layout) writes each piece's MLA entries into the cache where it
    lies and reads it block by block: its outputs alias the donated cache and no temporary is
    as large as one layer's latent cache (a copy of it would be)."""
    cfg = tiny_config("KMKM")
    cfg.model.scan_layers = False
    cfg.model.mla.kv_lora_rank, cfg.model.mla.shared_head_dim = 64, 16  # entries of 80 numbers
    model = build(cfg.model, 2)
    B, S, P = 2, 32768, 64
    graphdef, state = nnx.split(model)
    piece = eval_scoring.piece_function(graphdef)
    cache = jax.eval_shape(lambda: model.init_cache(B, S))
    tokens = jax.ShapeDtypeStruct((B, P), jnp.int32)
    compiled = piece.lower(state, tokens, cache, tokens).compile()
    latent_bytes = min(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache) if S in x.shape)
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert mem.temp_size_in_bytes < latent_bytes, (mem.temp_size_in_bytes, latent_bytes)


def _lowered_piece_chars(pattern: str) -> int:
    """Characters of eval's piece function lowered for a tiny unrolled model of ``pattern``
    with every Pallas kernel (interpret mode here)."""
    m = tiny_config(pattern, vocab=64).model
    m.scan_layers, m.kda.impl, m.kda.conv_impl = False, "pallas", "pallas"
    abstract = nnx.eval_shape(lambda: HybridLM(m, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    cache = jax.eval_shape(lambda: abstract.init_cache(1, 64))
    tokens = jax.ShapeDtypeStruct((1, 32), jnp.int32)
    piece = eval_scoring.piece_function(graphdef)
    cache = eval_scoring.align_cache(cache, jax.eval_shape(piece, state, tokens, cache, tokens)[1])
    return len(piece.lower(state, tokens, cache, tokens).as_text())


def test_the_layers_of_a_program_share_one_lowering_of_each_kernel(monkeypatch):
    """The undifferentiated KDA, short-convolution and Attention Residual kernels are jitted
    functions, so a program lowers each once however many layers call it with the same shapes
    (on a GPU, lowering every layer's Mosaic and Triton kernels again was most of a 1M-token
    evaluation's tracing): four KDA layers lower to little more than one, with the sublayers
    called inline (``model.traced_once`` shares the rest of a layer's code too;
    test_model holds it). Made plain functions again, the same measure sees every layer's
    copy."""
    from kimi_k3 import model as model_lib
    from kimi_k3.layers import attn_res, short_conv
    from pallas_kernels import kda as kda_kernel

    monkeypatch.setattr(model_lib, "traced_once", lambda module, *args: module(*args))
    ratio = _lowered_piece_chars("KKKKM") / _lowered_piece_chars("KM")
    assert ratio < 1.6, ratio
    monkeypatch.setattr(kda_kernel, "_forward_once",
                        lambda *args: kda_kernel._forward(*args, residuals=False))
    monkeypatch.setattr(short_conv, "_conv_forward_once", short_conv.short_conv_kernel.conv_forward)
    monkeypatch.setattr(attn_res, "_fused_fwd_once", attn_res._fused_fwd)
    jax.clear_caches()  # traced afresh, not the programs above
    apart = _lowered_piece_chars("KKKKM") / _lowered_piece_chars("KM")
    assert apart > 2.5, apart
