"""lm-evaluation-harness in process (kimi_k3/lm_eval_adapter.py, eval.py --lm_eval_tasks).

Every request kind is held to the model's logits computed directly, in float64: the sum of the
log-softmax at each scored token, over one whole-sequence forward of the request alone. The
harness runs the local tasks of tests/fixtures/lm_eval (one per request kind, read from local
jsonl: nothing downloads), its metrics held to the same direct figures; and two CPU processes
joined by jax.distributed (process 0 drives the harness, process 1 follows) give the one-process
results.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from lm_eval.api.instance import Instance

from kimi_k3.checkpoint import load_model
from kimi_k3.data import TextTokenizer
from kimi_k3.evaluation import HF_OFFLINE_ENV, prefix_token
from kimi_k3.generate import generate
from kimi_k3.lm_eval_adapter import (
    KimiLM,
    TokenEngine,
    cut_at_stop,
    evaluate_tasks,
    pack_rows,
    padded_pieces,
)
from tests.helpers import REPO, build, env, fast_jit, load_config, tiny_config

FIXTURES = REPO / "tests" / "fixtures" / "lm_eval"
TASKS = ("k3_choice", "k3_rolling", "k3_generate")
# the two-process run and the in-process one: configs/mqar.py's two-layer byte model, untrained
CLI_CONFIG = "mqar.py"
ROW, PIECE = 48, 16  # tokens per packed row, per prefill piece: small, so both paths are taken


def text(rng, n: int) -> str:
    return "".join(chr(c) for c in rng.integers(32, 127, n))


def req(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


@pytest.fixture(scope="module")
def lm():
    """A random two-layer byte model (fresh weights every run) behind the adapter."""
    model = build(tiny_config("KM", vocab=256).model, int.from_bytes(os.urandom(2), "little"))
    engine = TokenEngine(model, row_len=ROW, batch_size=2, piece_len=PIECE)
    return KimiLM(engine, TextTokenizer(""), prefix_id=10)


_forward = fast_jit(lambda model, tokens_BxT: model(tokens_BxT))
DIRECT_SHAPE = (12, 160)  # every direct forward: one compilation


def direct_logp(model, seqs):
    """log p(token t | tokens < t) [N, T-1] in float64, one forward per sequence (padded at the
    end to one length, which causality keeps from the real tokens)."""
    x = np.zeros(DIRECT_SHAPE, np.int32)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
    logits = np.asarray(_forward(model, jnp.asarray(x)), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return logp, logits


def test_packing_fills_rows_best_fit_decreasing(rng):
    lengths = rng.integers(1, 40, 60).tolist()
    rows = pack_rows(lengths, 40)
    assert sorted(i for r in rows for i in r) == list(range(60))
    assert all(sum(lengths[i] for i in r) <= 40 for r in rows)
    assert len(rows) <= math.ceil(11 / 9 * math.ceil(sum(lengths) / 40)) + 1
    assert max(len(r) for r in rows) >= 2
    with pytest.raises(ValueError, match="41 tokens, outside"):
        pack_rows([41], 40)
    assert [padded_pieces(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]


def test_loglikelihood_is_the_log_softmax_of_the_direct_logits(lm, rng):
    """Packed requests (several to a row, each its own segment), one with an empty context (the
    prefix token), and ones longer than a row (the decoder's prefill and steps)."""
    pairs = [(text(rng, int(rng.integers(1, 30))), text(rng, int(rng.integers(1, 8))))
             for _ in range(9)]
    pairs += [("", text(rng, 5)), (text(rng, 63), text(rng, 3)), (text(rng, 63), text(rng, 2))]
    got = lm.loglikelihood([req("loglikelihood", c, x) for c, x in pairs])
    seqs = [list((c or "\n").encode()) + list(x.encode()) for c, x in pairs]
    logp, logits = direct_logp(lm.engine.model, seqs)
    for (c, x), s, (lp, greedy), i in zip(pairs, seqs, got, range(len(seqs)), strict=True):
        k = len(x.encode())
        pos = np.arange(len(s) - k - 1, len(s) - 1)
        want = logp[i, pos, s[-k:]].sum()
        assert lp == pytest.approx(want, abs=2e-4 * k), (c, x)
        assert greedy == bool(np.all(logits[i, pos].argmax(-1) == s[-k:]))
    # a continuation the model would pick greedily is reported as such (an ASCII byte: one
    # character; among 12 contexts one whose argmax is ASCII, but for 2^-12 of random models)
    ctxs = [text(rng, 12) for _ in range(12)]
    best = direct_logp(lm.engine.model, [list(c.encode()) for c in ctxs])[1][:, 11].argmax(-1)
    ctx, first = next((c, int(b)) for c, b in zip(ctxs, best, strict=True) if b < 128)
    assert lm.loglikelihood([req("loglikelihood", ctx, chr(first))])[0][1] is True


def test_rolling_scores_every_token_at_any_length(lm, rng):
    """Texts up to a row are packed; longer ones go through the Scorer's pieces, padded to a
    bucket of pieces: each the sum over its tokens, the first predicted from the prefix."""
    docs = [text(rng, int(n)) for n in (5, 30, 47, 48, 82, 95)]  # the last two: 6 pieces
    got = lm.loglikelihood_rolling([req("loglikelihood_rolling", d) for d in docs])
    seqs = [[10] + list(d.encode()) for d in docs]
    logp, _ = direct_logp(lm.engine.model, seqs)
    for i, s in enumerate(seqs):
        want = logp[i, np.arange(len(s) - 1), s[1:]].sum()
        assert got[i] == pytest.approx(want, abs=2e-4 * len(s)), len(s)


def test_generate_until_is_greedy_decoding_cut_at_the_stop_strings(lm, rng):
    prompts = [text(rng, int(rng.integers(4, 20))) for _ in range(2)]  # one batch
    free = generate(lm.engine.model, [list(p.encode()) for p in prompts], 12)
    free_text = [TextTokenizer("").decode(t) for t in free.tokens]
    stop = free_text[0][3:5]  # a two-character stop inside the first continuation
    until = [stop, "\n"]
    got = lm.generate_until([req("generate_until", p, {"until": until, "max_gen_toks": 12})
                             for p in prompts])
    assert got == [cut_at_stop(t, until) for t in free_text]
    assert len(got[0]) <= 3
    assert cut_at_stop("abcXYdeXY", ["Y", "d"]) == "abcX"


@pytest.fixture(scope="module")
def harness():
    """The fixture tasks through the harness in this process, on CLI_CONFIG's untrained model
    (what the two-process run restores with --checkpoint=init)."""
    for k, v in HF_OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    config = load_config(CLI_CONFIG)
    model, _ = load_model(config, "init")
    tok = TextTokenizer("")
    engine = TokenEngine(model, row_len=256, batch_size=4, piece_len=256)
    lm = KimiLM(engine, tok, prefix_token(config, tok))
    old = os.getcwd()
    os.chdir(REPO)  # the task files name their data relative to the repository
    try:
        results = evaluate_tasks(lm, TASKS, str(FIXTURES))
    finally:
        os.chdir(old)
    return lm, results


def test_the_harness_runs_local_tasks_of_each_kind(harness):
    """acc, bits per byte and exact match as the harness reports them, from the adapter's
    answers computed here (each answer already held to the direct logits above)."""
    lm, results = harness
    r = results["results"]
    docs = [json.loads(x) for x in (FIXTURES / "choice.jsonl").read_text().splitlines()]
    acc = np.mean([int(np.argmax([ll for ll, _ in lm.loglikelihood(
        [req("loglikelihood", d["question"], c) for c in d["choices"]])])) == d["answer"]
        for d in docs])
    assert r["k3_choice"]["acc,none"] == pytest.approx(acc)
    texts = [json.loads(x)["text"] for x in (FIXTURES / "text.jsonl").read_text().splitlines()]
    ll = lm.loglikelihood_rolling([req("loglikelihood_rolling", t) for t in texts])
    bpb = -sum(ll) / math.log(2) / sum(len(t.encode()) for t in texts)
    assert r["k3_rolling"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-6)
    qa = [json.loads(x) for x in (FIXTURES / "qa.jsonl").read_text().splitlines()]
    outs = lm.generate_until([req("generate_until", d["question"],
                                  {"until": ["\n", "."], "max_gen_toks": 8}) for d in qa])
    em = np.mean([o == d["answer"] for o, d in zip(outs, qa, strict=True)])
    assert r["k3_generate"]["exact_match,none"] == pytest.approx(em)
    assert not any("\n" in o or "." in o for o in outs)


def test_two_processes_drive_and_follow(tmp_path, jax_cache, harness):
    """eval.py on two processes joined by jax.distributed: process 0 runs the harness and
    writes lm_eval.json, process 1 scores its share; the results are the one-process ones."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "eval.py", f"--config=configs/{CLI_CONFIG}", "--checkpoint=init",
           f"--workdir={tmp_path / 'out'}", f"--lm_eval_tasks={','.join(TASKS)}",
           f"--lm_eval_include={FIXTURES}", "--piece_len=256", "--batch_size=4",
           f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
    procs = [subprocess.Popen(cmd + [f"--process_id={i}"], cwd=REPO, env=env(jax_cache),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    assert "process 1 of 2" in outs[1][1]
    got = json.loads((tmp_path / "out" / "lm_eval.json").read_text())["init"]["results"]
    want = harness[1]["results"]
    for task in TASKS:
        for metric, value in want[task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert got[task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
