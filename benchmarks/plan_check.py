r"""The planner against the card: estimated and measured peak memory of real training steps.

    python benchmarks/plan_check.py --cases=small,1b,moe_1b --out=benchmarks/results/plan_check.md
    python benchmarks/plan_check.py --cases=tiny --steps=2     # on a CPU: XLA's compiled figure

Each case runs in its own process (so each peak is its own): the config's train step is built
and run for ``--steps`` steps on random tokens, and the allocator's high-water mark
(``metrics.peak_memory_bytes``) is compared with ``kimi_k3.plan.memory_plan`` for the same
config, mesh and micro-batch, with the card's kernels. On a CPU, where the allocator keeps no
statistics, the measured figure is XLA's compiled memory analysis (arguments + outputs -
aliased + temporaries), and the plan's runtime reserve is left out of the estimate. A case the
planner says cannot fit is not run; its row says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

CASES = {
    # name: (config, overrides)
    "tiny": ("configs/tiny.py", {}),
    "small": ("configs/small.py", {}),
    "1b": ("configs/1b.py", {"train.microbatch_size": 2}),
    "moe_1b": ("configs/moe_1b.py", {"train.microbatch_size": 1}),
}

flags.DEFINE_list("cases", ["small", "1b", "moe_1b"], f"Cases, of {sorted(CASES)}.")
flags.DEFINE_integer("steps", 3, "Train steps per case.", lower_bound=1)
flags.DEFINE_string("out", "", "Markdown file for the table (default: print only).")
flags.DEFINE_string("one", "", "Internal: run one case in this process and print its JSON.")
flags.DEFINE_string("time_auto", "", "A case whose automatic micro-batch to time both ways: "
                    "XLA's compiled estimate (train_lib.choose_microbatch) and the planner's "
                    "(train_lib.plan_microbatch).")


def run_one(name: str, steps: int) -> dict:
    import jax
    import numpy as np

    from kimi_k3 import mesh as mesh_lib
    from kimi_k3 import metrics, plan, train_lib
    from kimi_k3.config_files import load_config
    from kimi_k3.runtime import device_memory_bytes
    from pallas_kernels import device as device_lib

    path, overrides = CASES[name]
    config = load_config(path)
    with config.unlocked():
        for dotted, value in overrides.items():
            section, leaf = dotted.rsplit(".", 1)
            node = config
            for part in section.split("."):
                node = node[part]
            with node.unlocked():
                node[leaf] = value
    kind = device_lib.probe().kind.lower()
    card = next((k for k in ("h200", "h100", "a100", "b200") if k in kind), "cpu")
    device = plan.DEVICES[card]
    mesh = mesh_lib.make_mesh(config.mesh)
    sizes = dict(mesh.shape)
    limit = device_memory_bytes()
    row = {"case": name, "config": path, "overrides": overrides, "device": kind}
    micro = int(config.train.microbatch_size)
    estimate = plan.memory_plan(config, sizes, micro, device, limit) if micro else None
    if estimate is not None and estimate.fits is False:
        row.update(estimate_gib=estimate.total / 2**30, measured_gib=None,
                   note="the planner says it does not fit; not run")
        return row
    t0 = time.perf_counter()
    setup = train_lib.build(config, mesh)
    if estimate is None:
        estimate = plan.memory_plan(config, sizes, setup.microbatch_size, device, limit)
    B, T = int(config.data.global_batch_size), int(config.data.seq_len)
    rng = np.random.default_rng(0)
    batch = {"tokens": jax.device_put(rng.integers(0, config.model.vocab_size, (B, T),
                                                   dtype=np.int32), setup.batch_sharding),
             "segment_ids": jax.device_put(np.ones((B, T), np.int32), setup.batch_sharding)}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                for k, v in batch.items()}
    with setup.context():
        compiled = setup.train_step.lower(setup.abstract_state, abstract).compile()
        ma = compiled.memory_analysis()
        xla = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
               + ma.temp_size_in_bytes)
        if card == "cpu":  # no allocator statistics: XLA's own figure is the measurement
            measured, est = xla, estimate.total - plan.RESERVE_BYTES
        else:
            state = setup.init_state()
            for _ in range(steps):
                state, m = compiled(state, batch)
            jax.block_until_ready(m)
            measured, est = metrics.peak_memory_bytes(), estimate.total
    row["xla_gib"] = xla / 2**30
    row.update(microbatch=setup.microbatch_size, mesh={k: v for k, v in sizes.items() if v > 1},
               estimate_gib=est / 2**30, measured_gib=measured / 2**30,
               ratio=est / measured, seconds=time.perf_counter() - t0,
               rows={r.name: r.bytes / 2**30 for r in estimate.rows})
    return row


def time_auto(name: str) -> dict:
    """Seconds to choose the automatic micro-batch of ``name``'s config, both ways, and what
    each chose."""
    from kimi_k3 import mesh as mesh_lib
    from kimi_k3 import train_lib
    from kimi_k3.config import run_spec
    from kimi_k3.config_files import load_config
    from kimi_k3.train_state import state_layout

    config = load_config(CASES[name][0])
    mesh = mesh_lib.make_mesh(config.mesh)
    spec = run_spec(config)
    layout = state_layout(spec, mesh)
    B, T = spec.data.global_batch_size, spec.data.seq_len
    t0 = time.perf_counter()
    with layout.context():
        xla = train_lib.choose_microbatch(B, T, mesh, layout.graphdef, layout.abstract_rest,
                                          layout.abstract_state, mesh_lib.batch_sharding(mesh),
                                          layout.rules)
    t1 = time.perf_counter()
    planned = train_lib.plan_microbatch(config, mesh, check=False)
    t2 = time.perf_counter()
    return {"case": name, "xla_estimate_s": t1 - t0, "xla_microbatch": xla,
            "plan_s": t2 - t1, "plan_microbatch": planned}


def table(rows: list[dict]) -> str:
    lines = ["| case | micro-batch | mesh | estimate GiB | measured peak GiB | XLA's compiled "
             "figure GiB | estimate / measured |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("measured_gib") is None:
            lines.append(f"| {r['case']} | - | - | {r['estimate_gib']:.1f} | - | - | "
                         f"{r.get('note', r.get('error', ''))} |")
            continue
        lines.append(f"| {r['case']} | {r['microbatch']} | {r['mesh'] or '1 device'} | "
                     f"{r['estimate_gib']:.2f} | {r['measured_gib']:.2f} | "
                     f"{r.get('xla_gib', float('nan')):.2f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv):
    del argv
    F = flags.FLAGS
    if F.time_auto:
        print("TIME_AUTO " + json.dumps(time_auto(F.time_auto)), flush=True)
        return
    if F.one:
        print("PLAN_CHECK " + json.dumps(run_one(F.one, F.steps)), flush=True)
        return
    unknown = [c for c in F.cases if c not in CASES]
    if unknown:
        raise app.UsageError(f"--cases: {unknown} not in {sorted(CASES)}")
    rows = []
    for case in F.cases:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), f"--one={case}",
                            f"--steps={F.steps}"], capture_output=True, text=True)
        found = [ln for ln in p.stdout.splitlines() if ln.startswith("PLAN_CHECK ")]
        if found:
            rows.append(json.loads(found[-1][len("PLAN_CHECK "):]))
        else:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"case": case, "estimate_gib": float("nan"), "measured_gib": None,
                         "error": tail[:200]})
        print(json.dumps(rows[-1]), flush=True)
    text = table(rows)
    print(text)
    if F.out:
        with open(F.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    app.run(main)
