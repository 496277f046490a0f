"""A run folder is its own config: eval.py, generate.py and a resume take it alone, overrides
still apply on top (and are said), and a resume says what changed since the last start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, TINY, env

TINY_ANYWHERE = [f"--config={REPO / 'configs' / 'tiny.py'}", *TINY[1:]]


def run_py(script, cwd, cache, *args, timeout=300):
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd, env=env(cache),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory, jax_cache):
    """A 2-step run whose model differs from configs/tiny.py's (d_model 64, an override no
    other config carries): reading it with another config would fail."""
    folder = tmp_path_factory.mktemp("runs") / "r"
    p = run_py("train.py", folder.parent, jax_cache, *TINY_ANYWHERE, f"--workdir={folder}",
               "--config.model.d_model=64", "--config.train.steps=2",
               "--config.checkpoint.every_steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    return folder


def test_eval_takes_the_run_folder_alone_with_overrides_on_top(run, tmp_path, jax_cache):
    # the run trained on everything (eval_fraction 0): an override gives eval its held-out split
    p = run_py("eval.py", tmp_path, jax_cache, f"--checkpoint={run}", "--workdir=ev",
               "--context_lengths=32", "--max_windows=1", "--config.data.eval_fraction=0.05")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (f"--config={run} (the run's own config, from --checkpoint); overrides: "
            f"--config.data.eval_fraction=0.05") in p.stderr
    report = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert [m["label"] for m in report["models"]] == ["r"]


def test_a_checkpoint_in_a_run_folder_brings_its_own_config(run, tmp_path, jax_cache):
    """Without @CONFIG a checkpoint of a run folder is read with that run's config, whatever
    --config eval.py was given (which then only says which held-out data to score)."""
    p = run_py("eval.py", tmp_path, jax_cache, f"--config={REPO / 'configs' / 'tiny.py'}",
               f"--checkpoint=mine={run}/checkpoints/2", "--workdir=ev", "--context_lengths=32",
               "--max_windows=1", "--config.model.num_layers=2", "--config.model.kda_per_mla=1")
    assert p.returncode == 0, p.stderr[-3000:]


def test_generate_takes_the_run_folder_alone(run, tmp_path, jax_cache):
    p = run_py("generate.py", tmp_path, jax_cache, f"--workdir={run}", "--prompt_ids=100,101",
               "--max_new_tokens=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"--config={run} (the run's own config, from --workdir)" in p.stderr


def test_no_config_and_no_run_folder_is_one_line(tmp_path, jax_cache):
    p = run_py("eval.py", tmp_path, jax_cache, "--checkpoint=init", "--workdir=ev")
    assert p.returncode == 2 and not (tmp_path / "ev").exists()
    assert ("--config: not given, and no --checkpoint names a run folder with its own config"
            in p.stderr) and "Traceback" not in p.stderr


def test_a_resume_says_what_changed_and_what_it_does_to_the_schedule(run, jax_cache):
    p = run_py("train.py", run.parent, jax_cache, f"--config={run}", f"--workdir={run}",
               "--config.train.steps=3", "--config.opt.lr=0.001")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "changed since the last start: opt.lr: 0.003 -> 0.001" in p.stderr
    assert "changed since the last start: train.steps: 2 -> 3" in p.stderr
    assert "the learning-rate schedule follows the new fields from step 2" in p.stderr
    again = run_py("train.py", run.parent, jax_cache, f"--config={run}", f"--workdir={run}",
                   "--config.train.steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "opt.lr" not in again.stderr  # the run's own config kept the new rate


def test_a_checkpoint_config_that_does_not_exist_is_an_error_not_a_fallback(run, tmp_path,
                                                                              jax_cache):
    p = run_py("eval.py", tmp_path, jax_cache, f"--checkpoint={run}@configs/no_such.py",
               "--workdir=ev", "--context_lengths=32", "--max_windows=1")
    assert p.returncode == 2 and not (tmp_path / "ev").exists(), p.stderr[-3000:]
    assert "no config file 'configs/no_such.py'" in p.stderr and "Traceback" not in p.stderr


def test_a_record_from_an_earlier_version_takes_the_defaults_of_fields_added_since(tmp_path):
    """A run folder whose config.json predates some fields (here: the bf16 state switches, the
    internals interval, the experts' remat and the decoding kernel) loads with those fields at
    their defaults and passes the checks; the fields it has keep their values."""
    from kimi_k3.config import run_spec
    from kimi_k3.config_files import load_config
    from kimi_k3.run_dir import write_config

    config = load_config(str(REPO / "configs" / "moe_tiny.py"))
    config.train.steps = 7
    write_config(config, str(tmp_path), 0)
    record = json.loads((tmp_path / "config.json").read_text())
    for section, field in (("opt", "moments_dtype"), ("train", "grad_accum_dtype"),
                           ("train", "internals_every")):
        del record[section][field]
    del record["model"]["moe"]["remat_experts"], record["model"]["mla"]["decode_impl"]
    (tmp_path / "config.json").write_text(json.dumps(record))
    for where in (tmp_path, tmp_path / "config.json"):
        loaded = load_config(str(where))
        assert loaded.opt.moments_dtype == "float32" and loaded.train.internals_every == -1
        assert loaded.train.steps == 7 and loaded.model.moe.remat_experts is False
        spec = run_spec(loaded, backend="cpu")
        assert spec.train.grad_accum_dtype == "float32" and spec.model.moe.num_experts > 0
