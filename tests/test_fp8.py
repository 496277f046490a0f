"""FP8 products (``model.matmul_format = "fp8"``, layers/dense.py) on the CPU, where XLA runs
them by converting the FP8 operands: the numbers are those of the card, not its speed.

- one product and its two gradients against a float64 NumPy reference of the quantise-dequantise
  maths (float32 scales from the absolute maximum, e4m3 rounding and clipping forward, e5m2 for
  the gradient), on inputs spanning ten decades with exact zeros; a non-finite input is not hidden;
- the product reaches XLA as dots of f8e4m3fn / f8e5m2 operands (what cuBLASLt's FP8 GEMMs take
  on Hopper), in the projections chosen and nowhere else;
- a small model's loss and gradients in FP8 stay near bf16's;
- a checkpoint of an FP8 run resumes in bf16 and back (train.py);
- FP8 is refused, naming the field, where it cannot run;
- the benchmarks' CPU modes: train_throughput.py's runs side by side, loss_curves.py's runs
  trained and held against the noise; fp8_matmul_bench.py's rows and its reading of the program.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import config as config_lib
from kimi_k3.layers.dense import Dense, _transposes, fp8_einsum
from kimi_k3.layers.moe import MoE
from kimi_k3.model import HybridLM
from tests.helpers import (
    REPO,
    TINY,
    build,
    env,
    fake_device,
    fast_jit,
    load_config,
    losses,
    tiny_config,
)

F32_TINY_SQRT = np.sqrt(np.finfo(np.float32).tiny)


def quantise_reference(a: np.ndarray, fmt) -> np.ndarray:
    """The quantise-dequantise maths, float64 out: s = max|a| / max(fmt) in float32 (1 below
    sqrt(tiny)), a / s in float32, clipped to +-max(fmt), rounded to ``fmt`` (nearest even),
    times s."""
    top = np.float32(ml_dtypes.finfo(fmt).max)
    a32 = a.astype(np.float32)
    s = np.max(np.abs(a32)) / top
    s = np.float32(1.0) if s < F32_TINY_SQRT else s
    q = np.clip(a32 / s, -top, top).astype(fmt)
    return q.astype(np.float64) * np.float64(s)


def spread(rng, shape, zeros=0.1):
    """Random values over ten decades (1e-6 .. 1e4 in magnitude, both signs), some exact zeros."""
    a = rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 4, shape)
    return np.where(rng.random(shape) < zeros, 0.0, a).astype(np.float32)


def test_the_fp8_product_and_its_gradients_follow_the_quantised_maths(rng):
    eq = "nta,abc->ntbc"  # Dense from D to (H, K), as the heads' projections
    x, w, dy = spread(rng, (3, 20, 24)), spread(rng, (24, 2, 8)), spread(rng, (3, 20, 2, 8))
    w = w * 1e-3  # another scale than x's: each tensor has its own

    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_einsum(eq, x, w), x, w)
        return (y, *vjp(dy))

    y, dx, dw = (np.asarray(v, np.float64) for v in run(x, w, dy))
    eq_dx, eq_dw = _transposes(eq)
    qx, qw = (quantise_reference(a, ml_dtypes.float8_e4m3fn) for a in (x, w))
    qdy = quantise_reference(dy, ml_dtypes.float8_e5m2)
    refs = {"y": (y, np.einsum(eq, qx, qw), np.einsum(eq, x.astype(np.float64), w)),
            "dx": (dx, np.einsum(eq_dx, qdy, qw), np.einsum(eq_dx, dy.astype(np.float64), w)),
            "dW": (dw, np.einsum(eq_dw, qx, qdy), np.einsum(eq_dw, x.astype(np.float64), dy))}
    for name, (got, ref, exact) in refs.items():
        top = np.max(np.abs(ref))
        assert np.isfinite(got).all() and top > 0, name
        # float32 sums of exact products of FP8 numbers: the reference to float32 rounding ...
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * top, err_msg=name)
        # ... and far from the unquantised product: the quantisation happened, with these scales
        assert np.max(np.abs(got - ref)) < 1e-2 * np.max(np.abs(exact - ref)), name
    # the largest magnitude of each operand survives exactly (no clipping inside the range)
    for a, fmt in ((x, ml_dtypes.float8_e4m3fn), (dy, ml_dtypes.float8_e5m2)):
        i = np.argmax(np.abs(a))
        assert quantise_reference(a, fmt).flat[i] == pytest.approx(a.flat[i], rel=1e-6)

    # a zero gradient (scale 1) gives zero gradients; a non-finite input is not hidden
    _, dx0, dw0 = run(x, w, np.zeros_like(dy))
    assert not np.any(np.asarray(dx0)) and not np.any(np.asarray(dw0))
    x_nan = x.copy()
    x_nan.flat[rng.integers(x.size)] = np.nan
    assert np.isnan(np.asarray(run(x_nan, w, dy)[0])).all()


def f8_dots(text: str) -> list[tuple[str, str]]:
    """The (lhs, rhs) element types of every stablehlo.dot_general in ``text``."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            m = re.search(r":\s*\(tensor<[^>]*x(\w+)>,\s*tensor<[^>]*x(\w+)>\)", line)
            out.append(m.groups())
    return out


def test_fp8_reaches_xla_as_f8_dots_in_the_chosen_projections_only():
    """Dense's forward and both backward products are dots of FP8 operands in the lowered
    program (e4m3 x e4m3, e5m2 x e4m3, e4m3 x e5m2); in a model, exactly the projections into
    and out of the heads and the MLPs are FP8: not the router, the gates, the shared key slice
    or the output head."""
    layer = Dense(16, (2, 8), names=("embed", "heads", "kv"), rngs=nnx.Rngs(0),
                  dtype=jnp.bfloat16, fp8=True)
    graphdef, state = nnx.split(layer)
    x = jnp.ones((2, 4, 16), jnp.bfloat16)
    loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x).astype(jnp.float32) ** 2)
    dots = f8_dots(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).as_text())
    assert sorted(dots) == sorted([("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"),
                                   ("f8E4M3FN", "f8E5M2")]), dots

    cfg = tiny_config("KM").model
    cfg.matmul_format = "fp8"
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))  # shapes: enough to lower
    fp8 = {"/".join(map(str, path)) for path, m in nnx.iter_modules(model)
           if isinstance(m, Dense) and m.fp8}
    names = {p.rpartition("/")[2] for p in fp8}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "kv_down", "k_up", "v_up",
                     "g_proj", "wi", "wo"}, names
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 16), jnp.int32)
    text = jax.jit(jax.grad(lambda s: nnx.merge(graphdef, s).token_nll(tokens, tokens)[0].mean())
                   ).lower(state).as_text()
    dots = f8_dots(text)
    assert sum("f8" in a for a, _ in dots) == 3 * len(fp8)  # three products each, no more

    # experts: the dense form's and the capacity buffers' two products, and the shared expert's
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_dim = 4, 2, 16
    for matmul, capacity in (("dense", 0.0), ("ragged", 1.5)):
        cfg.moe.expert_matmul, cfg.moe.capacity_factor = matmul, capacity
        layer = MoE(cfg.d_model, config_lib.model_spec(cfg).moe, rngs=nnx.Rngs(0), fp8=True)
        graphdef, state = nnx.split(layer)
        x = jnp.ones((1, 8, cfg.d_model))
        loss = lambda s, x, g=graphdef: jnp.sum(nnx.merge(g, s)(x) ** 2)
        dots = f8_dots(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).as_text())
        assert sum("f8" in a for a, _ in dots) == 3 * 4, (matmul, dots)
        assert ("f32", "f32") in dots  # the router's, in float32


def test_a_small_model_in_fp8_computes_what_it_does_in_bf16(rng):
    """The same model and tokens, bf16 compute: FP8 projections move the loss by under a
    percent and keep the gradient's direction (cosine) and size (bounds several times the
    spread seen over random seeds: FP8's rounding, not a fault, is what moves them)."""
    cfg = tiny_config("KM").model
    cfg.dtype = "bfloat16"
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 65)), jnp.int32)
    _, state = nnx.split(build(cfg, int(rng.integers(1 << 30))))
    out = {}
    for fmt in ("bf16", "fp8"):  # the same parameters in either format
        cfg.matmul_format = fmt
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
        loss = lambda s, g=graphdef: nnx.merge(g, s).token_nll(tokens[:, :-1], tokens[:, 1:])[
            0].mean()
        value, grads = fast_jit(jax.value_and_grad(loss))(state)
        out[fmt] = float(value), np.concatenate(
            [np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads)])
    (l16, g16), (l8, g8) = out["bf16"], out["fp8"]
    assert np.isfinite(l8) and np.isfinite(g8).all()
    assert abs(l8 - l16) < 1e-2 * l16, (l8, l16)
    cosine = g8 @ g16 / (np.linalg.norm(g8) * np.linalg.norm(g16))
    assert cosine > 0.95, cosine
    assert abs(np.linalg.norm(g8) / np.linalg.norm(g16) - 1) < 0.1
    assert not np.array_equal(g8, g16)  # the FP8 path ran


def test_a_checkpoint_of_an_fp8_run_resumes_in_bf16_and_back(tmp_path, jax_cache):
    """FP8 keeps no state of its own (scales come from each step's tensors): an FP8 run's
    checkpoint resumes in bf16, whose checkpoint resumes in FP8, through train.py."""
    wd = tmp_path / "run"

    def train(fmt: str, steps: int):
        cmd = [sys.executable, str(REPO / "train.py"), *TINY, f"--workdir={wd}",
               f"--config.model.matmul_format={fmt}", f"--config.train.steps={steps}",
               "--config.checkpoint.every_steps=2"]
        p = subprocess.run(cmd, cwd=REPO, env=env(jax_cache), capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stderr

    train("fp8", 2)
    err = train("bf16", 3)
    assert "resumed from step 2" in err
    assert 'model.matmul_format: "fp8" -> "bf16"' in err
    err = train("fp8", 4)
    assert "resumed from step 3" in err and 'model.matmul_format: "bf16" -> "fp8"' in err
    logged = losses(wd)
    assert sorted(logged) == [1, 2, 3, 4] and all(np.isfinite(v) for v in logged.values())


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    config = load_config("tiny.py")
    config.model.matmul_format = "fp8"
    assert config_lib.run_spec(config).model.matmul_format == "fp8"  # the CPU emulates it
    assert config_lib.model_spec(config.model, backend="gpu").fp8  # a GPU asked about blind
    with pytest.raises(ValueError, match=r"config.model.matmul_format: 'fp8' cannot run here: "
                       r".*TPUs are not supported; allowed here: 'bf16'"):
        config_lib.model_spec(config.model, backend="tpu")
    config.model.matmul_format = "fp16"
    with pytest.raises(ValueError, match=r"config.model.matmul_format: 'fp16' is not one of "
                       r"\('bf16', 'fp8'\)"):
        config_lib.model_spec(config.model)
    config.model.matmul_format = "fp8"
    fake_device(monkeypatch, "gpu", kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
    with pytest.raises(ValueError, match=r"matmul_format: 'fp8' cannot run here: NVIDIA A100-"
                       r"SXM4-80GB is sm_80; FP8 matrix units need sm_89"):
        config_lib.model_spec(config.model, backend="gpu")
    fake_device(monkeypatch, "gpu", kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    assert config_lib.model_spec(config.model, backend="gpu").fp8
    fake_device(monkeypatch, "gpu", lowering="rocm")
    with pytest.raises(ValueError, match="the GPU runs 'rocm'"):
        config_lib.model_spec(config.model, backend="gpu")
    # without Qwix, the library its products use
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "qwix" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'kimi_k3\[fp8\]'"):
        config_lib.model_spec(config.model, backend="cpu")
    monkeypatch.undo()
    # experts: the dense form and the capacity buffers have FP8 products, the grouped forms not
    moe = load_config("moe_tiny.py")
    moe.model.matmul_format = "fp8"
    moe.model.moe.expert_matmul = "auto"
    with pytest.raises(ValueError, match=r"config.model.moe.expert_matmul: 'auto' cannot run "
                       r"with config.model.matmul_format='fp8'"):
        config_lib.run_spec(moe)
    moe.model.moe.expert_matmul = "dense"
    assert config_lib.run_spec(moe).model.fp8
    moe.model.moe.expert_matmul, moe.model.moe.capacity_factor = "blocked", 1.25
    assert config_lib.run_spec(moe).model.fp8
    del config.model["matmul_format"]  # a model section written before FP8: bf16
    assert config_lib.model_spec(config.model).matmul_format == "bf16"


def test_the_benchmarks_cpu_modes_compare_fp8_with_bf16(tmp_path, jax_cache):
    """train_throughput.py --smoke: the variants (bf16, fp8) each in a process, then the anchor's
    line read (a stand-in script here), in one table; loss_curves.py --smoke: three runs
    trained, their gaps held against the second seed's, a PNG."""
    anchor = tmp_path / "anchor.py"
    anchor.write_text("print('anchor: 2,000 tokens/s, 0.500 s/step, MFU 40.0%, peak 1.5 GiB, "
                      "loss 3.000')\n")
    out = tmp_path / "throughput.md"
    p = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--smoke",
                        f"--workdir={tmp_path / 'tp'}", f"--anchor={anchor}", f"--out={out}"],
                       cwd=REPO, env=env(jax_cache), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r.split("|")[1].strip(): r for r in out.read_text().splitlines()
            if r.startswith("| ") and not r.startswith("| run")}
    assert set(rows) == {"bf16", "fp8", "dense anchor"}, rows
    assert "| 1.00x |" in rows["bf16"] and "| ok |" in rows["fp8"]
    assert "| 2,000 |" in rows["dense anchor"] and "| 40.0% |" in rows["dense anchor"]
    assert "bf16-equivalent" in out.read_text()

    work = tmp_path / "loss"
    p = subprocess.run([sys.executable, "benchmarks/loss_curves.py", "--smoke",
                        f"--work_dir={work}", f"--table={work}.md"], cwd=REPO,
                       env=env(jax_cache), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    table = (tmp_path / "loss.md").read_text()
    assert re.search(r"fp8: largest gap to bf16 \(steps .* for bf16_seed1, the noise\) -> "
                     r"\*\*(within|outside) the run-to-run noise\*\*", table), table
    for run in ("bf16", "bf16_seed1", "fp8"):
        assert f"{run}: ok, last step 8, 0 non-finite steps" in table, table
    assert (work / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_product_benchmark_times_each_part_and_reads_the_program():
    """benchmarks/fp8_matmul_bench.py --smoke: a forward and a forward+backward row per shape,
    each ratio the bf16 time over fp8's, TFLOP/s from the times, and the program's products
    counted (on the CPU no cuBLASLt call: the FP8 product stays a dot, forward one, forward and
    backward three)."""
    spec = importlib.util.spec_from_file_location("fp8_matmul_bench",
                                                  REPO / "benchmarks" / "fp8_matmul_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [r.split("|")[1:-1] for r in bench.main(["--smoke", "--budget_s=0.05"]).splitlines()
            if r.startswith("| ") and "pass" not in r]
    assert [r[1].strip() for r in rows] == ["forward", "forward + backward"]
    M, K, N = bench.SMOKE_SHAPES[0]
    for (shape, _, bf16, fp8, quant, gemm, tflops, program), dots in zip(rows, (1, 3),
                                                                       strict=True):
        assert shape.strip() == f"{M} x {K} x {N}"
        bf16_tflops = 2 * M * K * N * dots / float(bf16) / 1e9
        assert abs(int(tflops.split("/")[0]) - bf16_tflops) <= 0.5 + 1e-3 * bf16_tflops
        fp8_ms, ratio = re.fullmatch(r" ([\d.]+) \(([\d.]+)x\) ", fp8).groups()
        assert float(ratio) == pytest.approx(float(bf16) / float(fp8_ms), abs=0.01 + 0.02 * float(ratio))
        assert float(quant) > 0 and (gemm.strip() == "") == (dots == 3)
        assert program.strip() == f"0 FP8 of 0 GEMMs, {dots} other dots, 0 f8 copies"
