"""python -m kimi_k3.sweep: variants checked before anything trains, one variant per job
(--only), an interrupted sweep resumed, finished variants skipped, one evaluation and report of
them all (--eval_only too), a failing variant named with its log, MQAR cells reused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kimi_k3 import mqar, plots, sweep
from kimi_k3.config import ConfigError
from tests.helpers import REPO, TINY, env

# tests/helpers.py's TINY (a "KM" stack of configs/tiny.py at test size) as sweep overrides.
SET = [f"--set={a.removeprefix('--config.')}" for a in TINY if a.startswith("--config.")]
HELD_OUT = ["--eval_config=configs/tiny.py", "--context_lengths=32", "--piece_len=32",
            "--max_windows=2", "--short_docs=concat"]


def sweep_cmd(out, *args) -> list[str]:
    return [sys.executable, "-m", "kimi_k3.sweep", f"--out={out}", *SET, *HELD_OUT, *args]


def run_sweep(out, cache, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(sweep_cmd(out, *args), cwd=REPO, env=env(cache), capture_output=True,
                          text=True, timeout=timeout)


def log_stamp(out, label):
    s = os.stat(out / "runs" / label / "train.log")
    return s.st_size, s.st_mtime_ns


def test_variants_are_parsed_and_checked_before_anything_trains(monkeypatch):
    monkeypatch.chdir(REPO)
    assert sweep.parse_variant("lr=configs/tiny.py;opt.lr=1e-3; train.steps=5") == (
        "lr", "configs/tiny.py", ("opt.lr=1e-3", "train.steps=5"))
    variants = sweep.make_variants(["lr=configs/tiny.py;opt.lr=1e-3"], ["0", "1", "all"], 4,
                                   "tiny", ["train.steps=7"])
    assert [(v.label, v.pattern, v.steps) for v in variants] == [
        ("all-MLA", "MMMM", 7), ("1to1", "KMKM", 7), ("all-KDA", "KKKK", 7),
        ("lr", "KKKM", 7)]
    assert variants[-1].train_args == ["--config=configs/tiny.py", "--config.train.steps=7",
                                       "--config.opt.lr=1e-3"]
    bad = {
        "expected LABEL=CONFIG": (["tiny"], [], []),
        "label 'a b' must be": (["a b=configs/tiny.py"], [], []),
        "--variant a: configs/nope.py: no config file": (["a=configs/nope.py"], [], []),
        "--variant a: configs/ablate_ratio.py:rato=3: .*unknown key": (
            ["a=configs/ablate_ratio.py:rato=3"], [], []),
        "--variant a: train.stepz=3: .*did you mean --config.train.steps": (
            ["a=configs/tiny.py;train.stepz=3"], [], []),
        "--variant a: .*train.steps=abc": (["a=configs/tiny.py;train.steps=abc"], [], []),
        "without --config": (["a=configs/tiny.py;--config.opt.lr=1"], [], []),
        "--set: opt.lrr=1: .*opt.lr": (["a=configs/tiny.py"], [], ["opt.lrr=1"]),
        "--ratios: '-1' is not a ratio": ([], ["-1"], []),
        "given more than once": (["a=configs/tiny.py", "a=configs/tiny.py"], [], []),
        "config.model.kda_per_mla": (["a=configs/tiny.py;model.kda_per_mla=-2"], [], []),
        "no variant given": ([], [], []),
    }
    for match, (specs, ratios, shared) in bad.items():
        with pytest.raises(ConfigError, match=match):
            sweep.make_variants(specs, ratios, None, None, shared)


def test_a_bad_variant_is_one_line_and_exit_2_before_anything_is_written(tmp_path, jax_cache):
    out = tmp_path / "sweep"
    p = run_sweep(out, jax_cache, "--variant=a=configs/tiny.py;opt.lrr=1")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("sweep.py: error: --variant a: opt.lrr=1: --config.opt.lrr: "
                                "config.opt has no field 'lrr'; did you mean --config.opt.lr?")
    assert not out.exists()


def test_only_then_interrupted_then_resumed_sweep_skips_finished_variants_and_reports(
        tmp_path, jax_cache):
    out = tmp_path / "sweep"
    a = "--variant=a=configs/tiny.py"  # KM, 3 steps
    b = "--variant=b=configs/tiny.py;model.kda_per_mla=0;train.steps=120"  # MM, stopped early

    # One variant per job: --only trains it and evaluates nothing.
    p = run_sweep(out, jax_cache, a, b, "--set=train.steps=3", "--only=a")
    assert p.returncode == 0, p.stderr
    assert "not finished yet: b" in p.stderr and "--eval_only" in p.stderr
    assert json.loads((out / "runs/a/sweep_done.json").read_text())["step"] == 3
    assert not (out / "runs/b").exists() and not (out / "report").exists()
    a_log = log_stamp(out, "a")

    # The whole sweep, stopped by SIGTERM while b trains: passed on to train.py, which saves;
    # the sweep exits 75 naming b. a is not trained again.
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(sweep_cmd(out, a, b, "--set=train.steps=3"), cwd=REPO,
                                env=env(jax_cache), stdout=subprocess.DEVNULL, stderr=err)
        b_log = out / "runs/b/train.log"
        deadline = time.monotonic() + 240
        while not (b_log.exists() and "[train] step 1:" in b_log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "stderr").read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75, (tmp_path / "stderr").read_text()
    stderr = (tmp_path / "stderr").read_text()
    assert "a: finished at step 3 with these arguments; skipped" in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("sweep.py: variant 'b': stopped at step") and "on SIGTERM" in last
    assert "run the same command again" in last and str(b_log) in last
    stopped = sorted(int(s.name) for s in (out / "runs/b/checkpoints").iterdir())[-1]
    assert 0 < stopped < 120 and not (out / "runs/b/sweep_done.json").exists()

    # The same command again: a skipped, b resumed from its checkpoint, then one evaluation.
    p = run_sweep(out, jax_cache, a, b, "--set=train.steps=3")
    assert p.returncode == 0, p.stderr
    assert log_stamp(out, "a") == a_log  # never started again
    assert f"resumed from step {stopped}" in b_log.read_text()
    report = out / "report"
    result = json.loads((report / "eval.json").read_text())
    assert [(m["label"], m["step"]) for m in result["models"]] == [("a", 3), ("b", 120)]
    for png in ("eval_perplexity.png", "eval_loss_by_position.png", "loss_curves.png"):
        assert plots.is_png(report / png), png
    md = (report / "report.md").read_text()
    assert "## Held-out perplexity at 32 tokens" in md
    assert "| a | `KM` | 1 | 1 |" in md and "| b | `MM` | 0 | 2 |" in md
    assert "python -m kimi_k3.sweep" in md and "--workdir=" in md and "python eval.py" in md

    # --eval_only trains nothing, names what has not finished, and reuses the evaluation.
    p = run_sweep(out, jax_cache, a, b, "--variant=c=configs/tiny.py", "--set=train.steps=3",
                  "--eval_only")
    assert p.returncode == 0, p.stderr
    assert "not finished: c (not started, left out)" in p.stderr
    assert "evaluation: unchanged" in p.stderr and not (out / "runs/c").exists()
    assert "**Not finished:** c (not started, left out)." in (report / "report.md").read_text()
    assert log_stamp(out, "a") == a_log


def test_a_failing_variant_stops_the_sweep_naming_it_and_its_log(tmp_path, jax_cache):
    out = tmp_path / "sweep"
    p = run_sweep(out, jax_cache, "--variant=bad=configs/tiny.py;data.source=text;"
                  f"data.paths={tmp_path}/none.txt", "--variant=next=configs/tiny.py")
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("sweep.py: error: variant 'bad': train.py exited with 1: data.paths")
    assert f"its log: {out}/runs/bad/train.log" in last
    assert "matches no file" in (out / "runs/bad/train.log").read_text()
    assert not (out / "runs/next").exists() and not (out / "report").exists()


def test_mqar_trains_each_pattern_once_and_reuses_its_cells(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    calls = []

    def fake_train(cfg, spec, **kw):
        calls.append((cfg.model.pattern, spec.seq_len))
        return {"accuracy": 0.5, "final_loss": 1.0, "params": 10, "seconds": 0.0}

    monkeypatch.setattr(mqar, "train_mqar", fake_train)
    variants = [sweep.Variant("x", "c", pattern="KKKM"), sweep.Variant("y", "c", pattern="KKKM"),
                sweep.Variant("z", "c", pattern="MMMM")]
    table = sweep.run_mqar(variants, str(tmp_path), "configs/mqar.py:steps=3", (32,))
    assert calls == [("KKKM", 32), ("MMMM", 32)]
    assert "| x/y | KKKM | 0.500 |" in table and "| z | MMMM | 0.500 |" in table
    assert sweep.run_mqar(variants, str(tmp_path), "configs/mqar.py:steps=3", (32,)) == table
    assert len(calls) == 2  # the second call trained nothing
    assert plots.is_png(tmp_path / "report/mqar/mqar_sweep.png")
