"""Context parallelism (one sequence split over a "context" mesh axis): the KDA op by state
passing against the float64 recurrence, the whole model against one device, and the errors of
bad combinations. All multi-device checks run in one subprocess with 8 CPU devices
(tests/context_parallel_check.py)."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, env


@pytest.fixture(scope="module")
def result(jax_cache, tmp_path_factory, testrun_uid) -> dict:
    """The check's numbers, computed once per test run: xdist spreads this module's tests over
    its workers, and the first to take the lock runs the check for all of them (into a file
    named by this run's id, so no later run reads it)."""
    shared = tmp_path_factory.getbasetemp().parent / f"context_parallel_{testrun_uid}.json"
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shared.exists():
            # env(): XLA's CPU backend optimisations off (tiny shapes, a dozen programs).
            p = subprocess.run([sys.executable, "-m", "tests.context_parallel_check"], cwd=REPO,
                               env=env(jax_cache, devices=8), capture_output=True, text=True,
                               timeout=600)
            assert p.returncode == 0, p.stderr[-4000:]
            shared.write_text(p.stdout.split("RESULT ", 1)[1])
    return json.loads(shared.read_text())


def test_kda_op_across_shards_matches_float64_recurrence(result):
    """Outputs, final state and the gradients of q, k, v, g, beta and the initial state, shard
    by shard, with documents crossing shard boundaries; every implementation."""
    op = result["op"]
    assert set(op) == {"xla_context4", "recurrent_context8", "pallas_context2"}, op
    for case, err in op.items():
        assert err["o"] < 1e-6 and err["S"] < 1e-6, (case, err)
        assert err["grad_vs_one_device"] < 1e-5, (case, err)
        assert err["grad_vs_float64"] < 1e-4, (case, err)  # float32 gradients, central differences


def test_kda_op_with_the_gate_in_the_op_across_shards_matches_one_device(result):
    """f, A_log and dt_bias into the op (the Pallas kernel's in-kernel gate on each shard):
    outputs and every gradient, A_log's and dt_bias's summed over the shards."""
    err = result["op_gate"]
    assert set(err) == {"o", "S", "dq", "dk", "dv", "df", "dbeta", "dS0", "dA_log",
                        "ddt_bias"}, err
    assert err["o"] < 1e-6 and err["S"] < 1e-6, err
    for name, e in err.items():  # float32 sums over the shards in another order
        assert e < 5e-5, (name, err)


def test_model_across_context_axis_matches_one_device(result):
    m = result["model"]
    # Context 2 is the op's (test above); model_errors says why these two meshes suffice.
    assert set(m) == {"single_loss", "context8", "data2_context4"}, m
    for mesh in ("context8", "data2_context4"):  # context 4: in data2_context4
        r = m[mesh]
        assert r["loss_rel"] < 1e-5, (mesh, r)
        assert r["grad_rel"] < 1e-5, (mesh, r)
        assert r["num_params"] == 38, (mesh, r)
        assert r["tokens_spec"] == "P(('data', 'fsdp', 'expert'), 'context')", (mesh, r)
        assert r["collectives"] == ["all_gather", "collective_permute"], (mesh, r)


def test_bad_context_combinations_name_the_field(result):
    bad = result["bad"]
    assert bad["seq_len"].startswith("config.data.seq_len: 48 must be a multiple of "
                                     "config.mesh.context x config.model.kda.chunk_size = 8 x 4 = "
                                     "32"), bad
    assert bad["context_too_large"].startswith("config.mesh.context: 16 is larger than the 8 "
                                               "devices"), bad
    assert "allowed: a divisor of 8 (1, 2, 4, 8)" in bad["context_too_large"], bad
    assert bad["seq_len_resolved"].startswith("config.data.seq_len: 16 must be a multiple of "
                                              "config.mesh.context x config.model.kda.chunk_size "
                                              "= 8 x 4"), bad


def test_prefill_in_pieces_across_context_axis_matches_one_device(result):
    """eval.py's scorer on the cached path (KDA state and conv tails carried, MLA latent
    cache) with each piece split over 4 devices (``--config.mesh.context=4``)."""
    r = result["prefill"]
    assert r["context4"] < 1e-5, r
    assert r["collectives"] == ["all-gather", "collective-permute"], r
    assert r["piece_len_error"].startswith("--piece_len (a piece of L=64): 24 must be a multiple "
                                           "of config.mesh.context x config.model.kda.chunk_size "
                                           "= 4 x 4"), r
