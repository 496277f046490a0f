"""Training throughput: tokens/s and MFU of ``train.py``'s loop for a config, as a Markdown table.

    python benchmarks/train_throughput.py --config=configs/small.py --workdir=/tmp/bench_small \\
        --config.train.steps=300 --out=benchmarks/train_throughput_small.md

Runs ``kimi_k3.train_lib.train`` (the real loop: data pipeline, sharded step, metrics) without
held-out evaluation and without checkpoints, on a fresh ``--workdir``. The first
``--config.train.log_every`` steps (compilation) are left out; the table gives the median over
the remaining log windows of tokens/s, seconds per step and MFU (model FLOPs per token from
``kimi_k3.model.flops_per_token`` against the device's dense bf16 peak), with the command, the
device, the shapes and the JAX version, and is written to ``--out`` and printed.
"""

from __future__ import annotations

import os
import shlex
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from kimi_k3 import mesh as mesh_lib
from kimi_k3 import metrics as metrics_lib
from kimi_k3 import train_lib
from kimi_k3.model import count_params, flops_per_token

config_flags.DEFINE_config_file("config", "configs/small.py", "Config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "A fresh run folder (an existing checkpoint would resume).")
flags.DEFINE_string("out", "", "Markdown file for the table; default <workdir>/throughput.md.")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS


def summarise(config, workdir: str, command: str) -> str:
    """The Markdown table from ``<workdir>/metrics.jsonl``."""
    summary = metrics_lib.throughput_summary(os.path.join(workdir, "metrics.jsonl"))
    mfu = summary["mfu"]
    mfu = f"{100 * mfu:.1f}%" if mfu is not None else "n/a (unknown peak)"
    peak = metrics_lib.peak_memory_bytes()
    peak = "n/a" if peak is None else f"{peak / 2**30:.1f} GiB"
    dc, m = config.data, config.model
    n = jax.device_count()
    lines = [
        f"Command: `python {command}`",
        "",
        f"Device: {n} x {jax.devices()[0].device_kind} ({jax.process_count()} process(es)), "
        f"JAX {jax.__version__}; mesh data={config.mesh.data}, fsdp={config.mesh.fsdp}, "
        f"tensor={config.mesh.tensor}; compute {m.dtype}, parameters {m.param_dtype}",
        "",
        "| config | params | batch x seq | FLOPs/token | steps timed | tokens/s | s/step | MFU "
        "| peak memory / device | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {os.path.basename(str(FLAGS['config'].config_filename))} | "
        f"{count_params(m) / 1e6:.1f}M | {dc.global_batch_size} x {dc.seq_len} | "
        f"{flops_per_token(m, dc.seq_len):.3g} | {summary['windows']} windows of "
        f"{config.train.log_every} | {summary['tokens_per_s']:,.0f} | "
        f"{summary['step_time_s']:.3f} | {mfu} | {peak} | {summary['final_loss']:.3f} |",
    ]
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    mesh_lib.initialize_distributed()
    config = FLAGS.config
    config.data.eval_fraction = 0.0  # no held-out split: nothing but training is timed
    config.train.eval_every = 0
    config.train.progress_bar = False
    config.checkpoint.enabled = False  # saving the state is not what is measured
    if os.path.exists(os.path.join(FLAGS.workdir, "metrics.jsonl")):
        raise app.UsageError(f"--workdir {FLAGS.workdir!r} already holds a run; use a fresh one")
    train_lib.train(config, FLAGS.workdir)
    if jax.process_index() == 0:
        table = summarise(config, FLAGS.workdir, " ".join(shlex.quote(a) for a in sys.argv))
        out = FLAGS.out or os.path.join(FLAGS.workdir, "throughput.md")
        with open(out, "w") as f:
            f.write(table)
        print(table)


if __name__ == "__main__":
    app.run(main)
