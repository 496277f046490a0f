r"""What the internals report (kimi_k3/internals.py) costs a training run: the training step
against one internals computation, and their ratio at the report's interval.

    python benchmarks/internals_cost.py --config=configs/small.py --out=internals_cost_small.md
    python benchmarks/internals_cost.py --smoke         # CPU: configs/tiny.py, short rows

Both are ``train.py``'s own (``train_lib.build``'s jitted step; the trainer's internals function
with its shardings, ``train_lib.InternalsReport``) on random tokens packed into documents of random
lengths, the state initialised as a run starts it. Each is timed by ``benchmarks/timing.py``
(the step with its state threaded through the calls, as the loop runs it). The interval is
``train.internals_every``, or ``train.eval_every`` where that is -1 (the default: a report at
each evaluation), or ``train.steps`` where both say "only at the end". Printed and written to
``--out``: the step and the report in ms, their first calls (compilation), and the share of
training time the reports take, per interval and over ``train.steps`` with the one compilation.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for benchmarks/

from benchmarks import timing
from kimi_k3 import internals, train_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3.config import run_spec
from kimi_k3.config_files import load_config

config_flags.DEFINE_config_file("config", "configs/small.py", "Config file.", lock_config=True)
flags.DEFINE_string("out", "", "Markdown file for the table (also printed).")
flags.DEFINE_bool("smoke", False, "CPU smoke run: configs/tiny.py's model on rows of 64 tokens "
                  "(overrides --config's model and data shapes); the figures mean nothing.")
flags.DEFINE_float("budget_s", 120.0, "Seconds each timing may take (at least one batch runs).",
                   lower_bound=1.0)
FLAGS = flags.FLAGS


def random_rows(rng: np.random.Generator, rows: int, T: int, vocab: int) -> dict:
    """{"tokens", "segment_ids"} [rows, T]: random ids in documents of 16 to T/2 tokens."""
    seg = np.zeros((rows, T), np.int32)
    for r in range(rows):
        t, doc = 0, 1
        while t < T:
            n = int(rng.integers(16, max(17, T // 2)))
            seg[r, t:t + n] = doc
            t, doc = t + n, doc + 1
    return {"tokens": rng.integers(0, vocab, (rows, T)).astype(np.int32), "segment_ids": seg}


def interval(tc) -> int:
    """Steps between reports (module docstring)."""
    if tc.internals_every > 0:
        return tc.internals_every
    return tc.eval_every or tc.steps


def measure(config) -> dict:
    spec = run_spec(config)
    mesh = mesh_lib.make_mesh(spec.mesh)
    setup = train_lib.build(config, mesh)
    B, T = spec.data.global_batch_size, spec.data.seq_len
    rng = np.random.default_rng(0)
    batch = train_lib.global_batch(random_rows(rng, B, T, spec.model.vocab_size),
                                   setup.batch_sharding, B)
    rows = internals.internals_rows(B, mesh_lib.data_parallel_size(mesh), B)
    held = train_lib.global_batch(random_rows(rng, rows, T, spec.model.vocab_size),
                                  setup.batch_sharding, rows)
    report = train_lib.InternalsReport.build(  # the trainer's own jitted function and shardings
        spec, setup, _Rows(held), workdir="", chief=False)
    state = {"now": setup.init_state()}
    with setup.context():
        look = timing.time_jax(report.fn, train_lib.model_part(state["now"]), report.batch,
                               budget_s=FLAGS.budget_s)

        def step():
            state["now"], metrics = setup.train_step(state["now"], batch)
            return metrics

        # Each call's state is donated to the next: wait for the newest one.
        train = timing.time_calls(step, sync=lambda _: jax.block_until_ready(state["now"]),
                                  budget_s=FLAGS.budget_s)
    every, steps = interval(spec.train), spec.train.steps
    per_interval = look.seconds / (every * train.seconds)
    whole = (look.first_call_s + steps // every * look.seconds) / (steps * train.seconds)
    return {"B": B, "T": T, "rows": rows, "every": every, "steps": steps, "train": train,
            "look": look, "per_interval": per_interval, "whole": whole}


class _Rows:
    """Stands in for the held-out ``PackedRows``: ``rows(range)`` of one host batch."""

    def __init__(self, batch):
        self.host = {k: np.asarray(v) for k, v in batch.items()}
        self.num_rows = len(self.host["tokens"])

    def rows(self, indices) -> dict:
        idx = np.asarray(list(indices))
        return {k: v[idx] for k, v in self.host.items()}


def table(r: dict, command: str) -> str:
    d = jax.devices()[0]
    lines = [
        f"Command: `python {command}`",
        "",
        f"Device: {jax.device_count()} x {d.device_kind}, JAX {jax.__version__}; batch "
        f"{r['B']} x {r['T']}, internals on {r['rows']} rows; a report every {r['every']} "
        f"steps of {r['steps']}",
        "",
        "| train step ms | internals ms | report / interval of steps | with its compilation, "
        "over the run | step first call s | internals first call s |",
        "|---|---|---|---|---|---|",
        f"| {r['train'].ms:.2f} | {r['look'].ms:.2f} | {100 * r['per_interval']:.3f}% | "
        f"{100 * r['whole']:.3f}% | {r['train'].first_call_s:.1f} | "
        f"{r['look'].first_call_s:.1f} |",
    ]
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if FLAGS.smoke:
        small = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py"))
        config.model = small.model
        config.model.kda.impl = "recurrent"
        config.data.seq_len, config.data.global_batch_size = 64, 8
        config.train.microbatch_size = 0
    result = measure(config)
    text = table(result, " ".join(shlex.quote(a) for a in sys.argv))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    app.run(main)
