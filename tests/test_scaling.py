"""benchmarks/scaling.py end to end on fake CPU devices (correctness of the script, not speed)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

from kimi_k3.plots import is_png
from tests.helpers import SUBPROCESS_XLA_FLAGS, env

REPO = Path(__file__).resolve().parents[1]


def run_scaling(out_dir, *extra, cache=None, timeout=600):
    # The runs' own XLA flags ride on these (tests.test_train: backend optimisations off). With
    # the session's compilation cache, the one-device run is tests/test_train.py's TINY run
    # (same model, 4 rows of 32 tokens, constant lr after 2 warmup steps): whichever of them
    # runs second reads the initialiser and the step from the cache instead of compiling them.
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
             XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    if cache is not None:
        e = env(cache)
        e.pop("JAX_NUM_CPU_DEVICES")  # scaling.py sets each child's device count
    e.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, str(REPO / "benchmarks" / "scaling.py"), "--config=configs/tiny.py",
           "--platform=cpu", "--steps=4", "--log_every=2", "--per_device_batch=4",
           "--config.data.seq_len=32", "--config.model.num_layers=2", "--config.model.kda_per_mla=1",
           "--config.model.kda.impl=recurrent", "--config.opt.schedule=constant",
           "--config.opt.warmup_steps=2", f"--out_dir={out_dir}", *extra]
    return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True,
                          timeout=timeout)


def test_scaling_runs_on_fake_devices(tmp_path, jax_cache):
    p = run_scaling(tmp_path, "--counts=1,8,16", "--layout=hybrid", cache=jax_cache)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {int(r["devices"]): r for r in csv.DictReader(open(tmp_path / "scaling.csv"))}
    assert sorted(rows) == [1, 8, 16]
    for n in (1, 8):
        assert rows[n]["status"] == "ok"
        assert float(rows[n]["tokens_per_s"]) > 0
        assert math.isfinite(float(rows[n]["final_loss"]))
        assert int(rows[n]["global_batch"]) == 4 * n  # weak scaling: 4 rows per device
    assert rows[16]["status"].startswith("not measured: 8 cpu device(s)")
    table = (tmp_path / "scaling.md").read_text()
    assert "| 8 | 4 x 2 x 1 | 32 |" in table  # hybrid layout: data 4 x fsdp 2
    assert "| 1 | 1 x 1 x 1 | 4 |" in table and "| 1.00 |" in table
    assert is_png(tmp_path / "scaling.png")


def test_scaling_rejects_bad_counts(tmp_path):
    p = run_scaling(tmp_path, "--counts=1,two")
    assert p.returncode != 0
    assert "--counts" in p.stderr and "'1,two'" in p.stderr
