r"""Memory model of context parallelism: the longest training sequence per device, with and
without the "context" mesh axis, from XLA's compiled memory estimates on fake CPU devices; and
the communication the context axis adds per training step.

    python benchmarks/context_parallel_memory.py --config=configs/1b.py --devices=8 \
        --tokens_per_device=1024,2048 --out_dir=benchmarks/results/context_parallel

Two layouts of ``--devices`` n devices, both with parameters and optimizer state sharded n ways:

- ``fsdp``: data 1 x fsdp n, one row per device, each device holds whole sequences of T tokens;
- ``context``: context n (parameters sharded over it too: the rule ``embed -> (fsdp,
  context)``), one row per step whose T = n x (tokens per device) tokens are split over the
  devices.

For each layout and each ``--tokens_per_device`` value, the config's whole training step
(forward, backward, optimizer; the config's remat) is compiled for the fake CPU devices, and
XLA's estimate of one device's memory is read (``compiled.memory_analysis()``: arguments +
outputs + temporaries - aliased). Memory is affine in the tokens per device at fixed shapes
(activations grow linearly, the training state does not), so two points fit
``bytes = state + per_token x tokens``, and the longest sequence that fits ``--memory_gib`` (x
``--headroom``) follows: tokens per device for ``fsdp``, n times that for ``context``. These are
CPU compilations (KDA on the plain-JAX chunked form, MLA on the blockwise attention): the
kernels a GPU runs keep different residuals, so the figures are a model, not a measurement of
a GPU's peak.

Communication per step (per device, bytes), what the context axis adds (both layouts gather
the parameters and reduce-scatter the gradients alike):

- KDA layer: the all-gather of every shard's transition [A | B] (rows x HV x K x (K + V) float32
  from each of the n - 1 others), and its transpose in the backward (a reduce-scatter of the
  same size);
- ShortConv (3 per KDA layer): the last W - 1 inputs (q, k: H x K; v: HV x V channels) to the
  next shard, forward and backward;
- MLA layer: the all-gather of the latents, (n - 1) / n x T x (kv_lora_rank + shared_head_dim)
  numbers in the compute dtype per row, and its reduce-scatter in the backward; a
  rematerialised forward gathers again.

Writes ``context_parallel_memory.md`` and ``.csv`` into ``--out_dir``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/1b.py")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices n")
    p.add_argument("--tokens_per_device", default="1024,2048",
                   help="two or more token counts per device to compile at")
    p.add_argument("--memory_gib", type=float, default=141.0, help="device memory (H200: 141)")
    p.add_argument("--headroom", type=float, default=0.85, help="share of it a step may use")
    p.add_argument("--layouts", default="fsdp,context")
    p.add_argument("--out_dir", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    import jax
    import jax.numpy as jnp

    from benchmarks import timing
    from kimi_k3 import mesh as mesh_lib
    from kimi_k3 import train_lib
    from kimi_k3.config import DEFAULT_RULES, model_spec
    from kimi_k3.config_files import load_config

    n = args.devices
    counts = [int(x) for x in args.tokens_per_device.split(",")]
    name = Path(args.config).name
    path = args.config if Path(args.config).is_file() else str(ROOT / args.config)
    rows, fits = [], {}
    for layout in args.layouts.split(","):
        points = []
        for tokens in counts:
            config = load_config(path)
            config.model.kda.impl = "xla"  # CPU: the Pallas kernel would run interpreted
            config.checkpoint.enabled = False
            if layout == "fsdp":
                config.mesh.data, config.mesh.fsdp, config.mesh.context = 1, n, 1
                B, T = n, tokens
            else:
                config.mesh.data, config.mesh.fsdp, config.mesh.context = 1, 1, n
                config.mesh.axis_rules = tuple(
                    (k, ("fsdp", "context")) if k == "embed" else (k, v) for k, v in DEFAULT_RULES)
                B, T = 1, n * tokens
            config.data.seq_len, config.data.global_batch_size = T, B
            config.train.microbatch_size = B
            mesh = mesh_lib.make_mesh(config.mesh)
            setup = train_lib.build(config, mesh)
            batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=setup.batch_sharding)
                     for k in ("tokens", "segment_ids")}
            with timing.stopwatch() as compiling, setup.context():
                compiled = setup.train_step.lower(setup.abstract_state, batch).compile()
            m = compiled.memory_analysis()
            total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                     - m.alias_size_in_bytes)
            points.append((tokens, total))
            rows.append({"layout": layout, "tokens_per_device": tokens, "seq_len": T, "rows": B,
                         "arguments": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes,
                         "outputs": m.output_size_in_bytes, "aliased": m.alias_size_in_bytes,
                         "total": total, "compile_s": round(compiling.seconds, 1)})
            print(rows[-1], flush=True)
        (t1, m1), (t2, m2) = points[0], points[-1]
        per_token = (m2 - m1) / (t2 - t1)
        state = m1 - per_token * t1
        budget = args.memory_gib * 2**30 * args.headroom
        longest = int((budget - state) // per_token)
        fits[layout] = {"state": state, "per_token": per_token, "tokens_per_device": longest,
                        "seq_len": longest * (n if layout == "context" else 1)}

    spec = model_spec(load_config(path).model)
    table = render(args, name, n, rows, fits, comm_model(spec, n, fits.get("context")))
    print(table)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "context_parallel_memory.md").write_text(table)
        with open(out / "context_parallel_memory.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def comm_model(spec, n: int, fit) -> dict | None:
    """Bytes per device per step that the context axis adds, at the longest fitting length."""
    if fit is None:
        return None
    T = fit["seq_len"]
    k, m = spec.kda, spec.mla
    H, HV, K = k.num_heads, k.num_v_heads, k.head_dim
    act = 2 if spec.dtype in ("bfloat16", "float16") else 4
    n_kda, n_mla = spec.pattern.count("K"), spec.pattern.count("M")
    kda_state = 2 * (n - 1) * HV * K * (K + K) * 4  # all-gather + its reduce-scatter, 1 row
    conv = 2 * (k.conv_width - 1) * (2 * H * K + HV * K) * act
    latent = 2 * (n - 1) / n * T * (m.kv_lora_rank + m.shared_head_dim) * act
    return {"seq_len": T, "kda": n_kda * kda_state, "conv": n_kda * conv,
            "mla": n_mla * latent, "n_kda": n_kda, "n_mla": n_mla}


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def render(args, name, n, rows, fits, comm) -> str:
    lines = [f"Config `configs/{name}`, {n} fake CPU devices, memory budget "
             f"{args.memory_gib:g} GiB x {args.headroom:g}.", "",
             "| layout | tokens / device | seq_len | rows | arguments (GiB) | temporaries (GiB) "
             "| total / device (GiB) | compile (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['tokens_per_device']:,} | {r['seq_len']:,} | "
                     f"{r['rows']} | {gib(r['arguments'])} | {gib(r['temp'])} | "
                     f"{gib(r['total'])} | {r['compile_s']} |")
    lines += ["", "| layout | state / device (GiB) | activations per token / device (MiB) | "
              "longest tokens / device | longest training sequence |", "|---|---|---|---|---|"]
    for layout, f in fits.items():
        lines.append(f"| {layout} | {gib(f['state'])} | {f['per_token'] / 2**20:.3f} | "
                     f"{f['tokens_per_device']:,} | {f['seq_len']:,} |")
    if comm:
        total = comm["kda"] + comm["conv"] + comm["mla"]
        lines += ["", f"Communication the context axis adds per step and device at T = "
                  f"{comm['seq_len']:,} (forward + backward, one pass; a rematerialised forward "
                  f"repeats the MLA gather):", "",
                  "| what | bytes / device / step |", "|---|---|",
                  f"| KDA transitions [A \\| B], {comm['n_kda']} layers | "
                  f"{comm['kda'] / 2**20:.1f} MiB |",
                  f"| ShortConv tails, {3 * comm['n_kda']} convolutions | "
                  f"{comm['conv'] / 2**10:.1f} KiB |",
                  f"| MLA latents, {comm['n_mla']} layers | {comm['mla'] / 2**30:.2f} GiB |",
                  f"| total | {total / 2**30:.2f} GiB |"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
