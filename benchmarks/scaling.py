"""Scaling of ``train.py``'s loop over 1, 2, 4 and 8 devices of one host: tokens/s, MFU, scaling
efficiency and peak memory per device, as a Markdown table, a CSV and a PNG.

    # GPUs of this host (each count in its own process on the first n GPUs):
    python benchmarks/scaling.py --config=configs/1b.py --counts=1,2,4,8 --per_device_batch=4 \\
        --steps=30 --out_dir=runs/scaling

    # no accelerator: the same loop on n fake CPU devices (correctness, not speed)
    python benchmarks/scaling.py --config=configs/tiny.py --platform=cpu --counts=1,2,4,8 \\
        --steps=6 --out_dir=/tmp/scaling

Weak scaling: every device gets ``--per_device_batch`` rows of the config's ``seq_len``, so the
global batch grows with the count. ``--layout`` picks the mesh for n devices: ``fsdp`` (data 1 x
fsdp n: parameters and optimizer state sharded, the usual choice at 1B), ``data`` (data n,
replicated parameters), ``hybrid`` (data n/2 x fsdp 2) or ``config`` (the config's own mesh,
with -1 resolved against n). Any other field can be set with ``--config.<field>=value``.

Each count runs ``kimi_k3.train_lib.train`` in a fresh subprocess (the device count of a JAX
process is fixed when it starts) with checkpoints off and no held-out evaluation; the first step
(compilation) is never timed, and the figures are medians over the remaining log windows.
Efficiency = tokens/s on n devices / (n x tokens/s on 1 device). Counts larger than the devices
present are listed as not measured; a count that fails (out of memory, say) is listed with its
error and the others still run.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

# JAX and kimi_k3 are imported inside the function that runs in each device count's own
# child process: the device count of a JAX process is fixed when JAX is first imported.

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import timing  # noqa: E402  (no JAX: the parent never imports it)

LAYOUTS = ("fsdp", "data", "hybrid", "config")

config_flags.DEFINE_config_file("config", "configs/1b.py", "Config file.", lock_config=False)
flags.DEFINE_string("counts", "1,2,4,8", "Device counts to run, comma-separated.")
flags.DEFINE_integer("per_device_batch", 4, "Rows per device per step (weak scaling).")
flags.DEFINE_integer("steps", 30, "Optimizer steps per count (the first is not timed).")
flags.DEFINE_integer("log_every", 5, "Steps per timed window.")
flags.DEFINE_enum("layout", "fsdp", LAYOUTS, "Mesh for n devices (see the module docstring).")
flags.DEFINE_enum("platform", "auto", ("auto", "gpu", "cpu"),
                  "auto: the GPUs nvidia-smi lists, else fake CPU devices.")
flags.DEFINE_integer("timeout", 1200, "Seconds allowed per count (compilation included).")
flags.DEFINE_string("out_dir", None, "Folder for scaling.md / .csv / .png and per-count logs.")
flags.DEFINE_bool("reuse", False, "Keep the result of a count already in --out_dir "
                  "(run_<n>/result.json) instead of running it again.")
flags.DEFINE_integer("worker", 0, "Internal: run one count in this process.")
flags.mark_flags_as_required(["out_dir"])
FLAGS = flags.FLAGS


def mesh_for(layout: str, n: int, mesh_cfg) -> dict:
    """The (data, fsdp, tensor) sizes of ``layout`` on n devices."""
    if layout == "fsdp":
        return {"data": 1, "fsdp": n, "tensor": 1}
    if layout == "data":
        return {"data": n, "fsdp": 1, "tensor": 1}
    if layout == "hybrid":
        return {"data": max(n // 2, 1), "fsdp": 2 if n >= 2 else 1, "tensor": 1}
    return {a: mesh_cfg[a] for a in ("data", "fsdp", "tensor")}


def available_devices(platform: str) -> tuple[str, int]:
    """(platform, devices usable here) without starting JAX in this process: a parent that held
    the GPUs would starve its children."""
    if platform in ("auto", "gpu"):
        smi = shutil.which("nvidia-smi")
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout if smi else ""
        gpus = [line for line in listed.splitlines() if line.startswith("GPU ")]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and gpus:
            gpus = gpus[: len([x for x in visible.split(",") if x.strip()])]
        if gpus:
            return "gpu", len(gpus)
        if platform == "gpu":
            raise app.UsageError("--platform=gpu: nvidia-smi lists no GPU")
    return "cpu", 8  # fake host devices: as many as the CPU tests use


def child_env(platform: str, n: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if platform == "gpu":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(n)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:n])
    else:
        env["JAX_PLATFORMS"] = "cpu"
        flags_ = [f for f in env.get("XLA_FLAGS", "").split()
                  if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join([*flags_, f"--xla_force_host_platform_device_count={n}"])
    return env


# ---------------------------------------------------------------------------------------------
# One count, in its own process
# ---------------------------------------------------------------------------------------------


def run_worker(n: int) -> None:
    import jax

    from kimi_k3 import mesh as mesh_lib
    from kimi_k3 import metrics as metrics_lib
    from kimi_k3 import train_lib
    from kimi_k3.model import count_params, flops_per_token

    if jax.device_count() != n:
        raise RuntimeError(f"worker for {n} devices sees {jax.device_count()}")
    config = FLAGS.config
    config.mesh.update(mesh_for(FLAGS.layout, n, config.mesh))
    mesh_lib.mesh_shape(config.mesh, n)  # a layout that does not fit n fails here, named
    config.data.global_batch_size = FLAGS.per_device_batch * n
    config.data.eval_fraction = 0.0
    config.train.steps = FLAGS.steps
    config.train.log_every = FLAGS.log_every
    config.train.eval_every = 0
    config.train.progress_bar = False
    config.checkpoint.enabled = False
    workdir = Path(FLAGS.out_dir) / f"run_{n}"
    if workdir.exists():
        shutil.rmtree(workdir)
    with timing.stopwatch() as wall:
        train_lib.train(config, str(workdir))
    summary = metrics_lib.throughput_summary(workdir / "metrics.jsonl")
    summary.update(
        devices=n, device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
        mesh=mesh_for(FLAGS.layout, n, config.mesh), global_batch=config.data.global_batch_size,
        seq_len=config.data.seq_len, params=count_params(config.model),
        flops_per_token=flops_per_token(config.model, config.data.seq_len),
        peak_memory_bytes=metrics_lib.peak_memory_bytes(),
        wall_s=wall.seconds,
    )
    (workdir / "result.json").write_text(json.dumps(summary, indent=1))


# ---------------------------------------------------------------------------------------------
# The parent: one subprocess per count, then the table
# ---------------------------------------------------------------------------------------------


def run_count(n: int, platform: str, out_dir: Path) -> dict:
    result_file = out_dir / f"run_{n}" / "result.json"
    if FLAGS.reuse and result_file.exists():
        print(f"[scaling] {n} device(s): reusing {result_file}", flush=True)
        return json.loads(result_file.read_text())
    argv = [a for a in sys.argv[1:] if not a.startswith(("--worker", "--reuse"))]
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, f"--worker={n}"]
    log = out_dir / f"log_{n}.txt"
    print(f"[scaling] {n} device(s): running, log in {log}", flush=True)
    with timing.stopwatch() as wall:
        try:
            with open(log, "w") as f:
                proc = subprocess.run(cmd, env=child_env(platform, n), stdout=f,
                                      stderr=subprocess.STDOUT, timeout=FLAGS.timeout, cwd=ROOT)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {FLAGS.timeout} s"
    if rc == 0 and result_file.exists():
        r = json.loads(result_file.read_text())
        print(f"[scaling] {n} device(s): {r['tokens_per_s']:,.0f} tokens/s "
              f"({wall.seconds:.0f} s)", flush=True)
        return r
    lines = [x for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    errors = [x for x in lines if "Error" in x or "error" in x] or lines or [""]
    why = f"failed (exit {rc}): {errors[-1].strip()[:160]}"
    print(f"[scaling] {n} device(s): {why}", flush=True)
    return {"devices": n, "status": why}


def format_table(results: list[dict], command: str, platform: str) -> str:
    base = next((r for r in results if r.get("devices") == 1 and "tokens_per_s" in r), None)
    done = [r for r in results if "tokens_per_s" in r]
    head = done[0] if done else {}
    lines = [
        f"Command: `{command}`",
        "",
        f"Devices: {head.get('device_kind', platform)}; JAX {head.get('jax', '?')}; "
        f"{head.get('params', 0) / 1e6:.0f}M parameters, seq_len {head.get('seq_len', '?')}, "
        f"{FLAGS.per_device_batch} rows per device, {FLAGS.steps} steps (medians over windows "
        f"of {FLAGS.log_every}, the first step untimed).",
        "",
        "| devices | mesh (data x fsdp x tensor) | global batch | tokens/s | tokens/s per device "
        "| s/step | MFU | scaling efficiency | peak memory / device |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n = r["devices"]
        if "tokens_per_s" not in r:
            lines.append(f"| {n} | — | — | {r['status']} | | | | | |")
            continue
        m = r["mesh"]
        eff = (f"{r['tokens_per_s'] / (n * base['tokens_per_s']):.2f}" if base else
               "— (1 device not measured)")
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = ("n/a" if r["peak_memory_bytes"] is None
               else f"{r['peak_memory_bytes'] / 2**30:.1f} GiB")
        lines.append(
            f"| {n} | {m['data']} x {m['fsdp']} x {m['tensor']} | {r['global_batch']} | "
            f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / n:,.0f} | {r['step_time_s']:.3f} | "
            f"{mfu} | {eff} | {mem} |")
    return "\n".join(lines) + "\n"


def write_outputs(results: list[dict], out_dir: Path, command: str, platform: str) -> str:
    from kimi_k3.plots import line_plot

    table = format_table(results, command, platform)
    (out_dir / "scaling.md").write_text(table)
    fields = ["devices", "status", "tokens_per_s", "step_time_s", "mfu", "global_batch",
              "peak_memory_bytes", "final_loss", "wall_s"]
    with open(out_dir / "scaling.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow({"status": "ok", **r} if "tokens_per_s" in r else r)
    done = [r for r in results if "tokens_per_s" in r]
    if done:
        ns = [r["devices"] for r in done]
        series = {"measured": (ns, [r["tokens_per_s"] for r in done])}
        base = next((r for r in done if r["devices"] == 1), None)
        if base:
            series["linear from 1 device"] = (ns, [n * base["tokens_per_s"] for n in ns])
        line_plot(out_dir / "scaling.png", series, xlabel="devices", ylabel="tokens/s",
                  title=f"Training throughput ({done[0]['device_kind']})", logx=True, logy=True)
    return table


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.worker:
        run_worker(FLAGS.worker)
        return
    try:
        counts = sorted({int(c) for c in FLAGS.counts.split(",") if c.strip()})
    except ValueError:
        raise app.UsageError(f"--counts: expected integers like 1,2,4,8, got {FLAGS.counts!r}") from None
    if not counts or counts[0] < 1:
        raise app.UsageError(f"--counts: expected positive integers, got {FLAGS.counts!r}")
    if FLAGS.per_device_batch < 1 or FLAGS.steps <= FLAGS.log_every:
        raise app.UsageError(
            f"--per_device_batch must be >= 1 (got {FLAGS.per_device_batch}) and --steps > "
            f"--log_every (got {FLAGS.steps} and {FLAGS.log_every}): nothing would be timed")
    platform, have = available_devices(FLAGS.platform)
    out_dir = Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/scaling.py " + " ".join(shlex.quote(a) for a in argv[1:]
                                                         or sys.argv[1:])
    print(f"[scaling] {platform}: {have} device(s) here; counts {counts}", flush=True)
    results = []
    for n in counts:
        if n > have:
            results.append({"devices": n, "status": f"not measured: {have} {platform} device(s) "
                                                    "here"})
            continue
        results.append(run_count(n, platform, out_dir))
        write_outputs(results, out_dir, command, platform)  # a run cut short keeps its rows
    print(write_outputs(results, out_dir, command, platform), flush=True)


if __name__ == "__main__":
    app.run(main)
