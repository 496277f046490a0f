"""The decode benchmark (benchmarks/decode_bench.py): its smoke run writes a row per batch tried,
the tables and the plot; the step it times from a random cache is the model's own step; the
batch search finds the largest power of two that fits."""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import plots
from kimi_k3.generate import Decoder

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "benchmarks" / "decode_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_a_row_per_batch_and_the_ratio(bench, tmp_path):
    rows = bench.main(["--smoke", f"--out_dir={tmp_path}", "--contexts=32"])
    assert [(r["variant"], r["pattern"], r["context"], r["batch"]) for r in rows] == [
        ("all-MLA", "MM", 32, 1), ("all-MLA", "MM", 32, 2), ("3:1", "KM", 32, 1), ("3:1", "KM", 32, 2)]
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 and r["steps"] >= 1 for r in rows)
    assert all(r["tokens_per_s"] == pytest.approx(1e3 * r["batch"] / r["ms_per_step"]) for r in rows)
    assert rows[1]["cache_bytes"] - 4 == 2 * (rows[0]["cache_bytes"] - 4)  # the rows; one int32 pos
    with open(tmp_path / "decode.csv") as f:
        written = list(csv.DictReader(f))
    assert [(w["variant"], w["context"], w["batch"], w["status"]) for w in written] == [
        (r["variant"], str(r["context"]), str(r["batch"]), "ok") for r in rows]
    # the floor: the bytes the step must read at the card's bandwidth (plan.py's "cpu" here)
    assert all(r["hbm_gbps"] == 50 and r["floor_ms"] == pytest.approx(r["read_bytes"] / 50e6)
               and r["x_floor"] == pytest.approx(r["ms_per_step"] / r["floor_ms"]) for r in rows)
    table = (tmp_path / "decode.md").read_text()
    assert "| all-MLA / 3:1 |" in table and "| 32 | all-MLA | 2 | cap |" in table
    assert "| all-MLA floor ms | 3:1 floor ms | all-MLA x floor | 3:1 x floor |" in table
    assert "50 GB/s" in table and "all-MLA: latent cache read: xla" in table
    assert plots.is_png(tmp_path / "decode_ms_per_token.png")


def test_the_profile_gives_each_part_of_the_step_its_kernels(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # put back afterwards
    (row,) = bench.main(["--smoke", f"--out_dir={tmp_path}", "--contexts=32", "--max_batch=1",
                         "--variants=3:1", f"--profile_dir={tmp_path / 'traces'}"])
    assert "--xla_gpu_enable_command_buffer=" in os.environ["XLA_FLAGS"]
    prof = row["profile"]
    # KM: a KDA layer then an MLA layer, each part of the step its own kernels
    assert all(prof["parts"].get(p, 0) > 0 for p in ("kda_core", "kda_conv", "mla_attention",
                                                      "attn_res"))
    assert prof["kernels"] >= len(prof["parts"]) and prof["idle_ms"] >= 0
    table = (tmp_path / "decode.md").read_text()
    assert "Batch 1's step by model part" in table and "| 32 | 3:1 |" in table


def test_the_timed_step_from_a_random_cache_is_the_models_step(bench):
    """The benchmark's cache and step against the model's definition of a step (``prefill`` of
    one token) on the same cache: the same logits and cache, and the cache's contents do change
    them (the step reads it). The bytes it must read: every weight, the KDA caches whole, the
    MLA cache's first context + 1 entries."""
    # The smoke run's model and shapes (batch 2 at context 32): its compilations are reused.
    args = bench.parse_args(["--smoke"])
    model = bench.build_model(bench.bench_config(args, "3:1"), args.seed)
    B, context = 2, 32
    max_len = context + args.warmup + args.steps
    cache = bench.random_cache(model, B, max_len, context, seed=3)
    assert int(cache["pos"]) == context
    for x in jax.tree.leaves(cache)[:-1]:  # every array random, none left at zero
        assert np.count_nonzero(np.asarray(x)) == x.size
    token_B = jnp.asarray([7, 200], jnp.int32)
    want_logits, want_cache = nnx.jit(lambda m, t, c: m.prefill(t[:, None], c))(model, token_B,
                                                                                cache)
    want_logits = want_logits[:, 0]

    decoder = Decoder(model)
    got_logits, got_cache = bench.run_steps(
        decoder, token_B, bench.step_ready_cache(decoder, token_B, cache), 1)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert int(got_cache["pos"]) == context + 1

    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    kda, mla = cache["tail"][0], cache["tail"][1]["latent_kv"]
    assert decoder.weight_bytes == weights
    assert bench.read_bytes(weights, cache, context) == weights + sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(kda)) + (
        B * (context + 1) * mla.shape[-1] * mla.dtype.itemsize)

    other = bench.random_cache(model, B, max_len, context, seed=4)
    other_logits, _ = bench.run_steps(decoder, token_B, bench.step_ready_cache(decoder, token_B, other), 1)
    assert np.abs(np.asarray(other_logits) - np.asarray(want_logits)).max() > 1e-3


@pytest.mark.parametrize("fits_up_to", [1, 5, 8, 13, 100])
@pytest.mark.parametrize("guess", [None, 2, 8, 32])
def test_the_batch_search_finds_the_largest_power_of_two_that_fits(bench, fits_up_to, guess):
    cap = 48  # rounded down to 32
    tried: dict[int, bool] = {}
    while (b := bench.next_batch(tried, cap, guess)) is not None:
        assert b not in tried and b <= 32
        tried[b] = b <= fits_up_to
    best = max(b for b, ok in tried.items() if ok)
    assert best == min(32, bench.pow2_floor(fits_up_to))
    if guess is None:  # doubling: every power of two up to one past the best
        assert sorted(tried) == [2**i for i in range(len(tried))]
    assert bench.guess_largest_batch(100, 30, 10, 64) == 4  # rows of 20 bytes in 97 - 10
    assert bench.guess_largest_batch(None, 30, 10, 64) is None
    assert bench.predicted_peak({1: 30, 4: 90}, 8) == 170
