"""The measuring scripts themselves: the step profiler attributes kernels to model parts, the
attention benchmark checks its implementations against each other (CPU smoke runs); a
compile-only run puts exactly the measured run's programs in the compilation cache."""

from __future__ import annotations

import collections
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimi_k3
from tests.helpers import TINY, env, load_config

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def step_profile():
    return load("step_profile")


@pytest.fixture(scope="module")
def trace_parts():
    return load("trace_parts")


def test_op_names_come_from_the_hlo_and_name_the_part_and_phase(trace_parts):
    def f(x):
        with jax.named_scope("mlp"):
            y = jnp.tanh(x @ x)
        with jax.named_scope("kda_core"):
            y = jnp.sin(y) @ x
        return y.sum()

    hlo = jax.jit(jax.grad(jax.checkpoint(f))).lower(jnp.ones((32, 32))).compile().as_text()
    names = trace_parts.op_names_from_hlo(hlo)
    parts = {trace_parts.part_and_phase(n) for n in names.values()}
    assert ("mlp", "backward") in parts and ("kda_core", "backward") in parts
    assert ("kda_core", "recompute") in parts
    assert trace_parts.part_and_phase("jit(s)/jvp(kda_out)/norm/mul") == ("kda_out", "forward")
    assert trace_parts.part_and_phase("jit(s)/copy") == ("other", "forward")
    # a mixture of experts' stages by their own labels, also without the outer "moe"
    assert trace_parts.part_and_phase("jit(s)/jvp(moe)/moe_router/dot") == ("moe_router",
                                                                            "forward")
    assert trace_parts.part_and_phase("jit(s)/transpose(moe_experts)/x") == ("moe_experts",
                                                                             "backward")
    assert trace_parts.part_and_phase("jit(s)/moe/sort") == ("moe", "forward")


def test_a_mixture_step_is_summed_by_stage_and_its_expert_kernels_by_product(trace_parts):
    """Every kernel lands in one stage row (the rows sum to the kernels' total); the experts'
    kernels by name and phase: gmm forward, gmm again in the backward (remat), gmm_t data and
    gmm_wgrad weight gradients, an XLA product's transpose a data gradient, the rest apart."""
    rng = np.random.default_rng()
    named = {
        "jit(s)/jvp(moe)/moe_router/dot_general": "router (forward + backward)",
        "jit(s)/jvp(moe)/moe_experts/gmm/pallas_call": "expert products: forward",
        "jit(s)/transpose(jvp(moe))/moe_experts/gmm/pallas_call":
            "expert products: forward again in the backward pass (remat)",
        "jit(s)/transpose(jvp(moe))/moe_experts/gmm_t/pallas_call":
            "expert products: data gradients",
        "jit(s)/transpose(jvp(moe))/moe_experts/ragged_dot": "expert products: data gradients",
        "jit(s)/transpose(jvp(moe))/moe_experts/gmm_wgrad/pallas_call":
            "expert products: weight gradients",
        "jit(s)/jvp(moe)/moe_experts/convert_element_type": "experts' other kernels",
        "jit(s)/jvp(moe)/moe_latent/dot_general": "latent projections (LatentMoE)",
        "jit(s)/jvp(kda_core)/pallas_call": "KDA",
        "jit(s)/transpose(jvp(mla_attention))/custom-call": "attention (MLA)",
        "jit(s)/while/body/add": "other (gradient sums over micro-batches, copies, ...)",
    }
    ops = [((f"op{i}", name), float(rng.uniform(1, 10))) for i, name in enumerate(named)]
    ops.append((("op_unknown", "?"), 2.5))  # an instruction without metadata: "other"
    got = dict(trace_parts.stages(ops, min_ms=0.0))
    want = collections.defaultdict(float)
    for (_, name), ms in ops:
        want[named.get(name, "other (gradient sums over micro-batches, copies, ...)")] += ms
    assert got == pytest.approx(dict(want))
    assert sum(got.values()) == pytest.approx(sum(ms for _, ms in ops))
    order = [row for row, _ in trace_parts.STAGES]
    assert [row for row, _ in trace_parts.stages(ops, min_ms=0.0)] == [r for r in order if r in want]


def test_idle_time_is_counted_before_the_kernel_that_waited(trace_parts):
    """Gaps on the device timeline go to the kernel after them; kernels overlapping on two
    streams leave none (a running end, not the previous kernel's); the order given does not
    matter."""
    events = [("a", 0.0, 10.0), ("b", 4.0, 20.0),    # b overlaps a: no gap, the end is 24
              ("c", 20.0, 2.0),                      # inside b: no gap
              ("d", 30.0, 5.0),                      # idle 24 -> 30
              ("e", 35.0, 1.0), ("f", 100.0, 1.0)]   # back to back; idle 36 -> 100
    rng = np.random.default_rng()
    shuffled = [events[i] for i in rng.permutation(len(events))]
    assert trace_parts.idle_before(shuffled) == [("d", 6.0), ("f", 64.0)]
    assert trace_parts.idle_before([]) == []


def test_the_profile_of_the_real_step_adds_up(step_profile, tmp_path):
    """A KDA layer with the dense SwiGLU, then an MLA layer with a LatentMoE FFN: every part
    and every stage of the mixture has kernels."""
    config = load_config("tiny.py")
    config.model.num_layers, config.model.kda_per_mla = 2, 1
    config.data.seq_len, config.data.global_batch_size = 32, 2
    config.checkpoint.enabled = False
    config.model.moe.update(num_experts=4, top_k=2, expert_dim=16, first_k_dense=1,
                            latent_dim=16)
    r = step_profile.profile(config, steps=1, trace_steps=1, trace_dir=str(tmp_path))
    parts = {part for part, _ in r["parts"]}
    assert {"kda_core", "mla_attention", "mlp", "optimizer"} <= parts
    assert r["step_s"] > 0 and r["ops"]
    table = step_profile.format_table(r, "title")
    assert "| kda_core |" in table and "(gaps: host, launches, idle)" in table
    assert "(1 micro-batch of 2 rows)" in table  # the CPU's choice: the whole batch at once
    assert r["idle"] and "Idle device time by the part" in table
    assert "By stage" in table
    # Every stage of the mixture has kernels (the table leaves out rows under 0.05 ms).
    assert {"moe_router", "moe_dispatch", "moe_experts", "moe_combine", "moe_latent"} <= parts
    rows = dict(step_profile.trace_parts.stages(r["ops"], min_ms=0.0))
    for row in ("router (forward + backward)", "sort / permute", "expert products: forward",
                "expert products: data gradients", "unpermute / combine",
                "latent projections (LatentMoE)", "shared experts", "KDA"):
        assert rows.get(row, 0) > 0, row


def test_attention_bench_checks_and_times_on_cpu(capsys):
    load("attention_bench").main(["--batch=1", "--seq=64", "--heads=2", "--doc_len=20",
                                  "--impls=xla,reference,xla:rows"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert float(rows["reference"].split("|")[4]) < 1e-5  # the definition agrees with xla
    assert "one document per row" in rows["xla:rows"]


def test_attn_res_bench_checks_every_read_against_the_models(capsys, monkeypatch):
    """Each variant of the Attention Residual read gives the model's loss and gradients (to
    bf16 rounding: some take w in bf16), and the model's read is put back afterwards."""
    from kimi_k3.layers.attn_res import DepthResidual
    from tests.helpers import fast_jit

    model_read = DepthResidual._read_list
    bench = load("attn_res_bench")
    monkeypatch.setattr(bench.jax, "jit", fast_jit)  # tiny programs, compile-bound
    # dot_barrier composes the matmul logits and the barrier of the other variants
    variants = ["model", "sum", "dot_barrier"]
    assert set(variants) <= set(bench.READS)
    bench.main(["--batch=1", "--seq=16", "--width=32", "--layers=2", "--block=3", "--reps=1",
                f"--variants={','.join(variants)}"])
    assert DepthResidual._read_list is model_read
    rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out
            .splitlines() if line.startswith("| ") and "---" not in line}
    for name in variants:
        assert float(rows[name][4]) < 2e-3 and float(rows[name][5]) < 3e-2, rows[name]


def test_swiglu_bench_checks_the_kernel_against_xla(capsys):
    """The SwiGLU backward bench (interpret mode here): every row but the floor agrees with
    XLA's backward, the launch parameters given included."""
    load("swiglu_bench").main(["--tokens=24", "--width=64", "--tiles=8,32,4"])
    rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out
            .splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"form", "copy", "xla", "pallas", "8,32,4"}
    for name in ("xla", "pallas", "8,32,4"):
        assert float(rows[name][4]) < 1e-6, rows[name]


def test_loss_curves_compares_each_run_with_the_first(tmp_path, capsys):
    """The table and the largest gaps per step range come from the metrics files (eval rows
    and steps one run lacks left out); a missing or broken file is named."""
    import json
    import random

    curves = load("loss_curves")
    rng = random.Random()
    base = {s: rng.uniform(2, 9) for s in range(1, 11)}
    gap = {s: rng.uniform(0, 0.5) for s in base}
    rows = {"a": [{"step": s, "loss": base[s]} for s in base] + [{"step": 5, "split": "eval",
                                                                  "loss": 99.0}],
            "b": [{"step": s, "loss": base[s] + gap[s]} for s in base if s != 7]}
    paths = {}
    for k, rs in rows.items():
        paths[k] = tmp_path / f"{k}.jsonl"
        paths[k].write_text("\n".join(json.dumps(r) for r in rs) + "\n")
    curves.main([f"a={paths['a']}", f"b={paths['b']}", "--steps=5,7", "--ranges=1-4,5-10",
                 f"--out={tmp_path / 'c.png'}"])
    out = capsys.readouterr().out
    assert f"| 5 | {base[5]:.4f} | {base[5] + gap[5]:.4f} |" in out
    assert f"| 7 | {base[7]:.4f} | — |" in out
    want = [max(gap[s] for s in range(1, 5)), max(gap[s] for s in range(5, 11) if s != 7)]
    assert f"| b | {want[0]:.4f} | {want[1]:.4f} |" in out
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        curves.read_losses(tmp_path / "nope.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2"):
        curves.read_losses(tmp_path / "bad.jsonl")


def test_loss_curves_steps_and_ranges_follow_the_runs(tmp_path, capsys):
    """Without --steps and --ranges the table's rows spread over the span the runs logged
    (2000 steps here, not a fixed 1..50), on steps the first run logged, and the gaps are
    measured over the first and second half of that span."""
    import json

    curves = load("loss_curves")
    paths = []
    for name, last, shift in (("a", 2000, 0.0), ("b", 1500, 0.25)):
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 1000 + shift})
                                     + "\n" for s in range(10, last + 1, 10)))
    runs = {"a": curves.read_losses(paths[0]), "b": curves.read_losses(paths[1])}
    assert curves.spread_steps(runs) == [10, 290, 580, 860, 1150, 1430, 1720, 2000]
    assert curves.halves(runs) == [(10, 1005), (1006, 2000)]
    assert curves.spread_steps({"a": {7: 1.0}}) == [7] and curves.halves({"a": {7: 1.0}}) == [
        (7, 7)]
    curves.main([f"a={paths[0]}", f"b={paths[1]}", "--rows=3"])
    out = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in out.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert rows == ["10", "1000", "2000"], out
    assert "| 2000 | 3.0000 | — |" in out
    assert "| largest gap to a | steps 10-1005 | steps 1006-2000 |" in out
    assert "| b | 0.2500 | 0.2500 |" in out


def test_step_fingerprint_is_stable_and_sees_a_change():
    step_hlo = load("step_hlo")
    config = load_config("tiny.py")
    first = step_hlo.step_text(config)
    assert "func.func public @main" in first and "loc(" not in first
    assert step_hlo.fingerprint(step_hlo.step_text(config)) == step_hlo.fingerprint(first)
    config.model.num_layers = 2
    assert step_hlo.fingerprint(step_hlo.step_text(config)) != step_hlo.fingerprint(first)


def test_kda_kernel_table_gives_each_peer_its_ratio_and_dashes_for_the_missing():
    """benchmarks/kda_kernel.py's table: speed-up = peer time / our time, forward and
    forward+backward, for ours and ours with the gate in the kernel; a missing peer is "—"."""
    kk = load("kda_kernel")
    results = {"8x4096": {"ours": (2.0, 8.0), "ours_gk": (1.6, 6.4), "fla": (2.4, 9.6),
                          "jla": None, "xla": None},
               "small": dict.fromkeys(kk.COLUMNS)}  # not measured: no row
    table = kk.format_table(jax.devices()[0], results, kk.pk.KernelTuning())
    rows = [line for line in table.splitlines() if line.startswith("| 8 x")]
    assert len(rows) == 1 and "| 32 x 2048" not in table
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[0] == "8 x 4096, 16 x 128"
    assert cells[1:6] == ["2.00 / 8.00", "1.60 / 6.40", "2.40 / 9.60", "—", "—"]
    assert cells[7:] == ["1.20x / 1.20x", "—", "1.50x / 1.50x", "—"]


@pytest.fixture(scope="module")
def timing():
    return load("timing")


def test_the_timer_leaves_the_first_call_out_and_times_batches_of_calls(timing, monkeypatch):
    """benchmarks/timing.py on a clock that only the calls advance: the warm-up calls, each
    waited for, the first (compilation) reported alone; then batches of back-to-back calls
    sized from the last warm-up call to at least min_batch_s, one wait per batch; the median
    and the minimum of the seconds per call."""
    rng = np.random.default_rng()
    call_s, compile_s = float(rng.uniform(0.002, 0.004)), float(rng.uniform(1, 5))
    batches, min_batch_s = int(rng.integers(2, 6)), 0.03
    now, calls, waits = [100.0], [], []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def fn(x):
        now[0] += call_s + (compile_s if not calls else 0.0)
        calls.append(x)
        return x

    def sync(out):
        waits.append(len(calls))
        if len(waits) == 4:  # the second batch runs slower: the median is not the minimum
            now[0] += 0.5 * call_s * calls_per_batch

    calls_per_batch = int(np.ceil(min_batch_s / call_s))
    t = timing.time_calls(fn, 1.0, sync=sync, batches=batches, min_batch_s=min_batch_s)
    assert t.first_call_s == pytest.approx(compile_s + call_s)
    assert (t.batches, t.calls_per_batch) == (batches, calls_per_batch), t
    assert len(calls) == 2 + t.calls
    # a wait after each warm-up call, then one at the end of each batch (on all its outputs)
    assert waits == [1, 2] + [2 + calls_per_batch * (i + 1) for i in range(batches)], waits
    assert t.min_seconds == pytest.approx(call_s) and t.min_ms == pytest.approx(1e3 * call_s)
    assert t.seconds == pytest.approx(call_s if batches > 2 else 1.25 * call_s)
    # a budget stops the batches (at least one runs); calls given: no warm-up needed to size
    calls.clear()
    t = timing.time_calls(fn, 1.0, sync=lambda out: None, warmup=0, calls=3, batches=100,
                          budget_s=compile_s + 10 * call_s)
    # the first batch holds the "compilation": batches end at 3, 6, 9, 12 calls past it
    assert t.calls_per_batch == 3 and t.batches == 4, t
    assert np.isnan(t.first_call_s)
    for bad in (dict(batches=0), dict(warmup=0), dict(calls=0)):
        with pytest.raises(ValueError):
            timing.time_calls(fn, 1.0, sync=sync, **bad)


def test_the_timer_measures_a_known_sleep_and_keeps_compilation_out(timing):
    """Real clocks: a call that sleeps a known time (ten times longer the first time, as a
    compilation) is timed at that time or a little more, the first call apart; a jitted JAX
    function is traced and compiled once, in the first call, which takes longer than the
    median call."""
    import time

    n = []

    def sleepy():
        time.sleep(0.05 if not n else 0.005)
        n.append(1)

    t = timing.time_calls(sleepy, sync=lambda out: None, batches=3, min_batch_s=0.02)
    assert t.first_call_s >= 0.05
    assert 0.005 <= t.min_seconds <= t.seconds < 0.02, t
    assert t.batches == 3 and 1 <= t.calls_per_batch <= 4 and len(n) == 2 + t.calls

    traced = []

    @jax.jit
    def f(x):
        traced.append(1)
        return jnp.tanh(x @ x).sum()

    t = timing.time_jax(f, jnp.ones((64, 64)), batches=3)
    assert len(traced) == 1 and t.first_call_s > t.seconds > 0, t
    with timing.stopwatch() as sw:
        time.sleep(0.01)
    assert 0.01 <= sw.seconds < 0.5
    compiled, seconds = timing.compile_jax(jax.jit(lambda x: x * 2), jnp.ones(3))
    assert seconds > 0 and float(compiled(jnp.ones(3))[0]) == 2.0


def test_the_timer_waits_for_torch_through_cuda_synchronize_and_imports_it_lazily(
        timing, monkeypatch):
    """time_torch: the same policy, every wait ``torch.cuda.synchronize()``; importing the
    timer imports neither torch nor JAX."""
    import subprocess
    import types

    syncs = []
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(synchronize=lambda: syncs.append(1))
    monkeypatch.setitem(sys.modules, "torch", fake)
    t = timing.time_torch(lambda: None, batches=2, calls=5)
    assert len(syncs) == 2 + 2 and t.calls == 10
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import benchmarks.timing; "
            "print(sorted({'torch', 'jax'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_kda_kernel_keeps_fla_tuning_results_across_machines(tmp_path, monkeypatch):
    """--fla_tuning: the autotuning results Triton left in its cache go into one .tgz and come
    back in a fresh cache directory that TRITON_CACHE_DIR points to; nothing else is kept, and
    a member reaching outside the cache is not extracted."""
    kk = load("kda_kernel")
    monkeypatch.setenv("TRITON_CACHE_DIR", "unchanged")
    first = kk.restore_fla_tuning(str(tmp_path / "none_yet.tgz"))  # none yet: an empty cache
    assert os.environ["TRITON_CACHE_DIR"] == first and not os.listdir(first)
    rng = np.random.default_rng()
    want = {}
    for i in range(int(rng.integers(1, 5))):
        f = Path(first) / f"HASH{i}" / f"kernel_{i}.autotune.json"
        f.parent.mkdir()
        want[f"HASH{i}/{f.name}"] = f'{{"configs_timings": {rng.random()}}}'
        f.write_text(want[f"HASH{i}/{f.name}"])
        (f.parent / "kernel.cubin").write_bytes(b"compiled code is not kept")
    path = str(tmp_path / "fla.tgz")
    assert kk.save_fla_tuning(first, path) == len(want)
    with tarfile.open(path) as tar:
        assert sorted(tar.getnames()) == sorted(want)
    evil = tmp_path / "evil.tgz"  # the same results plus one member outside the cache
    with tarfile.open(path) as src, tarfile.open(evil, "w:gz") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m))
        info = tarfile.TarInfo("../outside.autotune.json")
        info.size = 2
        dst.addfile(info, io.BytesIO(b"{}"))
    second = kk.restore_fla_tuning(str(evil))
    assert second != first and os.environ["TRITON_CACHE_DIR"] == second
    got = {str(f.relative_to(second)): f.read_text() for f in Path(second).rglob("*") if f.is_file()}
    assert got == want and not (Path(second).parent / "outside.autotune.json").exists()
    corrupt = tmp_path / "corrupt.tgz"
    corrupt.write_bytes(b"not a tar archive")
    with pytest.raises(SystemExit, match=r"--fla_tuning: .*corrupt.tgz is not a readable"):
        kk.restore_fla_tuning(str(corrupt))


def test_kda_kernel_packs_rows_with_documents_of_about_the_given_length():
    """kda_kernel.py --documents L: every row is documents 1, 2, ... in order, each at least 16
    tokens (the last may be cut by the row's end), about L tokens on average."""
    kk = load("kda_kernel")
    rng = np.random.default_rng()
    L = int(rng.integers(50, 200))
    segs = np.asarray(kk.document_ids(16, 4096, L, seed=int(rng.integers(1 << 30))))
    assert segs.shape == (16, 4096) and segs.dtype == np.int32
    whole = []  # the documents the row's end did not cut
    for row in segs:
        assert row[0] == 1 and set(np.diff(row)) <= {0, 1}
        whole.extend(np.bincount(row)[1:-1])
    assert min(whole) >= 16 and 0.7 * L < np.mean(whole) < 1.3 * L, (L, np.mean(whole))
    table = kk.format_table(jax.devices()[0], {}, kk.pk.KernelTuning(), documents=L)
    assert f"packed documents of ~{L} tokens" in table


def test_micro_batch_order_bench_counts_one_document_micro_batches_on_cpu(tmp_path, capsys):
    """benchmarks/micro_batch_order.py over text files laid out so that half the rows of 512
    bytes are one document (a 512-byte file) and half are eight (eight 64-byte files): the
    step's order reaches the most micro-batches of two one-document rows that each global
    batch allows, the rows' own order fewer, and the printed shares say so."""
    rng = np.random.default_rng()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(24):  # files sorted by name: block i is one row of one document, then a
        (docs / f"{i:03d}_0.txt").write_bytes(rng.integers(97, 123, 512, np.uint8).tobytes())
        for j in range(1, 9):  # row of eight
            (docs / f"{i:03d}_{j}.txt").write_bytes(rng.integers(97, 123, 64, np.uint8).tobytes())
    (tmp_path / "eval.txt").write_bytes(b"held out " * 100)
    cfg = tmp_path / "rows.py"
    cfg.write_text(
        "from kimi_k3.config_files import load_config\n\n\n"
        "def get_config(arg=None):\n"
        f"    config = load_config({str(REPO / 'configs' / 'tiny.py')!r})\n"
        "    config.data.source = 'text'\n"
        f"    config.data.paths = {str(docs / '*.txt')!r}\n"
        f"    config.data.eval_paths = {str(tmp_path / 'eval.txt')!r}\n"
        "    return config\n")
    mob = load("micro_batch_order")
    config = load_config(str(cfg))
    batches = mob.global_batches(config, 2, 512)
    one_doc_rows = [int(np.sum(np.max(segs, axis=1) == 1)) for segs in batches]
    # 8 rows a batch in micro-batches of 2: at most n // 2 of the 4 pair one-document rows
    best = sum(n // 2 for n in one_doc_rows) / 8
    mob.main([f"--config={cfg}", "--microbatch_size=2", "--seq=512", "--steps=2", "--heads=1",
              "--impl=xla", "--reps=1"])
    out = capsys.readouterr().out
    share = {line.split("|")[1].strip(): float(line.split("|")[2].strip().rstrip("%"))
             for line in out.splitlines() if line.startswith("| given") or line.startswith("| step")}
    assert set(share) == {"given", "step"}
    assert 0 < best < 1 and share["step"] == pytest.approx(100 * best, abs=0.05)
    assert share["given"] < share["step"]


def test_kda_profile_opens_a_window_per_tuning_and_names_bad_arguments(capsys, tmp_path):
    """benchmarks/kda_profile.py on CPU (no CUDA driver: the profiler window does nothing): one
    window per --tune value, in order; --reps below 1, an unknown tuning key and a missing
    --fla_tuning file are refused by name."""
    kp = load("kda_profile")
    kp.main(["--smoke", "--forward", "--tune", "bk=16;"])
    windows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("window")]
    assert len(windows) == 2
    assert "tune 'bk=16'" in windows[0] and "tune 'defaults'" in windows[1]
    for argv, named in ((["--smoke", "--reps", "0"], "--reps"),
                        (["--smoke", "--tune", "blocks=2"], "--tune"),
                        (["--smoke", "--fla_tuning", str(tmp_path / "none.tgz")], "none.tgz")):
        with pytest.raises(SystemExit):
            kp.main(argv)
        assert named in capsys.readouterr().err


def test_ncu_table_splits_windows_and_converts_units(tmp_path, capsys):
    """benchmarks/ncu_table.py: a window starts where the report's first kernel comes again;
    times are converted to ms from the unit row; a file that is not such a report is named."""
    nt = load("ncu_table")
    rng = np.random.default_rng()
    us = rng.uniform(1, 3000, size=(2, 3)).round(3)
    lines = ['"ID","Kernel Name","gpu__time_duration.sum"', '"","","usecond"']
    for w in range(2):
        for name, t in zip(("fusion", "kda_intra_fwd", "kda_state_fwd"), us[w], strict=True):
            lines.append(f'"{len(lines)}","{name}","{t:,}"')
    path = tmp_path / "report.csv"
    path.write_text("\n".join(lines) + "\n")
    nt.main([str(path), "--labels", ";bk=16"])
    rows = {line.split("|")[1].strip(): [c.strip().strip("*") for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines()[2:]}
    assert list(rows) == ["fusion", "kda_intra_fwd", "kda_state_fwd", "**total**"]
    for w in range(2):
        assert float(rows["kda_intra_fwd"][w]) == pytest.approx(us[w, 1] / 1e3, abs=6e-4)
        assert float(rows["**total**"][w]) == pytest.approx(us[w].sum() / 1e3, abs=2e-3)
    bad = tmp_path / "bad.csv"
    bad.write_text("not,a,report\n")
    with pytest.raises(SystemExit, match="bad.csv"):
        nt.main([str(bad)])


def test_ncu_sass_shares_add_up_and_loops_show_as_runs(tmp_path, capsys):
    """benchmarks/ncu_sass.py on a made-up source page: stall and opcode shares are the
    samples' own, the hottest line is listed with its reason, and a loop body (lines executed
    4x as often) is one run of lines; a kernel not in the report is refused by name."""
    sm = load("ncu_sass")
    rng = np.random.default_rng()
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
    body = [("LDG.E.128 R4, desc[UR4][R2.64]", 1), ("@P0 STS.128 [R8], R4", 4),
            ("FFMA R1, R2, R3, R4", 4), ("HMMA.16816.F32.BF16 R8, R4, R6, RZ", 4),
            ("STG.E [R2.64], R8", 1)]
    long_sb = rng.integers(0, 500, size=len(body))
    wait = rng.integers(1, 500, size=len(body))
    lines = [",".join(f'"{c}"' for c in ("Kernel Name", "other")), ",".join(header),
             '"0x0","NOP","3","10","0","3","0"',
             ",".join(f'"{c}"' for c in ("Kernel Name", "kda_intra_bwd_channels")),
             ",".join(header)]
    for i, ((src, times), a, b) in enumerate(zip(body, long_sb, wait, strict=True)):
        lines.append(",".join(f'"{c}"' for c in (hex(i), src, a + b, 1000 * times, a, b, a)))
    path = tmp_path / "src.csv"
    path.write_text("\n".join(lines) + "\n")
    sm.main([str(path), "--kernel", "kda_intra_bwd_channels", "--top", "5"])  # every opcode
    out = capsys.readouterr().out
    total = int(long_sb.sum() + wait.sum())
    assert f"| long_sb | {100 * long_sb.sum() / total:.1f}% |" in out
    sts = int(long_sb[1] + wait[1])
    assert f"| STS | {100 * 4000 / 14000:.1f}% | {100 * sts / total:.1f}% |" in out
    assert "| 1-4 | 4000 |" in out and "| 0-1 | 1000 |" in out and "| 4-5 | 1000 |" in out
    sm.main([str(path), "--kernel", "kda_intra_bwd_channels", "--top", "1"])  # the hottest line
    hot = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")
           and line.split("|")[1].strip().isdigit()]
    assert len(hot) == 1 and hot[0].startswith(f"| {int(np.argmax(long_sb + wait))} | ")
    with pytest.raises(SystemExit):
        sm.main([str(path), "--kernel", "kda_intra_fwd"])
    assert "kda_intra_fwd" in capsys.readouterr().err


def test_kda_kernel_times_the_work_of_fla_backward():
    """kda_kernel.jax_fns: forward+backward returns o and the gradients of the cotangent do in
    all five inputs (fla's torch.autograd.grad(o, inputs, do)), equal to those of the old
    measurement, sum(o * do) (--sum_loss), on a small function of the five inputs."""
    kk = load("kda_kernel")
    rng = np.random.default_rng()
    shape = (2, 8, 3, 4)
    q, k, v, g = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4))
    beta = jnp.asarray(rng.uniform(size=shape[:3]), jnp.float32)
    do = jnp.asarray(rng.standard_normal(shape), jnp.float32)

    def fwd(q, k, v, g, beta):
        return jnp.tanh(q * k) * v * jnp.exp(g) + beta[..., None] * q

    _, fwdbwd = kk.jax_fns(fwd)
    o, grads = fwdbwd(q, k, v, g, beta, do)
    np.testing.assert_allclose(o, fwd(q, k, v, g, beta), rtol=1e-5, atol=1e-6)
    _, summed = kk.jax_fns(fwd, sum_loss=True)
    value, grads_sum = summed(q, k, v, g, beta, do)
    np.testing.assert_allclose(value, np.sum(np.asarray(o) * np.asarray(do)), rtol=1e-4)
    assert len(grads) == len(grads_sum) == 5
    for a, b in zip(grads, grads_sum, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(grads[4]))) > 0  # beta's gradient is not dropped


def test_every_runner_command_parses_with_its_scripts_flags(capsys):
    """benchmarks/run.py's registry: every command line, placeholders filled, names a script of
    the repository and parses with that script's own flags (tests/test_docs.py's parser); the
    groups name entries; --print shows the commands."""
    import dataclasses

    from tests import test_docs

    run = load("run")
    values = {"python": "python3", "out": "runs/bench/x", "work": "runs/bench/work",
              "anchor": "runs/anchor.py", "fla_tuning": run.FLA_TUNING}
    problems, jobs, scripts = [], [], set()
    for name, b in run.REGISTRY.items():
        assert b.commands and b.what, name
        for cmd in (*b.prepare, *b.commands):
            line = run.command_line(dataclasses.replace(cmd, stdout=""), values)
            assert "{" not in line, line  # every placeholder known
            if "{anchor}" in cmd.argv or cmd.argv[0] == "bash":
                assert (REPO / cmd.argv[1]).is_file() or "{anchor}" in cmd.argv, line
                continue
            found = test_docs.commands(line, f"run.py:{name}")
            assert len(found) == 1, line
            scripts.add(found[0].target)
            bad, job = test_docs.static_problems(found[0])
            problems += bad
            script = Path(found[0].target)
            if job and "def parse_args(argv" in (REPO / script).read_text():
                try:  # a parser of its own: parsed here (its module holds dataclasses)
                    load(script.stem).parse_args(job["argv"])
                except SystemExit:
                    problems.append(f"{job['where']}: refused")
                continue
            jobs += [job] if job else []
    assert {"benchmarks/kda_kernel.py", "benchmarks/train_throughput.py", "eval.py"} <= scripts
    problems += [f"{job['where']}: {message}" for job, message
                 in zip(jobs, test_docs.parse_in_subprocess(jobs), strict=True) if message]
    assert not problems, "\n".join(problems)
    assert all(n in run.REGISTRY for names in run.GROUPS.values() for n in names)
    assert set(run.GROUPS).isdisjoint(run.REGISTRY)
    run.main(["kda", "--print", "--out_dir=$OUT"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == ["# kda_kernel: " + run.REGISTRY["kda_kernel"].what, run.command_line(
        run.REGISTRY["kda_kernel"].commands[0],
        {**values, "out": "$OUT/kda_kernel", "work": "/tmp/bench_work/kda_kernel"})]
    assert "--no_xla" in printed[1] and len(printed) == 6, printed
    # An entry compiling ahead: its prepare commands backgrounded together, then "wait", then
    # the measured commands; every one of them with the entry's cache.
    run.main(["moe_train", "--print", "--out_dir=$OUT"])
    printed = capsys.readouterr().out.splitlines()
    wait = printed.index("wait")
    prepare, measured = printed[wait - 2:wait], printed[wait + 1:]
    assert all(line.endswith(" --compile_only "
                             "--compilation_cache=/tmp/bench_work/moe_train/jax_cache &")
               and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in line for line in prepare), printed
    assert len(measured) == 2 and all(
        "--compilation_cache=/tmp/bench_work/moe_train/jax_cache" in line
        and "--compile_only" not in line for line in measured), printed
    for lines in (prepare, measured):
        assert ["moe_1b.py" in lines[0], "configs/1b.py" in lines[1]] == [True, True], lines
    fp8 = run.REGISTRY["fp8_train"].commands[0].argv
    assert "--compile_first" in fp8 and run.JAX_CACHE in fp8


def test_the_runner_runs_each_entry_in_its_folder_with_a_time_limit(tmp_path, monkeypatch, capsys):
    """benchmarks/run.py with a registry of small commands: an entry's output and files land in
    its folder (a command's stdout in the file it names), a command past its limit is killed
    and says so, an entry needing --anchor or a missing wheel is skipped with the reason,
    summary.md lists them all, --pack moves the folders into results.tgz; names are checked,
    and ``all`` takes the GPU entries this host has the GPUs for."""
    import time

    run = load("run")
    Command, Benchmark = run.Command, run.Benchmark
    registry = {
        "table": Benchmark("prints a table, writes a file", (Command(
            ("{python}", "-c", "print('| a |'); open('{out}/x.md', 'w').write('{work}')"),
            stdout="table.md"),), gpus=0, wheels=()),
        "slow": Benchmark("sleeps past its limit", (Command(
            ("{python}", "-c", "import time; print('started', flush=True); time.sleep(60)"),
            timeout_s=2),), wheels=()),
        "anchored": Benchmark("the anchor", (Command(("{python}", "{anchor}")),),
                              needs_anchor=True, wheels=()),
        "wheeled": Benchmark("needs a missing wheel", (Command(("{python}", "-c", "pass")),),
                             gpus=2, wheels=("no-such-distribution",)),
        # "first" ends only if "second" runs beside it; "stuck" is stopped at its limit; the
        # measured command comes after them all.
        "prepared": Benchmark("prepare commands together, then the measured one", (Command(
            ("{python}", "-c", "import os; print('after', sorted(os.listdir('{work}')))")),),
            wheels=(), gpus=0, prepare=(
                Command(("{python}", "-c", "import os, time\n"
                         "while not os.path.exists('{work}/second'): time.sleep(0.05)\n"
                         "print('first done'); open('{work}/first', 'w')"), timeout_s=20),
                Command(("{python}", "-c", "open('{work}/second', 'w'); print('second done')"),
                        timeout_s=20),
                Command(("{python}", "-c", "import time; time.sleep(60)"), timeout_s=2))),
        # --work_dir: the scratch emptied before the entry, but for its compilation cache
        "kept": Benchmark("keeps its cache", (Command(
            ("{python}", "-c", "import os; print('found', sorted(os.listdir('{work}'))); "
             "os.makedirs('{work}/jax_cache', exist_ok=True); os.makedirs('{work}/run')")),),
            wheels=(), gpus=0),
    }
    monkeypatch.setattr(run, "REGISTRY", registry)
    monkeypatch.setattr(run, "GROUPS", {"pair": ("table", "slow")})
    assert run.select(["pair", "table", "anchored"], gpus=0, have_anchor=False) == [
        "table", "slow", "anchored"]
    assert run.select(["all"], gpus=1, have_anchor=False) == ["slow"]
    assert run.select(["all"], gpus=2, have_anchor=True) == ["slow", "anchored", "wheeled"]
    with pytest.raises(ValueError, match="no benchmark or group 'nope'"):
        run.select(["nope"], gpus=1, have_anchor=True)
    t0 = time.monotonic()
    rows = run.main(["pair", "anchored", "wheeled", "prepared", f"--out_dir={tmp_path}",
                     "--pack"])
    assert time.monotonic() - t0 < 30  # the sleepers were killed at their limits
    status = {r["name"]: r["status"] for r in rows}
    assert status["table"] == "ok", rows
    assert status["prepared"] == "prepare: timed out after 2 s", rows
    assert status["slow"] == "timed out after 2 s"
    assert status["anchored"] == "skipped: needs --anchor=PATH"
    assert status["wheeled"].startswith("skipped: no-such-distribution not importable")
    assert sorted(os.listdir(tmp_path)) == ["results.tgz", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| table | ok |" in summary and "table.md, x.md" in summary
    with tarfile.open(tmp_path / "results.tgz") as tar:
        names = set(tar.getnames())
        assert {"table/log.txt", "table/table.md", "table/x.md", "slow/log.txt"} <= names
        assert tar.extractfile("table/table.md").read() == b"| a |\n"
        work = tar.extractfile("table/x.md").read().decode()
        log = tar.extractfile("slow/log.txt").read().decode()
        prepared = tar.extractfile("prepared/log.txt").read().decode()
    assert work.endswith("table") and not work.startswith(str(tmp_path))  # scratch elsewhere
    assert "started" in log and "timed out after 2 s" in log and "$ " in log
    # each prepare command's output after its own command line, then the measured command's
    sections = [prepared.index(t) for t in ("while not os.path", "first done\n", "second done\n",
                                            "time.sleep(60)", "timed out after 2 s",
                                            "after ['first', 'second'")]
    assert sections == sorted(sections), prepared
    assert prepared.count("$ ") == 4 and prepared.count("[run] exit 0 after") == 3, prepared
    for _ in range(2):
        run.main(["kept", f"--out_dir={tmp_path / 'kept'}", f"--work_dir={tmp_path / 'work'}"])
    kept = (tmp_path / "kept" / "kept" / "log.txt").read_text()
    assert "found []" in kept and "found ['jax_cache']" in kept, kept
    with pytest.raises(SystemExit):
        run.main(["nope", f"--out_dir={tmp_path}"])
    assert "no benchmark or group 'nope'" in capsys.readouterr().err


def test_routed_experts_bench_checks_each_form_against_the_sorted_rows(capsys):
    """routed_experts_bench.py --smoke: every form on the same routing, each checked against the
    sorted rows (dropless at this capacity factor), and the blocked kernels' own table."""
    bench = load("routed_experts_bench")
    bench.main(["--smoke", "--capacity_factor=2", "--kernels=wgrad"])
    out = capsys.readouterr().out
    rows = {r.split("|")[2].strip(): r.split("|") for r in out.splitlines()
            if r.startswith("| 64 |")}
    assert set(rows) == {"blocked", "sorted_xla", "capacity", "ceiling"}, out
    for impl in ("blocked", "sorted_xla", "capacity"):
        assert float(rows[impl][4]) < 2e-2, rows[impl]  # bf16 against the sorted rows
    kernels = [r for r in out.splitlines() if "| wgrad " in r]
    assert len(kernels) == 2 and all(float(r.split("|")[3]) > 0 for r in kernels), out
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--capacity_factor=0"])
    assert "--capacity_factor: 0.0 must be > 0" in capsys.readouterr().err


def _train_step_entries(cache) -> list[str]:
    """The cache's entries for the train step (JAX names an entry after its program)."""
    return sorted(f for f in os.listdir(cache) if f.startswith("jit_train_step-"))


def test_compiling_first_makes_each_measured_run_read_its_step_from_the_cache(
        tmp_path, jax_cache, rng):
    """train_throughput.py --compile_first, two variants of different shapes: both compiled
    at once into a fresh cache, then each measured run reads its initialiser and train step
    from it and compiles nothing into it (a step lowered otherwise than the compile-only
    run's would have been written: a third entry); the two variants' steps are two entries."""
    cache, work = tmp_path / "cache", tmp_path / "runs"
    seq_len = int(rng.choice([48, 64]))
    p = subprocess.run(
        [sys.executable, "benchmarks/train_throughput.py", "--smoke", "--compile_first",
         f"--compilation_cache={cache}", f"--workdir={work}", "--variant=a=",
         f"--variant=b=--config.data.seq_len={seq_len}",
         f"--config.seed={int(rng.integers(1000))}"],
        cwd=REPO, env=env(jax_cache), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for label in ("a", "b"):
        compiled = (work / f"{label}.compile.log").read_text()
        assert "compile_only: train_step" in compiled and "written to the persistent cache" \
            in compiled, compiled
    rows = {r.split("|")[1].strip(): r.split("|") for r in p.stdout.splitlines()
            if r.startswith("| ") and not r.startswith("| run")}
    assert set(rows) == {"a", "b"}, p.stdout
    assert rows["b"][3].strip() == f"4 x {seq_len}"
    for label in ("a", "b"):
        assert rows[label][-3].strip() == "2 read, 0 compiled and written", rows[label]
        assert rows[label][-2].strip() == "ok", rows[label]
    assert len(_train_step_entries(cache)) == 2


def test_step_profile_reads_the_step_its_compile_only_run_wrote(tmp_path, jax_cache):
    """step_profile.py --compile_only then the profile, with one cache: the profile's step is
    read from it; --compile_only without a cache, and train_throughput.py's flags that do not
    go together, are refused naming the flag."""
    cache = tmp_path / "cache"
    flags = [*TINY[:5], "--config.data.global_batch_size=2", f"--compilation_cache={cache}"]
    run = lambda *args: subprocess.run([sys.executable, *args], cwd=REPO, env=env(jax_cache),
                                       capture_output=True, text=True, timeout=300)
    p = run("benchmarks/step_profile.py", *flags, "--compile_only")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("compile_only:")]
    assert [ln.split()[1] for ln in lines] == ["initialiser", "train_step"], p.stdout
    assert all("compiled and written to the persistent cache (micro-batch 2 rows)" in ln
               for ln in lines), lines
    entries = _train_step_entries(cache)
    p = run("benchmarks/step_profile.py", *flags, "--steps=1", "--trace_steps=0")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(the train step read from the persistent cache); the process's persistent cache: " \
        "2 read, 0 compiled and written" in p.stdout, p.stdout
    assert _train_step_entries(cache) == entries and len(entries) == 1
    for args, message in (
            (["benchmarks/step_profile.py", "--compile_only", "--compilation_cache="],
             "--compile_only needs a cache to compile into: --compilation_cache is ''"),
            (["benchmarks/train_throughput.py", "--compile_only", "--variant=a="],
             "--compile_only compiles one run's programs, not --variant's runs")):
        p = run(*args)
        assert p.returncode != 0 and message in p.stderr, (args, p.stderr[-2000:])


@pytest.mark.parametrize("script,preset", [("train.py", None), ("benchmarks/step_profile.py", None),
                                           ("benchmarks/step_profile.py", "0.5")])
def test_the_profile_runs_the_step_on_the_trainers_share_of_the_gpu(tmp_path, script, preset):
    """train.py and step_profile.py give JAX's allocator the same share of a GPU
    (kimi_k3.TRAINER_MEM_FRACTION) before JAX starts, so the profile's planner picks train.py's
    micro-batch; a fraction the user set is kept."""
    e = env(str(tmp_path))
    e.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    if preset:
        e["XLA_PYTHON_CLIENT_MEM_FRACTION"] = preset
    code = (f"import os, runpy; runpy.run_path({str(REPO / script)!r}, run_name='not_main'); "
            "print(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))")
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == (preset or kimi_k3.TRAINER_MEM_FRACTION)
