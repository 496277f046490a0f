"""kimi_k3.aot: every program compiled for real TPU topologies by libtpu's compiler on this CPU
machine (the test extra installs libtpu; without it these tests fail, they never skip), with the
Mosaic kernels in the compiled programs; XLA's memory per chip against the train state's and
the planner's (kimi_k3.plan) estimate; the kernels partitioned by hand under a mesh, with the
numbers of one device; and the command's output and errors.

The compiles run at XLA's lowest optimisation level (``--quick``), which keeps the kernels and
the partitioning and takes a fraction of the time; BENCHMARKS.md has full compiles."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_k3 import aot, plan
from kimi_k3.config import ConfigError, run_spec
from kimi_k3.runtime import jax_setting
from kimi_k3.train_state import state_layout
from tests.helpers import REPO, env, load_config

QUICK = aot.Options(quick=True)
KDA_FWD = {"kda_intra_fwd", "kda_state_fwd"}
KDA_BWD = {"kda_intra_bwd_scores", "kda_intra_bwd_channels", "kda_state_bwd"}
# How far the planner's estimate of a step may be from XLA's memory analysis of it on a TPU.
PLAN_TOLERANCE = 0.15


def compiled(reports: list[aot.Report]) -> dict[str, aot.Report]:
    """{program: report}, every one compiled and fitting its chips."""
    for r in reports:
        assert r.error is None, (r.what, r.error)
        assert r.memory is not None and r.total_bytes > 0 and r.fits, (r.what, r.memory)
    return {r.what: r for r in reports}


def kernels(report: aot.Report, prefix: str) -> set[str]:
    return {k for k in report.kernels if k.startswith(prefix)}


def test_libtpu_is_installed():
    """The test extra pulls in the tpu extra: libtpu matching the installed JAX."""
    version = aot.require_libtpu()
    assert version.startswith("0.0."), version
    devices = aot.topology_devices("v5p:2x2x2")
    assert len(devices) == 8 and {d.platform for d in devices} == {"tpu"}


def test_small_train_step_and_eval_scorer_compile_for_v5e_with_mosaic_kernels():
    """configs/small.py on 4 v5e chips (data 4): the Pallas KDA kernel forward and backward and
    splash attention compiled by Mosaic in the train step, the forward kernels in eval.py's
    scorer; each chip holds the train state whole (data parallelism) and its quarter of the
    batch; the planner (kimi_k3.plan) agrees with XLA's memory per chip."""
    config = load_config("small.py")
    config.train.microbatch_size = 32  # the trainer's choice on 16 GiB (BENCHMARKS.md)
    reports = compiled(aot.compile_config(config, "v5e:2x2", aot.Options(
        what=("train", "eval"), quick=True)))
    train, evaluation = reports["train"], reports["eval"]
    assert train.chips == 4 and evaluation.chips == 1
    assert KDA_FWD | KDA_BWD <= set(train.kernels), train.kernels
    assert kernels(train, "splash_mha_fwd") and kernels(train, "splash_mha_dkv"), train.kernels
    assert KDA_FWD <= set(evaluation.kernels) and kernels(evaluation, "splash_mha_fwd")
    assert not KDA_BWD & set(evaluation.kernels)  # scoring has no backward pass
    # XLA's analysis is per chip: the replicated train state and a quarter of the batch
    spec = run_spec(config, backend="tpu")
    layout = state_layout(spec, aot.train_mesh(spec, aot.topology_devices("v5e:2x2"), "v5e:2x2"))
    state = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                for x in jax.tree.leaves(layout.abstract_state))
    batch = 2 * (32 // 4) * 2048 * 4  # tokens and segment ids, int32
    assert train.memory["arguments"] == pytest.approx(state + batch, rel=0.01), train.memory
    assert train.memory["aliased"] == pytest.approx(state, rel=0.01)  # the donated state
    # The planner's estimate of the same step (less its runtime reserve) against XLA's per-chip
    # memory of the program compiled for these chips
    m = train.memory
    xla = m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"]
    estimate = plan.memory_plan(config, dict(layout.mesh.shape), 32, plan.DEVICES["tpu-v5e"])
    assert abs((estimate.total - plan.RESERVE_BYTES) / xla - 1) <= PLAN_TOLERANCE, (
        estimate.total, xla)


def test_moe_tiny_compiles_with_an_expert_axis():
    """configs/moe_tiny.py on 8 v5e chips, its 8 experts one per chip (tokens reach them by
    all-to-all), the KDA kernel and splash attention compiled, the experts' grouped matmuls as
    Mosaic kernels; the micro-batch is the trainer's choice (train.microbatch_size = 0, from
    XLA's estimate for these chips)."""
    config = load_config("moe_tiny.py")
    config.model.kda.impl = "auto"  # the kernel on a TPU (tiny.py keeps the CPU's recurrence)
    config.mesh.data, config.mesh.expert = 1, 8
    (train,) = compiled(aot.compile_config(config, "v5e:2x4", aot.Options(
        what=("train",), quick=True))).values()
    assert train.chips == 8 and "expert 8" in train.layout and "one pass" in train.layout
    assert KDA_FWD | KDA_BWD <= set(train.kernels), train.kernels
    assert kernels(train, "ragged-dot") and kernels(train, "splash_mha"), train.kernels


def test_context_parallel_train_step_and_eval_scorer_compile():
    """A context-parallel config on 8 v5e chips (data 2 x context 4): the KDA kernel on each
    shard's tokens inside the state passing, eval.py's pieces split over 4 chips."""
    config = load_config("tiny.py")
    config.model.kda.impl = "auto"
    config.data.seq_len, config.data.global_batch_size = 1024, 8
    config.mesh.data, config.mesh.context = 2, 4
    config.train.microbatch_size = 8
    reports = compiled(aot.compile_config(config, "v5e:2x4", aot.Options(
        what=("train", "eval"), context_length=4096, piece_len=1024, quick=True)))
    assert "data 2 x context 4" in reports["train"].layout
    assert KDA_FWD | KDA_BWD <= set(reports["train"].kernels)
    assert reports["eval"].chips == 4 and "context 4" in reports["eval"].layout
    assert KDA_FWD <= set(reports["eval"].kernels) and kernels(reports["eval"], "splash_mha")


def test_every_axis_on_sixteen_chips():
    """fsdp, expert, context and tensor on 16 v5p chips at once: every kernel call on its
    device's rows, heads and tokens."""
    config = load_config("moe_tiny.py")
    config.model.kda.impl = "auto"
    config.mesh.data, config.mesh.fsdp, config.mesh.expert = 1, 2, 2
    config.mesh.context, config.mesh.tensor = 2, 2
    config.train.microbatch_size = 8
    (train,) = compiled(aot.compile_config(config, "v5p:2x2x4", aot.Options(
        what=("train",), quick=True))).values()
    assert train.chips == 16 and "fsdp 2 x expert 2 x context 2 x tensor 2" in train.layout
    assert KDA_FWD | KDA_BWD <= set(train.kernels) and kernels(train, "ragged-dot")


def test_bad_topologies_and_meshes_are_named():
    with pytest.raises(ConfigError, match=r"--topology: 'v5e-2x2' is not a TPU topology; "
                                          r"allowed: GENERATION:AxB\[xC\], e.g. v5e:2x2"):
        aot.topology_devices("v5e-2x2")
    with pytest.raises(ConfigError, match=r"--topology: libtpu does not describe 'v9:2x2' "
                                          r"\(.*TPU v9.*\); allowed"):
        aot.topology_devices("v9:2x2")
    assert len(aot.topology_devices("v5e:1x1")) == 1  # fewer chips than a host has
    config = load_config("tiny.py")
    config.mesh.data, config.mesh.tensor = 2, 4
    with pytest.raises(ConfigError, match=r"--topology=v5e:2x2 has 4 chips: config.mesh: .* uses "
                                          r"8 devices, but 4 are present"):
        aot.compile_config(config, "v5e:2x2", QUICK)
    with pytest.raises(ConfigError, match=r"--what: 'prefill' is not a program; allowed: train, "
                                          r"eval, decode"):
        aot.compile_config(config, "v5e:2x2", aot.Options(what=("prefill",)))


def test_a_program_that_does_not_compile_is_reported_not_raised():
    """A trace-time error (splash asked for explicitly on pieces it cannot take) is that
    program's FAILED line; the others still compile."""
    config = load_config("tiny.py")
    config.model.mla.attn_impl = "pallas"
    reports = aot.compile_config(config, "v5e:2x2", aot.Options(
        what=("eval", "decode"), context_length=100, piece_len=100, quick=True))
    assert reports[0].error and "splash" in reports[0].error and reports[0].fits is None
    assert "FAILED" in aot.format_report(reports[0])[0]
    assert reports[1].error is None, reports[1].error


def test_the_command_prints_each_program_and_names_a_bad_flag(jax_cache):
    """python -m kimi_k3.aot: a header naming the chips, then per program whether it compiled,
    its memory per chip and its kernels; a bad topology is one line and exit status 2."""
    cmd = [sys.executable, "-m", "kimi_k3.aot", "--config=configs/tiny.py",
           "--topology=v5e:2x2", "--what=decode", "--quick", "--config.model.kda.impl=auto"]
    e = {**env(jax_cache), "JAX_PLATFORMS": ""}  # the machine's backends, libtpu's search too
    p = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("configs/tiny.py for TPU v5e:2x2: 4 x TPU v5 lite (16.00 GiB "
                               "each); JAX "), lines
    assert lines[1].startswith("decode  compiled in ") and ") for 1 chip (one chip; 1 row," in lines[1]
    assert "per chip: arguments " in lines[2] and lines[3].strip().endswith(": fits"), lines
    # a decoding step runs no kernel: its one-token KDA form and its read of the latent cache
    # are XLA's on a TPU (the kernels of a whole sequence: test_small_train_step_...)
    assert lines[4].strip() == "Mosaic kernels: none", lines
    assert p.stderr == "", p.stderr  # libtpu, without a TPU, says nothing
    bad = subprocess.run(cmd[:4] + ["--topology=v5e:3x3"], cwd=REPO, env=e, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == "", (bad.returncode, bad.stdout)
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith(
        "python -m kimi_k3.aot: error: --topology: libtpu does not describe 'v5e:3x3'"), bad.stderr


def test_a_topology_compile_writes_nothing_to_the_cache_and_leaves_it_on(tmp_path, rng):
    """A program compiled for TPU chips this machine lacks is not written to JAX's persistent
    cache (reading it back fails without the chips and warns at every later compile), twice
    without a warning; a CPU program compiled afterwards in the same process is written."""
    folder = tmp_path / "cache"
    scale = float(rng.uniform(1.0, 2.0))  # a program no earlier test has compiled
    mesh = aot.mesh_over(aot._one_axis("data", 4), aot.topology_devices("v5e:2x2"))
    x = jax.ShapeDtypeStruct((4, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    compilation_cache.reset_cache()  # JAX reads its cache settings once: again, with these
    try:
        with jax_setting("jax_compilation_cache_dir", str(folder)), \
                jax_setting("jax_persistent_cache_min_compile_time_secs", 0.0), \
                warnings.catch_warnings():
            warnings.simplefilter("error")  # JAX's "Error reading persistent compilation cache"
            for _ in range(2):  # a new jit each time: not found in this process's own caches
                lower = lambda: (jax.jit(lambda x: jnp.tanh(x * scale) @ x.T).lower(x), mesh, "")
                r = aot.compile_report("tpu", lower, None)
                assert r.error is None and r.memory is not None, r.error
            assert not folder.exists() or not list(folder.iterdir())
            jax.jit(lambda v: jnp.sin(v * scale)).lower(np.ones(3, np.float32)).compile()
            assert len(list(folder.iterdir())) == 1
    finally:
        compilation_cache.reset_cache()


def test_kernels_under_a_mesh_run_on_each_devices_rows_and_heads(jax_cache, rng):
    """On 4 CPU devices (data 2 x tensor 2) the KDA kernel and splash attention, in interpret
    mode, sit inside shard_map and give one device's loss and gradients
    (tests/kernel_partition_check.py)."""
    seed = int(rng.integers(2**31))
    p = subprocess.run([sys.executable, "-m", "tests.kernel_partition_check", str(seed)],
                       cwd=REPO, env=env(jax_cache, devices=4), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    result = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert result["kernels_mesh"] and all(result["kernels_mesh"]), result
    assert result["kernels_one"] and not any(result["kernels_one"]), result
    one, mesh = result["loss"]
    assert mesh == pytest.approx(one, rel=1e-5) and result["grad_rel"] < 1e-4, result
