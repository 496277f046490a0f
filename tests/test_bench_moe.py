"""benchmarks/moe_bench.py: its dense one-hot einsum is the MoE layer (outputs and gradients; a
wrong routing is caught), its useful FLOPs are the model's count, its runner turns a crash, a
time limit and a spent budget into rows, and its smoke mode writes both tables (CPU)."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from kimi_k3.config import MoeSpec, model_spec
from kimi_k3.layers.moe import MoE
from kimi_k3.model import _matmul_params
from tests.helpers import load_config

REPO = Path(__file__).resolve().parents[1]
B, T, D, E, F = 2, 12, 16, 8, 12


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_moe_bench",
                                                  REPO / "benchmarks" / "moe_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cache_env(jax_cache, monkeypatch):
    """The benchmark's subprocesses share the session's compilation cache."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax_cache)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def moe_spec(**overrides) -> MoeSpec:
    base = MoeSpec(num_experts=E, top_k=3, expert_dim=F, num_shared=1, shared_dim=F,
                   renormalize=True, routed_scaling_factor=2.446, n_group=1, topk_group=1,
                   first_k_dense=0, router_float32=True, bias_update_rate=1e-3,
                   balance_loss_coef=0.0, capacity_factor=0.0)
    return dataclasses.replace(base, **overrides)


def make_layer(spec: MoeSpec, seed: int, bias) -> MoE:
    """Weights from ``seed`` (the same for any top_k: it changes no shape), routing bias given."""
    layer = MoE(D, spec, rngs=nnx.Rngs(seed))
    layer.bias[...] = jnp.asarray(bias, jnp.float32)
    return layer


def outputs_and_grads(layer: MoE, fn, x, r):
    """y = fn(layer, x) and the gradients of sum(y * r) for the parameters and x."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def run(params, x):
        f = lambda p, x: fn(nnx.merge(graphdef, p, rest, copy=True), x)
        y, vjp = jax.vjp(f, params, x)
        gp, gx = vjp(r)
        return y, gp, gx

    with jax.default_matmul_precision("highest"):
        y, gp, gx = run(params, x)
    grads = traverse_util.flatten_dict(nnx.to_pure_dict(gp), sep="/") | {"x": gx}
    return np.asarray(y), {k: np.asarray(v) for k, v in grads.items()}


def largest_gap(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


@pytest.mark.parametrize("case", [
    {},  # configs/moe_1b.py's kind: renormalised, scaled, a shared expert
    {"top_k": 2, "n_group": 4, "topk_group": 2, "num_shared": 0, "shared_dim": 0,
     "renormalize": False, "routed_scaling_factor": 1.0},
])
def test_onehot_einsum_is_the_layer_and_a_wrong_routing_is_caught(bench, rng, case):
    spec = moe_spec(**case)
    seed, bias = int(rng.integers(1 << 30)), rng.normal(size=E, scale=0.1)
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    layer = make_layer(spec, seed, bias)
    y_ragged, g_ragged = outputs_and_grads(layer, lambda m, x: m(x), x, r)
    y_onehot, g_onehot = outputs_and_grads(layer, bench.onehot_moe, x, r)
    assert largest_gap(y_ragged, y_onehot) < 1e-5
    assert g_ragged.keys() == g_onehot.keys() and {"x", "router/kernel"} <= g_ragged.keys()
    for name in g_ragged:
        assert largest_gap(g_ragged[name], g_onehot[name]) < 1e-5, name
    # The same weights routed to one expert fewer: the comparison above would have seen it.
    wrong = make_layer(dataclasses.replace(spec, top_k=spec.top_k - 1), seed, bias)
    y_wrong, _ = outputs_and_grads(wrong, bench.onehot_moe, x, r)
    assert largest_gap(y_ragged, y_wrong) > 1e-2


def test_useful_flops_are_the_models_count_of_the_mixture(bench):
    spec = model_spec(load_config("moe_1b.py").model, backend="cpu")
    assert bench.useful_flops("ragged", spec, 10) == 6 * 10 * _matmul_params(spec)["moe"]
    e = spec.moe
    assert bench.useful_flops("dense_equiv", spec, 1) == 6 * 3 * spec.d_model * (
        e.top_k * e.expert_dim + e.shared_dim)


def _job(bench, tmp_path, key, code, cap_s, expect):
    return bench.Job(key=key, cmd=[sys.executable, "-c", code], log=tmp_path / f"{key}.log",
                     cap_s=cap_s, expect=expect)


def test_a_crash_a_time_limit_and_a_spent_budget_become_rows(bench, tmp_path):
    row = {"section": "layer", "name": "ragged", "batch": 1, "seq": 8, "tokens": 8, "ms": 1.0,
           "status": "ok"}
    crash = _job(bench, tmp_path, "crash", "import sys; print('RESULT ' + sys.argv[-1], "
                 "flush=True); sys.exit('RESOURCE_EXHAUSTED: out of memory')", 60,
                 [{"section": "check", "name": "ragged vs onehot"},
                  {**row, "batch": 1}, {**row, "batch": 8}])
    crash.cmd.append(json.dumps(row))
    slow = _job(bench, tmp_path, "slow", "import time; time.sleep(60)", 1.0, [row])
    bench.run_jobs([crash, slow], 1, time.monotonic() + 100, {})
    rows = bench.layer_rows(crash)
    assert [(r["name"], r.get("batch"), r["status"][:13]) for r in rows] == [
        ("ragged", 1, "ok"), ("ragged vs onehot", None, "crashed (exit"),
        ("ragged", 8, "crashed (exit")]
    assert "RESOURCE_EXHAUSTED" in rows[-1]["status"]
    assert bench.layer_rows(slow)[0]["status"] == "stopped at its limit of 1 s"
    late = _job(bench, tmp_path, "late", "pass", 60, [row])
    bench.run_jobs([late], 1, time.monotonic() + bench.MIN_START_S / 2, {})
    assert late.proc is None and bench.layer_rows(late)[0]["status"].startswith("skipped")


def test_a_training_run_stopped_at_its_limit_reports_the_steps_it_timed(bench, tmp_path):
    a = bench.parse_args(["--smoke"])
    workdir = tmp_path / "train_moe"
    workdir.mkdir()
    lines = [{"step": 1, "split": "train", "loss": 5.0}] + [
        {"step": s, "split": "train", "loss": 4.0, "tokens_per_s": tps, "step_time_s": 64 / tps,
         "mfu": None} for s, tps in ((2, 100.0), (3, 300.0), (4, 200.0))]
    (workdir / "metrics.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 5, "spl')  # killed mid-line
    job = bench.Job(key="train moe", cmd=["x"], log=tmp_path / "train_moe.log", cap_s=1,
                    expect=[{"section": "train", "name": "moe", "config": a.moe_config}],
                    workdir=workdir, rc=-9, timed_out=True, limit_s=1)
    r = bench.train_row(job, a)
    assert r["status"].startswith("partial (3 steps): stopped at its limit")
    assert r["tokens_per_s"] == 200.0 and r["steps_timed"] == 3
    assert r["active_params"] < r["params"]
    table = "\n".join(bench.train_table([r], a))
    assert "| moe | moe_tiny.py |" in table and "| 200 |" in table


def _table_rows(md: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in md.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows}


def test_smoke_layer_mode_checks_and_times_every_variant(bench, tmp_path, cache_env):
    md = bench.main(["--smoke", "--mode=layer", f"--out_dir={tmp_path}",
                     f"--work_dir={tmp_path / 'work'}"])
    assert "-> **agree**" in md
    rows = _table_rows(md)
    for variant in ("ragged", "onehot", "dense", "capacity", "dense_equiv"):
        assert float(rows[variant][2]) > 0, rows[variant]  # ms
    assert rows["ragged"][4] == "1.00"  # time / ragged
    assert (tmp_path / "moe_bench.md").read_text() == md
    with open(tmp_path / "moe_bench.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [(r["section"], r["name"], r["status"]) for r in csv_rows] == [
        ("check", "ragged vs onehot", "agree")] + [
        ("layer", v, "ok") for v in ("ragged", "onehot", "dense", "capacity", "dense_equiv")]


def test_smoke_train_mode_measures_the_dense_and_the_moe_config(bench, tmp_path, cache_env):
    md = bench.main(["--smoke", "--mode=train", f"--out_dir={tmp_path}",
                     f"--work_dir={tmp_path / 'work'}"])
    rows = _table_rows(md)
    assert rows["dense"][1] == "tiny.py" and rows["moe"][1] == "moe_tiny.py"
    for run in ("dense", "moe"):
        assert rows[run][-1] == "ok", rows[run]
        assert float(rows[run][8].replace(",", "")) > 0  # tokens/s
    assert "moe / dense: tokens/s x" in md
    assert "===== train moe:" in (tmp_path / "moe_bench.log").read_text()
