r"""Where a training step's time goes: the real jitted step, profiled, summed by model part.

    python benchmarks/step_profile.py --config=configs/1b.py --config.data.global_batch_size=8 \
        --out=runs/profile_1b.md --trace_dir=runs/profile_1b_trace
    python benchmarks/step_profile.py --config=configs/tiny.py --steps=3   # CPU, a smoke run

It builds the trainer's own step (``train_lib.build``: the same model, loss, optimizer and
sharding as ``train.py``) on real data rows, times it (median over ``--steps`` steps, each
waited for), then records a ``jax.profiler`` trace of ``--trace_steps`` steps. Every device
kernel in the trace is matched to the HLO instruction that launched it, and that instruction's
``op_name`` (the name stack of the model's ``jax.named_scope`` labels) gives its part:

    kda_proj, kda_conv, kda_gate, kda_core, kda_out    the KDA layer's stages (kda_core: kernel;
                                                       with kda.gate_in_kernel, the decay gate)
    mla_proj, mla_attention, mla_out                   the Gated MLA layer's
    mlp, norm, attn_res, embed, head, loss, optimizer  the rest of the model and the update
    moe_router, moe_dispatch, moe_experts,             a mixture of experts' routing, blocked
    moe_combine, moe_shared                            layout, expert kernels (with their
                                                       SwiGLU), gather-and-sum, shared expert
    moe, expert_bias                                   the rest of the mixture (other expert
                                                       paths) and its bias update
    other                                              whatever carries no label (copies, scan
                                                       plumbing, layout changes)

and its phase: forward, recompute (rematerialised forward inside the backward pass) or
backward. The table gives milliseconds per step for each, the share of the measured step, and
the gap between the step's wall time and the sum of kernel times (host work, launch gaps,
idle), and where the device sat idle: each gap between kernels on the device timeline, summed
by the part of the kernel that came after it. The trace itself stays in ``--trace_dir`` for
Perfetto / TensorBoard.

The micro-batch is the one ``train.py`` would run (``train_lib.build`` of the config itself:
with ``train.microbatch_size = 0`` the planner's choice, and a near miss of the plan decided by
the compiled step), on the share of a GPU's memory train.py lets JAX take
(``kimi_k3.TRAINER_MEM_FRACTION``, unless XLA_PYTHON_CLIENT_MEM_FRACTION is set).

Compiling ahead: ``--compile_only`` builds the setup as the profile does, compiles the
initialiser and the train step from shapes alone (``train_lib.compile_ahead``: no train state
allocated, so several can share a card with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``), prints a
line per program and exits. With the same ``--compilation_cache=DIR`` (kimi_k3/compile_cache.py)
the profile then reads every one of them from DIR; its header says whether the step came from
the cache and what the cache did in the process (programs read; programs compiled and written):

    python benchmarks/step_profile.py --config=configs/1b.py --compilation_cache=/tmp/jc \
        --compile_only
    python benchmarks/step_profile.py --config=configs/1b.py --compilation_cache=/tmp/jc
"""

from __future__ import annotations

import csv
import os
import sys
import time
from pathlib import Path

import jax
from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for benchmarks/

import kimi_k3

# train.py's step on train.py's share of the GPU (set before JAX starts its GPU client).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", kimi_k3.TRAINER_MEM_FRACTION)

from benchmarks import timing, trace_parts
from benchmarks.trace_parts import (
    MOE_PARTS,
    PARTS,
    PHASES,
    attribute,
    kernel_events,
    op_names_from_hlo,
    part_and_phase,
)
from kimi_k3 import compile_cache, train_lib
from kimi_k3 import data as data_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import metrics as metrics_lib
from kimi_k3.config import run_spec
from kimi_k3.model import flops_per_token

config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file.", lock_config=True)
flags.DEFINE_integer("steps", 8, "Timed steps (after two warm-up steps).")
flags.DEFINE_integer("trace_steps", 3, "Steps recorded by the profiler (0: no trace).")
flags.DEFINE_string("trace_dir", "", "Where the profiler trace goes; default a temporary folder.")
flags.DEFINE_string("out", "", "Markdown file for the table (also printed).")
flags.DEFINE_string("ops_out", "", "CSV of every kernel: ms per step, HLO op, part, phase, op_name.")
flags.DEFINE_bool("compile_only", False, "Compile the profile's initialiser and train step into "
                  "--compilation_cache, print a line for each and exit: nothing runs.")
_CACHE = compile_cache.define_flag()
FLAGS = flags.FLAGS
COMPILED_PREFIX = "compile_only:"  # --compile_only's line for each program

# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def build(config) -> train_lib.Setup:
    """The trainer's setup for ``config``, as the profile (and --compile_only) builds it: as
    ``train.py`` does, from the config itself (its micro-batch chosen as the trainer's is)."""
    return train_lib.build(config, mesh_lib.make_mesh(run_spec(config).mesh))


def compile_only(config) -> list[str]:
    """--compile_only: the profile's programs compiled ahead (``train_lib.compile_ahead``);
    a line each."""
    return [f"{COMPILED_PREFIX} {program}" for program in train_lib.compile_ahead(build(config))]


def profile(config, steps: int, trace_steps: int, trace_dir: str) -> dict:
    """Times the trainer's step for ``config`` and attributes its kernels to model parts."""
    setup = build(config)
    spec = setup.spec
    B, T = spec.data.global_batch_size, spec.data.seq_len
    stream, _ = data_lib.load_split_streams(spec.data, spec.model.vocab_size)
    rows = data_lib.PackedRows(stream, T, spec.seed, spec.data.shuffle)
    it = data_lib.BatchIterator(rows, B, data_lib.host_batch_slice(setup.batch_sharding, (B, T)))
    batches = [train_lib.global_batch(next(it), setup.batch_sharding, B) for _ in range(4)]
    state = setup.init_state()

    # Compiled once, ahead of the first step: the trace's kernel names then match this very
    # executable's HLO text (a second compile may number its fusions differently), and the
    # 1B step is not compiled twice.
    with timing.stopwatch() as compiling, compile_cache.counting() as step_cache, \
            setup.context():
        step_fn = setup.train_step.lower(state, batches[0]).compile()
    compile_s = compiling.seconds
    hlo = step_fn.as_text()
    calls = 0

    def one_step():
        """One training step on the next of the batches (the state carried): its metrics."""
        nonlocal state, calls
        with setup.context():
            state, m = step_fn(state, batches[calls % len(batches)])
        calls += 1
        return m

    # Two warm-up steps, then each step a batch of its own, waited for (the state threads
    # through the steps; benchmarks/timing.py).
    step_s = timing.time_jax(one_step, warmup=2, calls=1, batches=steps).seconds
    result = {"step_s": step_s, "compile_s": compile_s, "step_cache": step_cache, "tokens": B * T,
              "microbatch": setup.microbatch_size, "seq_len": T,
              "flops_per_token": flops_per_token(spec.model, T),
              "peak_bytes": metrics_lib.peak_memory_bytes(), "parts": {}, "top": []}
    if trace_steps <= 0:
        return result
    os.makedirs(trace_dir, exist_ok=True)
    with open(os.path.join(trace_dir, "step.hlo.txt"), "w") as f:  # to read a kernel's fusion
        f.write(hlo)
    jax.profiler.start_trace(trace_dir)
    for _ in range(trace_steps):
        jax.block_until_ready(one_step())
    jax.profiler.stop_trace()
    result.update(attribute(kernel_events(trace_dir), op_names_from_hlo(hlo), trace_steps))
    return result


def _cache_text(r: dict) -> str:
    """The header's words on JAX's persistent cache: where the step came from, and what the
    cache did in the whole process (``r["cache"]``, when counted)."""
    step = r.get("step_cache")
    if step is None:
        return ""
    total = f"; the process's persistent cache: {r['cache']}" if r.get("cache") else ""
    return f" (the train step {step.source()}){total}"


def _microbatches(r: dict) -> str:
    """How the step ran its global batch: "32 micro-batches of 2 rows"."""
    rows = r["tokens"] // r["seq_len"]
    n, m = rows // r["microbatch"], r["microbatch"]
    return f"{n} micro-batch{'es' if n > 1 else ''} of {m} row{'s' if m > 1 else ''}"


def format_table(r: dict, title: str) -> str:
    step_ms = 1e3 * r["step_s"]
    peak = 989e12 if jax.default_backend() == "gpu" else None
    mfu = metrics_lib.mfu(r["flops_per_token"], r["tokens"] / r["step_s"], peak, 1)
    lines = [
        title, "",
        f"step {step_ms:.1f} ms"
        + (f" ({_microbatches(r)})" if r.get("microbatch") else "")
        + f", {r['tokens'] / r['step_s']:,.0f} tokens/s"
        + (f", MFU {100 * mfu:.1f}% (989 TFLOP/s dense bf16)" if mfu else "")
        + (f", peak {r['peak_bytes'] / 2**30:.1f} GiB" if r["peak_bytes"] else "")
        + f"; compilation {r['compile_s']:.0f} s{_cache_text(r)}", "",
    ]
    if not r["parts"]:
        return "\n".join(lines)
    lines += ["| part | forward ms | recompute ms | backward ms | total ms | share of step |",
              "|---|---|---|---|---|---|"]
    kernel_total = 0.0
    for part in (*PARTS, *MOE_PARTS, "other"):
        row = [r["parts"].get((part, ph), 0.0) for ph in PHASES]
        total = sum(row)
        kernel_total += total
        if total:
            lines.append(f"| {part} | " + " | ".join(f"{x:.1f}" for x in row)
                         + f" | {total:.1f} | {100 * total / step_ms:.1f}% |")
    gap = step_ms - kernel_total
    lines.append(f"| (all kernels) |  |  |  | {kernel_total:.1f} | {100 * kernel_total / step_ms:.1f}% |")
    lines.append(f"| (gaps: host, launches, idle) |  |  |  | {gap:.1f} | {100 * gap / step_ms:.1f}% |")
    if any(part in MOE_PARTS for part, _ in r["parts"]):
        lines += ["", "By stage (a mixture of experts' step; the experts' products by kernel):",
                  "", "| stage | ms | share of step |", "|---|---|---|"]
        lines += [f"| {row} | {ms:.1f} | {100 * ms / step_ms:.1f}% |"
                  for row, ms in trace_parts.stages(r["ops"])]
    if r.get("idle"):
        lines += ["", "Idle device time by the part whose kernel came next (ms and gaps per step; "
                  "with XLA's command buffers off, every kernel is a launch of its own):", "",
                  "| part | idle ms | gaps |", "|---|---|---|"]
        for part, (ms, n) in sorted(r["idle"].items(), key=lambda kv: -kv[1][0]):
            lines.append(f"| {part} | {ms:.2f} | {n:.0f} |")
    lines += ["", "Largest kernels (ms per step, op_name):", ""]
    lines += [f"- {ms:.2f} ms `{op}`: {name[:160]}" for (op, name), ms in r["top"][:15]]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.compile_only and not FLAGS.compilation_cache:
        raise app.UsageError("--compile_only needs a cache to compile into: --compilation_cache "
                             "is ''")
    trace_parts.commands_apart()  # the XLA flags (part of the cache key) of both modes
    compile_cache.enable(FLAGS.compilation_cache)
    config = FLAGS.config
    config.checkpoint.enabled = False
    if FLAGS.compile_only:
        for line in compile_only(config):
            print(line, flush=True)
        return
    trace_dir = FLAGS.trace_dir or os.path.join("/tmp", f"step_profile_{os.getpid()}")
    with compile_cache.counting() as cache:
        r = profile(config, FLAGS.steps, FLAGS.trace_steps, trace_dir)
    r["cache"] = cache
    dev = jax.devices()[0]
    title = (f"Step profile: `{' '.join(sys.argv[1:])}`; {dev.device_kind}, JAX "
             f"{jax.__version__}, {time.strftime('%Y-%m-%d')}")
    table = format_table(r, title)
    print(table, flush=True)
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            f.write(table + "\n")
    if FLAGS.ops_out:
        with open(FLAGS.ops_out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["ms_per_step", "hlo_op", "part", "phase", "op_name"])
            for (op, name), ms in r.get("ops", []):
                w.writerow([f"{ms:.4f}", op, *part_and_phase(name), name])


if __name__ == "__main__":
    app.run(main)
