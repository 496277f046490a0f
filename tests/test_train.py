"""The trainer, end to end on the CPU.

With the real HybridLM and configs/tiny.py (shrunk to test size by command-line overrides):
- on 8 fake devices, the (data 2, fsdp 2, tensor 2) step equals the one-device step;
- a run killed with SIGKILL resumes from its last checkpoint and then logs the losses of an
  uninterrupted run; a SIGTERM saves a checkpoint and exits cleanly;
- two processes joined by jax.distributed on localhost train one model (their losses are the
  one-device run's), and its checkpoint resumes on a different mesh;
- the tiny config's loss on the stdlib corpus falls below a bound.
With a stand-in model (fast to compile): gradient accumulation, the non-finite-step guard,
shape checks against the mesh, corrupt checkpoints, metrics files.

Subprocesses share a persistent compilation cache, so a program compiles once per session.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import metrics as metrics_lib
from kimi_k3 import model_state, runtime, sharding, train_lib
from kimi_k3.config import add_training_defaults, normalize_rules
from kimi_k3.layers.dense import Dense
from kimi_k3.layers.embed import Embed
from kimi_k3.layers.norms import RMSNorm
from tests.helpers import REPO, TINY, ckpt_steps, env, losses, run_once_compiles


def train_cmd(workdir, *extra) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *TINY, f"--workdir={workdir}", *extra]


def run_train(workdir, cache, *extra, devices=1, timeout=400):
    p = subprocess.run(train_cmd(workdir, *extra), cwd=REPO, env=env(cache, devices),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


# ---------------------------------------------------------------------------------------------
# The real model
# ---------------------------------------------------------------------------------------------


def test_sharded_step_matches_single_device(jax_cache):
    p = subprocess.run([sys.executable, "-m", "tests.train_sharded_check"], cwd=REPO,
                       env=env(jax_cache, devices=8), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.split("RESULT ", 1)[1])
    np.testing.assert_allclose(r["sharded_loss"], r["single_loss"], rtol=2e-6)
    assert r["sharded_init_diff"] == 0.0  # the sharded initialiser draws the same numbers
    assert r["sharded_param_diff"] < 2e-6 * max(1.0, r["param_scale"]), r
    specs = r["specs"]
    assert specs["embed/embedding"] == "P('tensor', 'fsdp')"
    assert "'fsdp'" in specs["tail/0/mlp/wi/kernel"] and "'tensor'" in specs["tail/0/mlp/wi/kernel"]


STEPS = ["--config.train.steps=14", "--config.checkpoint.every_steps=4"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory, jax_cache) -> dict[int, float]:
    """step -> loss of an uninterrupted one-device run of 14 steps."""
    whole = tmp_path_factory.mktemp("whole")
    run_train(whole, jax_cache, *STEPS)
    out = losses(whole)
    assert sorted(out) == list(range(1, 15))
    return out


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, jax_cache, reference):
    steps, killed = STEPS, tmp_path / "killed"

    # Killed once a checkpoint is complete (its step folder exists) and the run is past it.
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(train_cmd(killed, *steps), cwd=REPO, env=env(jax_cache),
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                if ckpt_steps(killed) and max(losses(killed), default=0) >= 6:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, "finished before it could be killed"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    last_logged = max(losses(killed))
    saved = ckpt_steps(killed)
    assert saved and 4 <= saved[-1] < 14 and last_logged < 14

    (killed / "metrics.jsonl").rename(killed / "before_kill.jsonl")
    out = run_train(killed, jax_cache, *steps)
    assert f"resumed from step {saved[-1]}" in out.stderr
    resumed = losses(killed)
    assert sorted(resumed) == list(range(saved[-1] + 1, 15))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-6, abs=1e-6), step


def test_sigterm_saves_a_checkpoint_and_exits_with_the_interrupted_code(tmp_path, jax_cache):
    wd = tmp_path / "run"
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(
            train_cmd(wd, "--config.train.steps=400", "--config.checkpoint.every_steps=1000"),
            cwd=REPO, env=env(jax_cache), stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if max(losses(wd), default=0) >= 3:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    err = (tmp_path / "run.log").read_text()
    assert proc.returncode == runtime.EXIT_INTERRUPTED, err[-3000:]  # not 0: `&&` chains stop there
    assert "SIGTERM received" in err
    saved = ckpt_steps(wd)
    assert saved and 3 <= saved[-1] < 400 and saved[-1] >= max(losses(wd))
    assert f"stopped at step {saved[-1]} of 400 on SIGTERM; saved step {saved[-1]}" in err


def test_two_processes_train_one_model_and_resume_on_another_mesh(tmp_path, jax_cache,
                                                                   reference):
    """Two processes x 2 CPU devices (data 2, fsdp 2) train 4 steps; one process on one device
    then resumes their checkpoint to step 6. Both log the uninterrupted one-device losses."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pair = tmp_path / "pair"
    mesh = ["--config.mesh.data=-1", "--config.mesh.fsdp=2", "--config.checkpoint.every_steps=2"]
    procs = [
        subprocess.Popen(
            train_cmd(pair, "--config.train.steps=4", *mesh,
                      f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                      f"--process_id={i}"),
            cwd=REPO, env=env(jax_cache, devices=2), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    errs = [p.communicate(timeout=500)[1] for p in procs]
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode == 0, err[-4000:]
    assert "process 1 of 2, 2 local / 4 global devices" in errs[1]
    assert ckpt_steps(pair)[-1] == 4
    pair_losses = losses(pair)  # written by process 0 only
    assert sorted(pair_losses) == [1, 2, 3, 4]

    run_train(pair, jax_cache, "--config.train.steps=6")  # 1 device: another mesh
    continued = losses(pair)
    assert sorted(continued) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):  # the lr is constant after warmup: 6 steps of a 14-step run
        assert continued[step] == pytest.approx(reference[step], rel=1e-5), step


LOSS_BOUND = 3.3  # nats per byte; an untrained model starts at ln(256) = 5.55


def test_tiny_loss_falls_below_a_bound_on_the_default_corpus(tmp_path):
    from tests.helpers import load_config

    config = load_config("tiny.py")
    config.model.kda.impl = "recurrent"  # same math as "auto"; faster on a CPU at T = 64
    config.data.seq_len, config.data.global_batch_size = 64, 8
    config.train.steps, config.train.log_every, config.train.eval_every = 40, 10, 0
    config.train.eval_batches = 2
    config.opt.warmup_steps = 10
    config.train.progress_bar = False
    out = train_lib.train(config, str(tmp_path))
    first = losses(tmp_path)[10]
    assert out["train"]["loss"] < LOSS_BOUND < first, (first, out)
    assert out["eval"]["loss"] < 4.0  # held-out stdlib files
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    train_rec = [r for r in records if r["split"] == "train"][-1]
    for key in ("loss", "perplexity", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"):
        assert key in train_rec, key
    assert list((tmp_path / "tensorboard").iterdir())
    assert ckpt_steps(tmp_path) == [40]


# ---------------------------------------------------------------------------------------------
# A stand-in model: the same parameter conventions, compiles in a second
# ---------------------------------------------------------------------------------------------


class StandIn(nnx.Module):
    """Embedding, one mixing matrix over time within each document, a norm, tied head."""

    def __init__(self, seed: int, vocab: int = 64, d: int = 16):
        rngs = nnx.Rngs(seed)
        self.embed = Embed(vocab, d, rngs=rngs)
        self.proj = Dense(d, d, names=("embed", "mlp"), rngs=rngs)
        self.norm = RMSNorm(d)

    def __call__(self, tokens_BxT, segment_ids_BxT):
        x = self.embed(tokens_BxT)
        T = tokens_BxT.shape[1]
        same = (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]) & jnp.tril(
            jnp.ones((T, T), bool))
        w = same / same.sum(-1, keepdims=True)
        x = x + jnp.tanh(self.proj(jnp.einsum("bts,bsd->btd", w, x)))
        return self.embed.attend(self.norm(x))

    def token_nll(self, tokens_BxT, targets_BxT, segment_ids_BxT=None, cache=None):
        """The trainer's contract: per-token NLL [B, T] (and a cache, unused here)."""
        logits = self(tokens_BxT, segment_ids_BxT).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked, None


def standin_config(**opt) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict({"vocab_size": 64})
    add_training_defaults(c)
    c.data.seq_len, c.data.global_batch_size = 16, 8
    c.mesh.data = 1
    c.opt.warmup_steps = 1
    c.opt.update(opt)
    return c


def standin_batches(n: int, poison_at: int | None = None):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        toks = rng.integers(1, 64, (8, 16)).astype(np.int32)
        segs = np.sort(rng.integers(1, 4, (8, 16)), axis=1).astype(np.int32)
        if i == poison_at:
            toks[0, 0] = 0  # the stand-in's poison token (below)
        out.append({"tokens": toks, "segment_ids": segs})
    return out


def run_standin(config, batches, model_cls=StandIn):
    mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
    setup = train_lib.build(config, mesh, model_fn=model_cls)
    state = setup.init_state()
    history = []
    for b in batches:
        with setup.context():
            state, m = setup.train_step(state, train_lib.global_batch(b, setup.batch_sharding, 8))
        history.append((jax.device_get(m), jax.device_get(state["params"])))
    return history


@pytest.mark.parametrize("runs_at_return", [(1.0,), (0.25, 0.75, 0.5)],
                         ids=["synchronous", "partway"])
def test_step_time_counts_the_steps_it_timed(runs_at_return, tmp_path, monkeypatch):
    """However much of a step has run when the call for it returns (all of it, or a varying
    part: both seen on the H200 with the 1B model's micro-batched step), every log window must
    read 1 s per step of a fake clock that advances as the device works: each call first
    finishes the step before it, then runs ``runs_at_return`` of its own, and waiting for the
    newest state runs the rest. Counting steps as finished without waiting misread windows
    (0.75 and 1.5 s per step here; the synchronous case read 0.5 s with an older count)."""
    from tests.helpers import load_config

    clock, ran = {"t": 0.0, "owed": 0.0}, []
    monkeypatch.setattr(train_lib.time, "perf_counter", lambda: clock["t"])
    wait = train_lib._wait_until_ready

    def wait_and_run_the_rest(tree):
        clock["t"], clock["owed"] = clock["t"] + clock["owed"], 0.0
        wait(tree)

    monkeypatch.setattr(train_lib, "_wait_until_ready", wait_and_run_the_rest)
    build = train_lib.build

    def fake_device_build(spec, mesh):
        setup = build(spec, mesh, model_fn=lambda seed: StandIn(seed, spec.model.vocab_size))

        def step(state, batch):
            out = jax.block_until_ready(setup.train_step(state, batch))
            run = runs_at_return[len(ran) % len(runs_at_return)]
            ran.append(run)
            clock["t"], clock["owed"] = clock["t"] + clock["owed"] + run, 1.0 - run
            return out
        return dataclasses.replace(setup, train_step=step)

    monkeypatch.setattr(train_lib, "build", fake_device_build)
    config = load_config("tiny.py")
    config.data.seq_len, config.data.global_batch_size = 16, 8
    config.train.steps, config.train.log_every, config.train.eval_every = 8, 3, 0
    config.train.progress_bar, config.checkpoint.enabled = False, False
    train_lib.train(config, str(tmp_path))
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    times = {r["step"]: r["step_time_s"] for r in records if r["split"] == "train"}
    assert times == {3: 1.0, 6: 1.0, 8: 1.0}, times


def test_one_token_file_gets_a_held_out_tail_and_curves_redrawn_at_each_eval(
        tmp_path, monkeypatch, capsys):
    """The README's recipe, one token file from `python -m kimi_k3.data`: the run holds out
    its tail, and the first screen names the tokenizer, the rule and the sizes on each side.
    curves.png is a PNG, drawn at the eval of step 2 and redrawn at the end (step 4)."""
    from kimi_k3.plots import PNG_SIGNATURE, is_png
    from tests.helpers import load_config

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 64, rng.integers(20, 60)), 0) for _ in range(200)]
    corpus = np.concatenate(docs).astype(np.uint16)
    corpus.tofile(tmp_path / "corpus.bin")
    build = train_lib.build
    monkeypatch.setattr(train_lib, "build", lambda spec, mesh: build(
        spec, mesh, model_fn=lambda seed: StandIn(seed, spec.model.vocab_size)))
    drawn, plot = [], metrics_lib.plot_curves

    def plot_and_keep(*args, **kwargs):
        path = plot(*args, **kwargs)
        drawn.append(open(path, "rb").read())
        return path

    monkeypatch.setattr(metrics_lib, "plot_curves", plot_and_keep)
    config = load_config("tiny.py")
    config.model.vocab_size = 64
    config.data.source, config.data.paths = "tokens", str(tmp_path / "corpus.bin")
    config.data.eos_id, config.data.seq_len, config.data.global_batch_size = 0, 16, 8
    config.train.steps, config.train.log_every, config.train.eval_every = 4, 1, 2
    config.train.eval_batches = 1
    config.train.progress_bar, config.train.tensorboard = False, False
    config.checkpoint.enabled = False
    out = train_lib.train(config, str(tmp_path / "run"))

    lines = capsys.readouterr().err.splitlines()
    data_line = next(x for x in lines if x.startswith("  data "))
    assert "tokenizer none (pre-tokenised uint16 files)" in data_line, data_line
    held = next(x for x in lines if x.startswith("  held out "))
    assert ("tail (the last 5% of the tokens, cut at a document end in corpus.bin): train 1 "
            "file, ") in held, held
    train_tokens, held_tokens = (int(n.replace(",", "")) for n in
                                 re.findall(r"([\d,]+) tokens", held))
    assert train_tokens + held_tokens == len(corpus)
    assert 0.05 <= held_tokens / len(corpus) <= 0.1 and corpus[train_tokens - 1] == 0
    assert out["eval"]["loss"] > 0
    curves = tmp_path / "run" / "curves.png"
    assert is_png(curves) and curves.read_bytes() == drawn[-1]
    assert len(drawn) == 2 and drawn[0] != drawn[1]
    assert all(d.startswith(PNG_SIGNATURE) for d in drawn)


def test_a_held_out_split_short_of_one_batch_says_the_fraction_that_fills_one(tmp_path):
    from kimi_k3 import data as data_lib
    from tests.helpers import load_config

    np.arange(1, 1001, dtype=np.uint16).tofile(tmp_path / "t.bin")  # 1,000 tokens
    config = load_config("tiny.py")
    config.data.source, config.data.paths = "tokens", str(tmp_path / "t.bin")
    config.data.seq_len, config.data.global_batch_size = 16, 8
    config.model.vocab_size = 1024
    split = data_lib.load_split(config.data, 1024)  # 5%: 50 tokens, 3 rows of 16
    hint = train_lib.no_eval_hint(split, 50 // 16, 8, 16)
    assert hint == ("; NO held-out loss: 3 rows of 16 tokens, fewer than one batch of 8 (raise "
                    "data.eval_fraction to 0.14 or give data.eval_paths)")
    config.data.eval_fraction = 0.14
    split = data_lib.load_split(config.data, 1024)
    assert split.eval_tokens // 16 >= 8 and train_lib.no_eval_hint(split, 8, 8, 16) == ""


def test_a_curve_that_cannot_be_drawn_is_a_warning(tmp_path, monkeypatch, caplog):
    w = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False, console=lambda s: None)
    assert w.plot() is None  # nothing written yet: nothing drawn
    w.write(1, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5})

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics_lib, "plot_curves", fail)
    with caplog.at_level(logging.WARNING):
        assert w.plot() is None
    assert "could not draw" in caplog.text and "No space left" in caplog.text
    w.close()


def test_gradient_accumulation_equals_the_one_shot_step():
    one = run_standin(standin_config(), standin_batches(3))  # CPU: microbatch = whole batch
    config = standin_config()
    config.train.microbatch_size = 2  # 4 micro-batches of 2 rows
    four = run_standin(config, standin_batches(3))
    for (m1, p1), (m4, p4) in zip(one, four, strict=True):
        assert float(m4["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
        assert int(m4["targets"]) == int(m1["targets"])
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-6)


def test_micro_batches_put_rows_of_one_document_first_and_keep_each_group():
    """The accumulating step's micro-batches: position i of every micro-batch takes a row of
    group i (rows i A .. i A + A - 1, one device's), each row exactly once, rows with fewer
    documents in earlier micro-batches; so as many micro-batches hold one document per row as
    the group with the fewest such rows allows."""
    rng = np.random.default_rng()
    G, A, T = 6, 4, 12
    docs_B = np.where(rng.random(G * A) < 0.6, 1, rng.integers(2, 5, G * A))
    segs = np.stack([np.sort(rng.choice(np.arange(1, T), n - 1, replace=False)).searchsorted(
        np.arange(T), side="right") + 1 for n in docs_B]).astype(np.int32)
    tokens = rng.permutation(G * A * T).reshape(G * A, T).astype(np.int32)  # distinct rows
    runs = lambda s: 1 + (s[..., 1:] != s[..., :-1]).sum(-1)
    assert (runs(segs) == docs_B).all()
    order = train_lib.micro_batch_order(jnp.asarray(segs), A)
    mb_tokens = np.asarray(train_lib.micro_batches(jnp.asarray(tokens), order))  # [A, G, T]
    mb_docs = runs(np.asarray(train_lib.micro_batches(jnp.asarray(segs), order)))  # [A, G]
    for i in range(G):
        assert sorted(map(tuple, mb_tokens[:, i])) == sorted(map(tuple, tokens[i * A:(i + 1) * A]))
    assert (np.diff(mb_docs, axis=0) >= 0).all()
    singles_per_group = (docs_B.reshape(G, A) == 1).sum(axis=1)
    assert (mb_docs == 1).all(axis=1).sum() == singles_per_group.min()


class PoisonedStandIn(StandIn):
    """Returns NaN logits when token 0 is first in the batch."""

    def __call__(self, tokens_BxT, segment_ids_BxT):
        logits = super().__call__(tokens_BxT, segment_ids_BxT)
        return jnp.where(tokens_BxT[0, 0] == 0, jnp.nan, logits)


def test_a_non_finite_step_is_never_applied_and_stops_or_is_skipped():
    hist = run_standin(standin_config(), standin_batches(3, poison_at=1), PoisonedStandIn)
    (m0, p0), (m1, p1), (m2, p2) = hist
    assert bool(m0["finite"]) and not bool(m1["finite"]) and bool(m2["finite"])
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_array_equal(a, b)  # the NaN step left the parameters alone
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(p2))
    with pytest.raises(FloatingPointError, match=r"step 2: loss nan .* latest checkpoint is step 0"):
        train_lib.check_finite(2, m1, "stop", lambda: 0)
    assert train_lib.check_finite(2, m1, "skip") is False
    assert train_lib.check_finite(1, m0, "stop") is True


def test_shapes_that_do_not_divide_the_mesh_are_refused():
    from jax.sharding import AbstractMesh

    from tests.helpers import load_config

    cfg = load_config("tiny.py")
    abstract = nnx.eval_shape(lambda: model_state.make_model(cfg.model, 0))
    _, state, _ = nnx.split(abstract, nnx.Param, ...)
    params, names = nnx.to_pure_dict(state), sharding.variable_axes(state)
    rules = normalize_rules(cfg.mesh.axis_rules)
    mesh = AbstractMesh((1, 1, 1, 1, 3), mesh_lib.MESH_AXES)  # 4 heads over tensor = 3
    with pytest.raises(ValueError, match=r"params/.*: dimension \d \(logical '(heads|vocab)'\)"
                                         r" of shape .* does not divide by mesh axes tensor"):
        sharding.tree_shardings(params, names, mesh, rules, root="params/")
    with pytest.raises(ValueError, match=r"train.microbatch_size: 6 rows per micro-batch \(of "
                                         r"config.data.global_batch_size=6\) do not divide by "
                                         r"data x fsdp x expert = 2 x 2 x 1 = 4"):
        mesh_lib.check_batch(6, 6, AbstractMesh((2, 2, 1, 1, 1), mesh_lib.MESH_AXES))
    with pytest.raises(ValueError, match=r"train.microbatch_size: 4 does not divide "
                                         r"config.data.global_batch_size=6"):
        mesh_lib.check_batch(6, 4, AbstractMesh((2, 2, 1, 1, 1), mesh_lib.MESH_AXES))


@pytest.mark.parametrize("sizes,devices,want", [
    ((-1, 1, 1, 1), 8, (8, 1, 1, 1)), ((2, -1, 1, 2), 8, (2, 2, 1, 2)),
    ((1, 2, 1, 4), 8, (1, 2, 1, 4)), ((1, 1, 2, -1), 8, (1, 1, 2, 4)),
    ((-1, -1, 1, 1), 8, "only one axis may be -1"), ((3, -1, 1, 1), 8, "do not divide"),
    ((2, 2, 1, 1), 8, "uses 4 devices, but 8 are present"), ((0, 1, 1, 1), 8, "mesh.data: 0"),
    ((1, 1, 0, 8), 8, "mesh.expert: 0"),
])
def test_mesh_shape_from_config(sizes, devices, want):
    # Sizes of (data, fsdp, expert, tensor); a section without "context" has context = 1.
    cfg = ml_collections.ConfigDict(dict(zip(("data", "fsdp", "expert", "tensor"), sizes,
                                             strict=True)))
    if isinstance(want, tuple):
        assert mesh_lib.mesh_shape(cfg, devices) == (*want[:3], 1, want[3])
    else:
        with pytest.raises(ValueError, match=want):
            mesh_lib.mesh_shape(cfg, devices)


# Reading the truncated file, TensorStore's pending callbacks hit Orbax's closed event loop.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path):
    cfg = ml_collections.ConfigDict(dict(every_steps=1, keep=3, async_save=True))
    ck = ckpt_lib.Checkpointer(str(tmp_path), cfg)
    states = {s: {"params": {"w": jnp.full((4, 4), float(s))}, "step": jnp.int32(s)}
              for s in (1, 2)}
    for s, st in states.items():
        ck.save(s, st, {"position": 10 * s})
    ck.wait()
    for f in (tmp_path / "2" / "state").rglob("*"):
        if f.is_file() and "manifest" in f.name:
            f.write_bytes(b"")  # truncated: unreadable
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), states[1])
    step, state, data_state = ck.restore(abstract)
    assert step == 1 and data_state == {"position": 10}
    np.testing.assert_array_equal(state["params"]["w"], 1.0)
    assert (tmp_path / "2.unreadable").exists() and ck.latest_step() == 1
    ck.save(2, states[2], {"position": 20})  # the step can be written again
    ck.close()

    for d in tmp_path.iterdir():  # now every step is unreadable: an error, not a fresh start
        for f in d.rglob("*manifest*"):
            f.write_bytes(b"")
    with pytest.raises(RuntimeError, match="no step could be restored"):
        ckpt_lib.Checkpointer(str(tmp_path), cfg).restore(abstract)


def test_metrics_files_and_mfu(tmp_path):
    w = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=True, console=lambda s: None)
    w.write(10, {"loss": 2.0, "mfu": None})
    w.write(10, {"loss": float("nan")}, split="eval")
    w.close()
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows[0]["step"] == 10 and rows[0]["split"] == "train" and rows[0]["mfu"] is None
    assert math.isnan(rows[1]["loss"])
    assert list((tmp_path / "tensorboard").iterdir())
    assert metrics_lib.peak_flops_per_device("NVIDIA H200") == 989e12
    assert metrics_lib.peak_flops_per_device("TPU v5 lite") == 197e12
    assert metrics_lib.peak_flops_per_device("cpu") is None
    assert metrics_lib.peak_flops_per_device("cpu", 2.0) == 2e12
    assert metrics_lib.mfu(6e9, 1e4, 1e14, 2) == pytest.approx(0.3)


def test_eval_restore_reads_the_parameters_of_a_checkpoint(tmp_path):
    from tests.helpers import build, load_config

    config = load_config("tiny.py")
    config.model.num_layers, config.model.kda_per_mla = 2, 1
    # Random weights from one jitted initialiser (tests/test_eval.py), not op by op.
    _, params, _ = model_state.split_model(build(config.model, 0))
    ck = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), config.checkpoint)
    ck.save(7, {"params": params, "step": jnp.int32(7)}, {"position": 0})
    ck.close()
    model, step = ckpt_lib.restore_model_for_eval(config, str(tmp_path / "checkpoints"))
    assert step == 7
    _, got, _ = model_state.split_model(model)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    config.model.d_model = 64
    with pytest.raises(ValueError, match=r"does not match config.model: .*embed/embedding: "
                                         r"checkpoint \(256, 128\) vs config \(256, 64\)"):
        ckpt_lib.restore_model_for_eval(config, str(tmp_path / "checkpoints" / "7"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt_lib.restore_model_for_eval(config, str(tmp_path / "nowhere"))


def test_run_once_options_leave_the_estimates_scratch_as_it_was():
    """The micro-batch estimate compiles with RUN_ONCE_COMPILER_OPTIONS (LLVM unoptimised): the
    scratch memory it reads is XLA's buffer plan, the same as with XLA's defaults, for the real
    model (a KDA and an MLA layer of configs/tiny.py)."""
    from tests.helpers import load_config

    config = load_config("tiny.py")
    config.model.num_layers, config.model.kda_per_mla = 2, 1
    config.data.seq_len = 64
    mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
    setup = train_lib.build(config, mesh)
    scratch = [train_lib.gradient_scratch_bytes(
        2, 64, mesh, setup.graphdef, setup.rest, setup.abstract_state, setup.batch_sharding,
        setup.rules, options) for options in (None, runtime.RUN_ONCE_COMPILER_OPTIONS)]
    assert scratch[0] > 0 and scratch[0] == scratch[1], scratch
    assert runtime.run_once_compiler_options("gpu") == runtime.RUN_ONCE_COMPILER_OPTIONS
    assert runtime.run_once_compiler_options("tpu") is None


def test_automatic_microbatch_fits_the_memory_it_is_given():
    """train.microbatch_size = 0: from XLA's estimate of the smallest micro-batch's scratch
    memory, the largest micro-batch that fits the device; the whole batch where memory is
    unknown (CPU)."""
    config = standin_config()
    mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
    setup = train_lib.build(config, mesh, model_fn=StandIn)
    assert setup.microbatch_size == 8  # CPU: no device memory known

    def choose(limit):
        return train_lib.choose_microbatch(
            8, 16, mesh, setup.graphdef, setup.rest, setup.abstract_state,
            setup.batch_sharding, setup.rules, limit=limit)

    assert choose(1 << 40) == 8
    assert choose(1) == 1  # nothing fits: the smallest, with a warning
    sizes = [choose(limit) for limit in range(40_000, 200_000, 20_000)]  # bytes: a toy model
    assert sizes == sorted(sizes) and set(sizes) == {1, 2, 4, 8}, sizes


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, list | tuple) else (v,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


def test_weights_are_rounded_to_bf16_once_per_step_not_per_micro_batch(monkeypatch):
    """With float32 parameters and bf16 compute the step rounds Dense's weights once, outside
    the micro-batch loop (``dense.precast``): no weight-shaped float32 -> bf16 conversion is
    left in the loop's body. The step's parameters and loss equal those of the step that
    rounds them in every micro-batch."""
    from tests.helpers import load_config

    config = load_config("tiny.py")
    config.model.num_layers, config.model.kda_per_mla = 2, 1
    config.model.dtype = "bfloat16"
    config.data.seq_len, config.data.global_batch_size = 32, 4
    config.train.microbatch_size = 2
    rng = np.random.default_rng()
    batch = {"tokens": rng.integers(1, 256, (4, 32)).astype(np.int32),
             "segment_ids": np.sort(rng.integers(1, 3, (4, 32)), axis=1).astype(np.int32)}

    def step(monkey: bool):
        with monkeypatch.context() as m:
            if monkey:  # the step as it was: every micro-batch rounds the weights itself
                m.setattr(train_lib, "precast", lambda params, dtype: None)
            mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
            setup = train_lib.build(config, mesh)
            state = setup.init_state()
            b = train_lib.global_batch(batch, setup.batch_sharding, 4)
            with setup.context(), run_once_compiles():  # one step
                jaxpr = jax.make_jaxpr(setup.train_step)(state, b).jaxpr
                new, metrics = setup.train_step(state, b)
        kernels = {tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(state["params"])
                   if p[-1].key == "kernel"}
        # The micro-batch loop: the one scan of 2 steps (the recurrent KDA scans over tokens).
        loop = [e for e in _eqns(jaxpr) if e.primitive.name == "scan" and e.params["length"] == 2]
        assert len(loop) == 1, [e.params["length"] for e in loop]
        in_loop = [e for e in _eqns(loop[0].params["jaxpr"].jaxpr)
                   if e.primitive.name == "convert_element_type"
                   and e.invars[0].aval.dtype == jnp.float32
                   and e.outvars[0].aval.dtype == jnp.bfloat16
                   and tuple(e.invars[0].aval.shape) in kernels]
        return len(in_loop), jax.device_get(new["params"]), float(metrics["loss"])

    n_once, params_once, loss_once = step(False)
    n_each, params_each, loss_each = step(True)
    assert n_once == 0 and n_each >= 10, (n_once, n_each)
    assert loss_once == loss_each
    for a, b in zip(jax.tree.leaves(params_once), jax.tree.leaves(params_each), strict=True):
        np.testing.assert_array_equal(a, b)
