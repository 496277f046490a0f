"""The RULER-style suite (kimi_k3/ruler.py, eval.py --ruler_tasks): examples generated here,
deterministic, of exactly the asked length (bytes and a text tokenizer), with their needles
where the depth says; answers scored by string match; the report, table and side-by-side heat
map of several models."""

from __future__ import annotations

import json
import re
from collections import Counter

import jax
import numpy as np
import pytest

from kimi_k3 import ruler
from kimi_k3.checkpoint import load_model
from kimi_k3.config_files import load_config as load_file
from kimi_k3.data import TextTokenizer
from kimi_k3.evaluation import CheckpointSpec, run_ruler
from kimi_k3.generate import Generation
from kimi_k3.model_state import split_model
from kimi_k3.plots import is_png
from tests.helpers import build, load_config, tiny_config


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A text tokenizer: a BPE trained here on the filler, the instructions and words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = list(ruler.INSTRUCTIONS.values()) + list(ruler.FILLER_SENTENCES) * 5 + \
        [ruler.NEEDLE.format(key="kobami-tesu", value=1234567), "VAR ABCDE = VAR FGHIJ.",
         " ".join(ruler.SYLLABLES), "0123456789 " * 5]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    tok.save(str(path))
    return TextTokenizer(str(path))


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_examples_are_exact_deterministic_and_hold_their_answers(kind, word_tokenizer, rng):
    suite = ruler.RulerSuite(word_tokenizer if kind == "bpe" else None,
                             value_digits=int(rng.integers(3, 8)))
    seed = int(rng.integers(1 << 30))
    for task in ruler.TASKS:
        L = int(rng.integers(1100, 1600))
        d = float(rng.random()) if task in ruler.NEEDLE_TASKS else None
        a, b = (suite.examples(task, L, d, 3, seed) for _ in range(2))
        assert all(np.array_equal(x.prompt_ids, y.prompt_ids) for x, y in zip(a, b, strict=True))
        assert len({tuple(x.prompt_ids) for x in a}) == 3, task  # fresh keys per example
        for ex in a:
            assert len(ex.prompt_ids) == L, (task, len(ex.prompt_ids), L)
            prompt = suite.tokenizer.decode(ex.prompt_ids)
            found = ruler.score_answer(prompt, ex.expected)
            if task == "cwe":  # the common words are the most frequent of the list
                counts = Counter(re.findall(r"\d+\. (\w+)", prompt))
                least_common = min(counts[w] for w in ex.expected)
                others = [c for w, c in counts.items() if w not in ex.expected]
                assert least_common > max(others), task
            elif task == "fwe":
                counts = Counter(prompt.split("words.\n")[-1].split(" Question:")[0].split())
                top = [w for w, _ in counts.most_common(4)]
                assert top[:3] == list(ex.expected) and counts[top[2]] > counts[top[3]]
            else:  # every expected string is in the text, and the asked needle at its depth
                assert found == (1.0, True), task
                assert abs(ex.needle_depth - d) < 0.12, (task, ex.needle_depth, d)
            assert ruler.score_answer(ex.answer, ex.expected) == (1.0, True)
    other = suite.examples("niah_single", 1200, 0.5, 1, seed + 1)[0]
    assert not np.array_equal(other.prompt_ids, suite.examples("niah_single", 1200, 0.5, 1,
                                                               seed)[0].prompt_ids)


def test_a_million_tokens_and_the_shortest_length():
    suite = ruler.RulerSuite()
    ex = suite.examples("niah_multikey", 1 << 20, 0.25, 1, 0)[0]
    assert len(ex.prompt_ids) == 1 << 20 and abs(ex.needle_depth - 0.25) < 1e-3
    shortest = suite.min_length("niah_single")
    with pytest.raises(ValueError, match=rf"--ruler_lengths: 100 tokens are too few for "
                                         rf"niah_single .* about {shortest}"):
        suite.examples("niah_single", 100, 0.5, 1, 0)


def test_scoring_and_options():
    assert ruler.score_answer(" 12, 34 and 5", ["12", "34", "56"]) == (2 / 3, False)
    assert ruler.score_answer("ABC and def", ["abc", "DEF"]) == (1.0, True)
    opts = ruler.parse_options(["all"], ["1K", "4K"], ["0", "1"], samples=2)
    assert opts.tasks == ruler.TASKS and opts.lengths == (1024, 4096)
    assert len(opts.cells()) == 5 * 2 * 2 + 2 * 2  # the word tasks at no depth
    for bad, flag in ((["niah"], "--ruler_tasks"), (["1x"], "--ruler_lengths"),
                      (["1.5"], "--ruler_depths")):
        args = [["niah_single"], ["1K"], ["0"]]
        args[{"--ruler_tasks": 0, "--ruler_lengths": 1, "--ruler_depths": 2}[flag]] = bad
        with pytest.raises(ValueError, match=flag):
            ruler.parse_options(*args)


def test_two_models_side_by_side(tmp_path, monkeypatch, rng):
    """run_ruler on two checkpoints: its generation stands in for a model that knows every
    answer (label "oracle") and one that knows the first of them; the table, CSV, JSON and heat
    map say so. Then a real model, generation and all, on one cell."""
    suite = ruler.RulerSuite()
    answers = {}
    for task in ("niah_multivalue", "fwe"):
        for L in (1024, 1536):
            for d in ((0.0, 1.0) if task != "fwe" else (None,)):
                for ex in suite.examples(task, L, d, 2, 0):
                    answers[tuple(ex.prompt_ids)] = ex
    calls = []

    def fake_generate(decoder, prompts, max_new, **kw):
        calls.append((len(prompts), len(prompts[0]), max_new))
        exs = [answers[tuple(np.asarray(p).tolist())] for p in prompts]
        know_all = decoder.model == "oracle"
        texts = [e.answer if know_all else " " + e.expected[0] for e in exs]
        toks = [np.frombuffer((t + "\n junk").encode(), np.uint8).astype(np.int32) for t in texts]
        return Generation(toks, ["stop"] * len(toks), [len(p) for p in prompts], 0.0, 0.0, 1)

    class FakeDecoder:  # what evaluate reads of a Decoder; its model: the label
        def __init__(self, model):
            self.model, self.vocab_size = model, 256

    monkeypatch.setattr(ruler, "generate", fake_generate)
    monkeypatch.setattr(ruler, "Decoder", FakeDecoder)
    config = load_config("mqar.py")
    specs = [CheckpointSpec("init", "oracle"), CheckpointSpec("init", "first")]
    opts = ruler.RulerOptions(("niah_multivalue", "fwe"), (1024, 1536), (0.0, 1.0), samples=2,
                              batch_size=2)
    report = run_ruler(config, specs, opts, str(tmp_path),
                       models={"oracle": "oracle", "first": "first"}, progress=False)
    assert {n for n, _, _ in calls} == {2}  # full batches
    budgets = {(L, m) for _, L, m in calls}  # one budget of new tokens per length
    assert sorted(L for L, _ in budgets) == [1024, 1536]
    oracle, first = report["models"]
    assert all(r["exact_match"] == 1.0 and r["recall"] == 1.0 for r in oracle["rows"])
    mv = [r for r in first["rows"] if r["task"] == "niah_multivalue"]
    assert all(r["exact_match"] == 0.0 and r["recall"] == 1 / len(r["answers"][0]["expected"])
               for r in mv)
    assert [r["exact_match"] for r in first["rows"] if r["task"] == "fwe"] == [0.0, 0.0]
    saved = json.loads((tmp_path / "ruler.json").read_text())
    assert [m["label"] for m in saved["models"]] == ["oracle", "first"]
    rows = (tmp_path / "ruler.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * (2 * 2 + 2)
    assert is_png(tmp_path / "ruler_heatmap.png")
    table = ruler.format_table(report)
    assert "RULER exact match, oracle" in table and "RULER exact match, first" in table
    assert re.search(r"average\s+1\.00\s+1\.00", table.split("first")[0])
    depths, lengths, grid = ruler.depth_grid(first["rows"])
    assert depths == [0.0, 1.0] and lengths == [1024, 1536] and grid == [[0.0, 0.0], [0.0, 0.0]]


def test_a_model_generates_through_the_suite(rng):
    """A random byte model through the whole path: prompts decoded greedily, answers cut at the
    newline and scored; the prompt lengths are the asked ones."""
    model = build(tiny_config("KM", vocab=256).model, int(rng.integers(1 << 30)))
    opts = ruler.RulerOptions(("niah_single",), (512,), (0.5,), samples=2, batch_size=2,
                              piece_len=256)
    rows = ruler.evaluate(model, ruler.RulerSuite(value_digits=3), opts)
    (row,) = rows
    assert row["samples"] == 2 and row["prompt_tokens"] == 512
    for a in row["answers"]:
        assert "\n" not in a["answer"]
        assert (a["recall"], a["exact"]) == ruler.score_answer(a["answer"], a["expected"])


def test_training_rows_weigh_the_answer_and_a_saved_run_reads_back(tmp_path, rng):
    """``python -m kimi_k3.ruler train``'s rows: the loss weights sit exactly on the answer and
    the newline after it; its run folder restores (eval.py's load_model) to the same weights."""
    suite = ruler.RulerSuite(value_digits=int(rng.integers(3, 8)))
    b = ruler.training_batch(suite, ("niah_single", "vt"), (700, 900), 4, rng)
    for x, y, w in zip(b["inputs_NxT"], b["targets_NxT"], b["weights_NxT"], strict=True):
        scored = bytes(y[w > 0].astype(np.uint8)).decode()
        assert scored.endswith(".\n") and scored.startswith(" ")
        prompt = bytes(x[: int(np.argmax(w > 0)) + 1].astype(np.uint8)).decode()
        assert prompt.endswith((" is", "they are:"))
        assert np.all(w[int(np.argmax(w > 0)) + len(scored):] == 0)
    config = load_config("ruler_tiny.py")
    config.model.d_model, config.model.mlp_dim = 32, 64
    config.model.mla.kv_lora_rank = config.model.mla.qk_nope_head_dim = 16
    config.model.mla.v_head_dim = 16
    model = build(config.model, int(rng.integers(1 << 30)))
    step_dir = ruler.save_run(config, model, str(tmp_path / "run"), 7)
    again, step = load_model(load_file(str(tmp_path / "run" / "config.py")), str(tmp_path / "run"))
    assert step == 7 and step_dir.endswith("7")
    want, got = split_model(model)[1], split_model(again)[1]
    for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
