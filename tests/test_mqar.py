"""The MQAR task: generator structure and determinism, the accuracy metric, the config, and a
tiny end-to-end sweep (train, score, table, CSV, PNG)."""

from __future__ import annotations

import csv
import importlib.util
import os

import jax
import numpy as np
import pytest

from kimi_k3 import mqar, plots
from tests.helpers import build, fast_jit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_mqar_config(arg=None):
    spec = importlib.util.spec_from_file_location("mqar_config", os.path.join(REPO, "configs", "mqar.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def test_generator_structure():
    spec = mqar.MQARSpec(seq_len=48, num_kv_pairs=6, vocab_size=64, num_queries=5)
    d = mqar.generate(spec, 20, seed=3)
    x, y, w = d["inputs_NxT"], d["targets_NxT"], d["weights_NxT"]
    assert x.shape == y.shape == w.shape == (20, 48) and x.dtype == np.int32
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    n_keys = spec.n_keys
    for row_x, row_w in zip(x, w, strict=True):
        keys, values = row_x[0:12:2], row_x[1:12:2]
        assert len(set(keys.tolist())) == 6 and np.all((keys >= 1) & (keys <= n_keys))
        assert np.all(values > n_keys) and np.all(values < 64)
        table = dict(zip(keys.tolist(), values.tolist(), strict=True))
        qpos = np.nonzero(row_w)[0]
        assert len(qpos) == 5 and np.all(qpos >= 12)
        assert len(set(row_x[qpos].tolist())) == 5  # each key asked at most once
        for p in qpos:  # the answer is the value paired with the key at the start
            assert table[int(row_x[p])] == int(row_x[p + 1])
        other = np.setdiff1d(np.arange(12, 48), np.concatenate([qpos, qpos + 1]))
        assert np.all(row_x[other] == mqar.FILLER)


def test_generator_is_deterministic_in_its_seed():
    spec = mqar.MQARSpec(seq_len=32, num_kv_pairs=4, vocab_size=32)
    a, b = mqar.generate(spec, 8, seed=(1, 0, 5)), mqar.generate(spec, 8, seed=(1, 0, 5))
    c = mqar.generate(spec, 8, seed=(1, 0, 6))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["inputs_NxT"], c["inputs_NxT"])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(seq_len=15, num_kv_pairs=4), "seq_len"),
        (dict(seq_len=64, num_kv_pairs=40, vocab_size=64), "num_kv_pairs"),
        (dict(seq_len=64, num_kv_pairs=4, num_queries=5), "num_queries"),
        (dict(seq_len=64, num_kv_pairs=4, vocab_size=3), "vocab_size"),
    ],
)
def test_bad_spec_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"MQARSpec.{field}"):
        mqar.generate(mqar.MQARSpec(**kwargs), 1, seed=0)


def test_accuracy_counts_only_answers():
    spec = mqar.MQARSpec(seq_len=40, num_kv_pairs=5, vocab_size=48)
    data = mqar.generate(spec, 16, seed=0)

    def oracle(inputs_BxT):
        """One-hot logits on the true next token at every position."""
        x = np.asarray(inputs_BxT)
        nxt = np.concatenate([x[:, 1:], np.zeros_like(x[:, :1])], axis=1)
        return np.eye(spec.vocab_size, dtype=np.float32)[nxt]

    def copy_last(inputs_BxT):
        """Predicts the current token again: right nowhere among the answers."""
        return np.eye(spec.vocab_size, dtype=np.float32)[np.asarray(inputs_BxT)]

    assert mqar.mqar_accuracy(oracle, data, batch_size=5) == 1.0
    assert mqar.mqar_accuracy(copy_last, data, batch_size=5) == 0.0


def test_chance_is_a_uniform_guess_among_the_values(rng):
    """A guesser that picks a uniformly random value id for every answer scores the spec's
    chance (within 4 standard errors over 16000 answers)."""
    vocab = int(rng.integers(17, 200))  # 17: the fewest tokens with 8 distinct keys
    spec = mqar.MQARSpec(seq_len=32, num_kv_pairs=8, vocab_size=vocab)
    assert spec.chance == 1 / (vocab - 1 - (vocab - 1) // 2) == 1 / spec.n_values
    data = mqar.generate(spec, 2000, seed=int(rng.integers(1 << 30)))

    def guess(inputs_BxT):
        x = np.asarray(inputs_BxT)
        pick = rng.integers(1 + spec.n_keys, vocab, x.shape)
        return np.eye(vocab, dtype=np.float32)[pick]

    acc = mqar.mqar_accuracy(guess, data, batch_size=500)
    answers = data["weights_NxT"].sum()
    assert abs(acc - spec.chance) < 4 * np.sqrt(spec.chance * (1 - spec.chance) / answers)


def test_config_and_its_argument():
    cfg = load_mqar_config("pattern=KKKM,seq_len=64,steps=7")
    assert cfg.model.pattern == "KKKM" and cfg.model.num_layers == 4 and cfg.train.steps == 7
    spec = mqar.spec_from_config(cfg.mqar)
    assert (spec.seq_len, spec.num_kv_pairs) == (64, 16)  # pairs = seq_len // 4
    with pytest.raises(ValueError, match="bogus"):
        load_mqar_config("bogus=1")
    assert [mqar.pattern_label(p) for p in ("KKKK", "KKKM", "MMMM", "KM")] == [
        "all-KDA", "3:1", "all-MLA", "1:1"]


def test_tiny_sweep_trains_scores_and_writes_outputs(tmp_path, monkeypatch, capsys):
    # Two steps and one scoring pass of a tiny model: the time is the compiles of the step and
    # of the logits (kimi_k3.mqar's jax.jit), so they compile with tests/compile_options.py's
    # FAST_COMPILE (the run and every check are the same). The fresh
    # model's random weights come from tests/test_eval.py's one jitted initialiser (rbg keys)
    # rather than op by op: the checks are of the sweep's plumbing, not of particular weights
    # (both together: about 30 -> 16 s alone, cold cache).
    monkeypatch.setattr(jax, "jit", fast_jit)
    monkeypatch.setattr(mqar, "make_model", build)
    cfg = load_mqar_config("pattern=KM,steps=2,d_model=16,kda_head_dim=8")
    cfg.mqar.train_batch_size, cfg.mqar.eval_examples = 4, 8
    # progress=True, with output captured (not a terminal): no bars, so no carriage returns.
    rows = mqar.run_sweep(cfg, ["KM"], [32], str(tmp_path), progress=True)
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "accuracy=" in out
    assert [(r["label"], r["seq_len"], r["kv_pairs"]) for r in rows] == [("1:1", 32, 8)]
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and np.isfinite(r["final_loss"]) and r["params"] > 0
    with open(tmp_path / "mqar_sweep.csv") as f:
        (row,) = csv.DictReader(f)
    assert float(row["chance"]) == pytest.approx(1 / 128)  # configs/mqar.py: values 128..255
    table = (tmp_path / "mqar_sweep.md").read_text()
    assert "| 1:1 | KM |" in table and "T=32 (8 pairs)" in table
    assert "Chance: 0.008 (a uniform guess among the 128 values" in table and "1 / pairs = 0.125" in table
    assert plots.is_png(tmp_path / "mqar_sweep.png")
