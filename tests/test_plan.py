"""The planner (kimi_k3.plan): its estimate against XLA's compiled memory analysis on 8 CPU
devices under every mesh axis, its state bytes against the real shardings, the trainer's
refusal of a step that cannot fit, and the command."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

from kimi_k3 import mesh as mesh_lib
from kimi_k3 import plan, train_lib
from kimi_k3.config import ConfigError
from tests.helpers import REPO, env, load_config

# On XLA:CPU the whole step's memory is within this of the estimate (BENCHMARKS.md has the
# GPU's figures).
TOLERANCE = 0.15


def test_the_estimate_follows_xla_on_eight_devices_under_every_axis(jax_cache):
    p = subprocess.run([sys.executable, str(REPO / "tests" / "plan_xla_check.py")],
                       cwd=REPO, env=env(jax_cache, devices=8), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(ln[5:]) for ln in p.stdout.splitlines() if ln.startswith("PLAN ")]
    assert {r["case"] for r in rows} == {"data", "fsdp", "fsdp_tensor", "fsdp_context",
                                         "fsdp_expert", "fsdp_micro_full"}
    for r in rows:
        assert r["params"][0] == r["params"][1] and r["opt_state"][0] == r["opt_state"][1], r
        ratio = r["estimate"] / r["xla"]
        assert abs(ratio - 1) <= TOLERANCE, (r["case"], ratio, r)


def test_activations_grow_with_the_rows_and_remat_keeps_less():
    config = load_config("tiny.py")
    sizes = dict.fromkeys(plan.MESH_AXES, 1)
    kept = {}
    for remat in ("none", "dots", "full"):
        config.model.remat = remat
        act = plan.activations(config, sizes, "cpu")
        kept[remat] = sum(act.at(4).values())
        assert sum(act.at(8).values()) > kept[remat]
    assert kept["none"] > kept["dots"] > kept["full"] > 0


def test_the_trainer_refuses_a_step_that_cannot_fit_and_names_what_would():
    config = load_config("tiny.py")
    mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
    assert train_lib.plan_microbatch(config, mesh, limit=None) == 8  # CPU: the whole batch
    big = 64 * plan.GiB
    assert train_lib.plan_microbatch(config, mesh, limit=big) == 8
    one = plan.memory_plan(config, dict(mesh.shape), 1, plan.local_device(big), big).total
    # Room for one row per micro-batch but not eight: the largest that fits is smaller.
    limit = int((one + plan.GiB // 64) / plan.MEMORY_HEADROOM)
    chosen = train_lib.plan_microbatch(config, mesh, limit=limit)
    assert 1 <= chosen < 8
    with pytest.raises(ConfigError) as err:
        train_lib.plan_microbatch(config, mesh, microbatch=8, limit=limit)
    text = str(err.value)
    assert "config.train.microbatch_size: 8 rows per micro-batch need about" in text
    assert f"--config.train.microbatch_size={chosen}" in text
    assert "--config.train.memory_check=False" in text
    assert train_lib.plan_microbatch(config, mesh, 8, check=False, limit=limit) == 8
    with pytest.raises(ConfigError, match="nothing on this mesh fits"):
        train_lib.plan_microbatch(config, mesh, limit=plan.RESERVE_BYTES)


def _near_miss_limit(config, mesh):
    """A device memory under which the planner picks some micro-batch a and the next one, b,
    is a near miss (past the headroom, within the card): (limit, a, b)."""
    sizes = dict(mesh.shape)
    allowed = plan.microbatch_sizes(int(config.data.global_batch_size), sizes)
    a, b = allowed[1], allowed[2]
    total = lambda m: plan.memory_plan(config, sizes, m, plan.local_device(None)).total
    return max(total(b), int(total(a) / plan.MEMORY_HEADROOM) + 1), a, b


@pytest.mark.parametrize("fits", [True, False])
def test_a_near_miss_of_the_plan_is_decided_by_the_compiled_step(monkeypatch, fits):
    config = load_config("tiny.py")
    mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
    monkeypatch.setattr(plan, "RESERVE_BYTES", 1 << 20)  # a tiny model: room to tell apart
    limit, a, b = _near_miss_limit(config, mesh)
    assert plan.largest_microbatch(config, dict(mesh.shape), plan.local_device(limit),
                                   limit)[0] == a
    assert train_lib.near_miss(config, mesh, a, limit) == b
    assert train_lib.near_miss(config, mesh, b, limit) is None  # the next one is past the card
    assert train_lib.near_miss(config, mesh, a, 2 * limit) is None  # b fits the headroom there
    monkeypatch.setattr(train_lib, "device_memory_bytes", lambda: limit)
    seen = []
    real = train_lib.compiled_bytes

    def figure(compiled):
        seen.append(real(compiled))
        # XLA's figure as it is, put just inside or just past what the card leaves.
        return limit - plan.RESERVE_BYTES + (0 if fits else 1)

    monkeypatch.setattr(train_lib, "compiled_bytes", figure)
    setup = train_lib.build(config, mesh)
    assert setup.microbatch_size == (b if fits else a)
    # One program compiled, the step of b rows: its state and batch are its arguments.
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.abstract_state))
    assert len(seen) == 1 and seen[0] > state

    config.train.microbatch_size = a  # a micro-batch given: nothing to decide
    assert train_lib.build(config, mesh).microbatch_size == a and len(seen) == 1


def test_meshes_are_ranked_and_only_shapes_that_divide_are_offered():
    config = load_config("moe_tiny.py")
    device = plan.DEVICES["h100"]
    meshes = plan.candidate_meshes(config, 8, device)
    assert meshes and all(plan.batch_split(s) * s["context"] * s["tensor"] <= 8 for s in meshes)
    assert all(config.model.moe.num_experts % s["expert"] == 0 for s in meshes)
    ranked = plan.rank_meshes(config, 8, device, limit=5)
    times = [t.total for _, mb, _, t in ranked if t is not None]
    assert times == sorted(times) and len(times) >= 1


def test_cache_bytes_follow_the_layers():
    config = load_config("tiny.py")
    m = config.model
    a = plan.cache_bytes_per_sequence(config, 1000)
    b = plan.cache_bytes_per_sequence(config, 2000)
    assert a["kda"] == b["kda"] > 0  # a fixed state per KDA layer
    latent = m.mla.kv_lora_rank + m.mla.shared_head_dim
    assert b["mla"] - a["mla"] == 1000 * latent * 4  # float32 latents, one MLA layer


def test_the_command_prints_the_table_and_refuses_a_bad_device(jax_cache):
    run = lambda *a: subprocess.run([sys.executable, "-m", "kimi_k3.plan", *a], cwd=REPO,
                                    env=env(jax_cache), capture_output=True, text=True,
                                    timeout=300)
    p = run("--config=configs/tiny.py", "--devices=8", "--device=h100", "--meshes=3",
            "--inference_contexts=4K")
    assert p.returncode == 0, p.stderr[-3000:]
    for words in ("memory per device", "parameters", "optimizer state", "activations: kda",
                  "verdict: fits", "step time (roofline)", "meshes over 8 devices",
                  "inference, one device", "assumptions:"):
        assert words in p.stdout, (words, p.stdout)
    bad = run("--config=configs/tiny.py", "--device=h1000")
    assert bad.returncode == 2 and "--device" in bad.stderr and "Traceback" not in bad.stderr
