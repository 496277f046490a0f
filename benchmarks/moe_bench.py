r"""The mixture of experts on one device: its FFN layer's grouped matmul against a dense one-hot
einsum of the same layer, and the ~1B-active MoE's training step against the dense 1B.

    python benchmarks/moe_bench.py --out_dir=runs/moe_bench            # one GPU: both modes
    python benchmarks/moe_bench.py --mode=layer --batches=1,8 --out_dir=runs/moe_layer
    python benchmarks/moe_bench.py --mode=train --batch=8 --seq=4096 --steps=10 \
        --train_runs=dense,moe,moe_cudnn --out_dir=runs/moe_train
    python benchmarks/moe_bench.py --smoke --out_dir=/tmp/moe_smoke      # CPU, tiny, seconds

The first (both modes, the defaults: configs/moe_1b.py against configs/1b.py, the layer at
1 x 4096 and 8 x 4096 tokens, training at 8 x 4096 for 10 timed steps) ends within
``--budget_s`` (default 520 s) and a few seconds of tables.

Layer (``--mode=layer``): the MoE FFN of ``--moe_config`` (its d_model, experts, top-k, expert
width, shared expert, compute and parameter dtypes) on B x ``--seq`` tokens of random input for
each B of ``--batches``; forward + backward (the gradients of sum(y * R) for x and every
parameter), jitted, the median of ``--reps`` timed runs after a warm-up run, each waited for.

    ragged        the layer dropless with ``moe.expert_matmul="ragged"``: assignments sorted by
                  expert, two grouped matmuls (``jax.lax.ragged_dot``)
    onehot        the same output from the same parameters, densely: every token through every
                  expert, weighted by the layer's own routing weights scattered to [B, T, E]
                  (zero outside the token's top-k), plus the shared expert (:func:`onehot_moe`)
    dense         the layer's own dense form, ``moe.expert_matmul="dense"`` (what "auto" picks
                  on GPU): the one-hot computation inside the layer
    capacity      the layer's capacity mode (``moe.capacity_factor = --capacity_factor``): each
                  expert on a fixed buffer of C = ceil(c N k / E) rows, the rest dropped
    dense_equiv   a dense SwiGLU of width k F + shared: the same matmul FLOPs without routing
    mosaic_gpu    the same sorted rows through ``moe.expert_matmul="mosaic_gpu"``: Hopper
                  grouped-matmul kernels (Pallas Mosaic GPU; "auto" on sm_90; GPU only)
    ragged_cudnn  "ragged" with XLA_FLAGS asking for XLA's cuDNN ragged-dot fusion (GPU only)

Useful FLOPs are the active ones, 6 N (D E + 3 D (k F + S)) for N tokens (router, k chosen
experts, shared expert of width S: the mixture's term of ``model.flops_per_token``; dense_equiv
without the router). Also reported: XLA's FLOP count of the compiled program over the useful
FLOPs (XLA's default GPU lowering of ragged_dot multiplies every row by every expert's
weights, so it shows there), the program's scratch memory from XLA's memory analysis, the
device's peak memory, and whether a ragged-dot survived into the compiled program. Before
timing, "ragged" and "onehot" are checked against each other on ``--check_batch`` x
``--check_seq`` tokens (outputs and gradients; float32 with the matmuls at full precision, and
in bfloat16 for information): the largest difference over the largest value.

Train (``--mode=train``): benchmarks/train_throughput.py (the real loop of train.py) in a
subprocess per config, ``--dense_config`` then ``--moe_config`` at the same ``--batch`` x
``--seq``, ``--steps`` timed steps after the first (each step its own report, so the median is
per step), micro-batches ``--microbatch`` (0: the trainer's automatic choice); tokens/s, s/step,
MFU from ``model.flops_per_token`` (a mixture's active FLOPs) against the device's dense bf16
peak, parameters and ``count_params(active=True)``, peak memory. The MoE run uses its config's
``expert_matmul``; ``moe_blocked``, ``moe_mosaic`` and ``moe_dense`` in ``--train_runs`` add it
with ``expert_matmul`` "blocked", "mosaic_gpu" and "dense", ``moe_cudnn`` with "ragged" and the
cuDNN ragged-dot flag.

Every measurement runs in a subprocess of its own (``--jobs`` at a time; ``--isolate``: each
layer variant alone), inside ``--budget_s`` seconds overall, in this order: the ragged, onehot
and capacity rows, the training runs, then dense_equiv and ragged_cudnn. One that fails (out of
memory, a crash, its time limit) gives a row saying so and the rest go on; a training run
stopped at its limit still reports the steps it timed. The subprocesses may take
``--mem_fraction`` of the GPU's memory (JAX's default is 0.75).
``--out_dir`` receives moe_bench.md (also printed), moe_bench.csv and moe_bench.log (every
subprocess's output).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The repository root, for ``configs`` (no installed package) and this checkout's ``kimi_k3``.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import timing
from kimi_k3 import metrics as metrics_lib
from kimi_k3.config import ModelSpec, model_spec
from kimi_k3.config_files import load_config as _load_config
from kimi_k3.layers.mlp import SwiGLU
from kimi_k3.layers.moe import MoE, route
from kimi_k3.model import count_params, flops_per_token
from pallas_kernels import device

REPO = Path(__file__).resolve().parents[1]


def load_config(spec: str):
    """A config file ``path[:arg]``, the path taken from the working folder, else from the
    repository (the defaults name ``configs/...``)."""
    path, sep, arg = spec.partition(":")
    if not Path(path).is_file() and (REPO / path).is_file():
        path = str(REPO / path)
    return _load_config(path + sep + arg)

LAYER_VARIANTS = ("mosaic_gpu", "ragged", "onehot", "dense", "capacity", "dense_equiv",
                  "ragged_cudnn")
EXTRA_VARIANTS = ("dense_equiv", "ragged_cudnn")  # measured after the training runs
TRAIN_RUNS = ("dense", "moe", "moe_blocked", "moe_mosaic", "moe_dense", "moe_cudnn")
# the MoE run with its config's expert_matmul replaced
TRAIN_MATMULS = {"moe_blocked": "blocked", "moe_mosaic": "mosaic_gpu", "moe_dense": "dense",
                 "moe_cudnn": "ragged"}
# Asks XLA to hand ragged dots to cuDNN instead of rewriting them as dense dots over every
# group (the flag exists in jaxlib 0.10.2; where cuDNN is too old, XLA falls back silently, and
# the "XLA FLOPs / useful" column shows it).
CUDNN_RAGGED_DOT_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
# --smoke: tiny shapes, and XLA's CPU compiler at its quickest (nothing of it is timed).
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
SMOKE_TRAIN_OVERRIDES = ("--config.model.num_layers=1", "--config.model.moe.first_k_dense=0",
                         "--config.model.kda_per_mla=0", "--config.model.final_mla=False",
                         "--config.model.attn_res=none", "--config.model.d_model=64")
AGREE_TOL = 1e-4  # float32 "ragged" vs "onehot": largest difference over largest value
MIN_START_S = 20.0  # a measurement is not started with less of --budget_s left


# ---------------------------------------------------------------------------------------------
# The dense one-hot formulation and the counts
# ---------------------------------------------------------------------------------------------


def onehot_moe(layer: MoE, x_BxTxD: jax.Array) -> jax.Array:
    """``layer``'s output computed densely from its own parameters and routing:

        (_, chosen, w) = route(x)                                  the layer's router, as is
        g[b, t, e] = sum_j w[b, t, j] [chosen[b, t, j] = e]        [B, T, E], zero off the top-k
        y = sum_e g_e SwiGLU_e(x) + SwiGLU_shared(x)

    as two einsums over all E experts (E / k times the routed matmul FLOPs of the layer). The
    weights g scale the hidden activations before the output projection, so the experts'
    outputs [B, T, E, D] never exist. Precision as the layer's: matmuls in and out of its
    compute dtype (as its grouped matmuls), the weights applied in float32.
    """
    spec = layer.spec
    x_BxTxD = x_BxTxD.astype(layer.dtype)
    _, idx_BxTxK, w_BxTxK = route(x_BxTxD, layer.router.kernel[...], layer.bias[...], spec,
                                  layer.dtype)
    onehot_BxTxKxE = jax.nn.one_hot(idx_BxTxK, spec.num_experts, dtype=jnp.float32)
    g_BxTxE = jnp.sum(onehot_BxTxKxE * w_BxTxK[..., None], axis=-2)  # elementwise: exact
    wi, wo = (w[...].astype(x_BxTxD.dtype) for w in (layer.experts.wi, layer.experts.wo))
    h_BxTxEx2xF = jnp.einsum("btd,edgf->btegf", x_BxTxD, wi)
    a_BxTxExF = jax.nn.silu(h_BxTxEx2xF[..., 0, :]) * h_BxTxEx2xF[..., 1, :]
    a_BxTxExF = (a_BxTxExF.astype(jnp.float32) * g_BxTxE[..., None]).astype(x_BxTxD.dtype)
    y_BxTxD = jnp.einsum("btef,efd->btd", a_BxTxExF, wo)
    if layer.shared is not None:
        y_BxTxD = y_BxTxD + layer.shared(x_BxTxD)
    return y_BxTxD


def useful_flops(variant: str, spec: ModelSpec, tokens: int) -> float:
    """Forward + backward FLOPs of the layer's active matmuls for ``tokens`` tokens: 3 x 2 x the
    weights one token multiplies (router D E, k experts and the shared expert 3 D (k F + S); the
    dense_equiv SwiGLU has no router)."""
    D, e = spec.d_model, spec.moe
    weights = 3 * D * (e.top_k * e.expert_dim + e.shared_dim)
    if variant != "dense_equiv":
        weights += D * e.num_experts
    return 6.0 * tokens * weights


def _rel_max(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(a)), 1e-30))


# ---------------------------------------------------------------------------------------------
# Worker: the layer, in a subprocess of its own
# ---------------------------------------------------------------------------------------------


def _both(moe, d_model: int, dtype, x_BxTxD, r_BxTxD, seed: int):
    """Outputs and gradient leaves of sum(y * R) (parameters, then x) of the layer and of
    :func:`onehot_moe` on the same layer, in one jitted program (the two routings are the same
    computation on the same values)."""
    layer = MoE(d_model, moe, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=jnp.float32)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def run(params, x_BxTxD, r_BxTxD):
        out = []
        for fn in (lambda m, x: m(x), onehot_moe):
            f = lambda p, x, fn=fn: fn(nnx.merge(graphdef, p, rest, copy=True), x).astype(
                jnp.float32)
            y, vjp = jax.vjp(f, params, x_BxTxD)
            out.append((y, jax.tree.leaves(vjp(r_BxTxD))))
        return out

    return run(params, x_BxTxD, r_BxTxD)


def check_agreement(spec: ModelSpec, B: int, T: int, bf16: bool = True, seed: int = 0) -> dict:
    """"ragged" (the layer) against "onehot" on B x T random tokens: the largest difference of
    the outputs, and of the gradients of sum(y * R) (x and every parameter, the worst leaf),
    each over the largest value; float32 with every matmul at full precision, then (``bf16``)
    in bfloat16, for information."""
    D = spec.d_model
    moe = dataclasses.replace(spec.moe, capacity_factor=0.0, expert_matmul="ragged")
    kx, kr = jax.random.split(jax.random.key(seed + 1))
    x_BxTxD = jax.random.normal(kx, (B, T, D), jnp.float32)
    r_BxTxD = jax.random.normal(kr, (B, T, D), jnp.float32)
    out = {"section": "check", "name": "ragged vs onehot", "batch": B, "seq": T}
    for tag, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16))[:2 if bf16 else 1]:
        full = tag == "f32"  # bfloat16 at the default precision, as it trains
        with jax.default_matmul_precision("highest") if full else contextlib.nullcontext():
            (ya, ga), (yb, gb) = _both(moe, D, dtype, x_BxTxD, r_BxTxD, seed)
        out[f"out_rel_{tag}"] = _rel_max(ya, yb)
        out[f"grad_rel_{tag}"] = max(_rel_max(a, b) for a, b in zip(ga, gb, strict=True))
    agree = out["out_rel_f32"] < AGREE_TOL and out["grad_rel_f32"] < AGREE_TOL
    out["status"] = "agree" if agree else "DIFFER"
    return out


def _module(variant: str, spec: ModelSpec, capacity_factor: float, seed: int):
    D, e = spec.d_model, spec.moe
    kw = dict(rngs=nnx.Rngs(seed), dtype=spec.compute_dtype, param_dtype=spec.storage_dtype)
    if variant == "dense_equiv":
        return SwiGLU(D, e.top_k * e.expert_dim + e.shared_dim, **kw)
    cf = capacity_factor if variant == "capacity" else 0.0
    matmul = variant if variant in ("dense", "mosaic_gpu") else "ragged"  # the layer's own forms
    return MoE(D, dataclasses.replace(e, capacity_factor=cf, expert_matmul=matmul), **kw)


def _analysis(compiled) -> tuple[float | None, float | None, str]:
    """(XLA's FLOPs, scratch bytes, HLO text) of a compiled program; None / "" for whatever
    this backend does not say."""
    flops = temp = None
    text = ""
    try:
        cost = compiled.cost_analysis()
        if isinstance(cost, list | tuple):  # one dict per program in some JAX versions
            cost = cost[0] if cost else None
        flops = float((cost or {}).get("flops") or 0) or None
    except Exception:  # an analysis this backend lacks: the column says n/a
        pass
    try:
        temp = float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:
        pass
    try:
        text = compiled.as_text() or ""
    except Exception:
        pass
    return flops, temp, text


def time_layer(variant: str, spec: ModelSpec, B: int, T: int, reps: int,
               capacity_factor: float, seed: int = 0) -> dict:
    """Forward + backward of one variant on B x T tokens: median ms over ``reps`` runs after a
    warm-up run, each waited for (benchmarks/timing.py, one call per batch: the layer's
    gradients at its largest batches are GBs), with XLA's FLOPs and scratch memory of the
    compiled program and the device's peak memory."""
    module = _module(variant, spec, capacity_factor, seed)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    kx, kr = jax.random.split(jax.random.key(seed + 1))
    x_BxTxD = jax.random.normal(kx, (B, T, spec.d_model), spec.compute_dtype)
    r_BxTxD = jax.random.normal(kr, (B, T, spec.d_model), spec.compute_dtype)

    def loss(p, x, r):
        m = nnx.merge(graphdef, p, rest, copy=True)
        y = onehot_moe(m, x) if variant == "onehot" else m(x)
        dropped = m.dropped[...] if isinstance(m, MoE) else jnp.zeros((), jnp.float32)
        return jnp.sum(y.astype(jnp.float32) * r.astype(jnp.float32)), dropped

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    compiled, _ = timing.compile_jax(step, params, x_BxTxD, r_BxTxD)
    xla_flops, temp_bytes, hlo = _analysis(compiled)
    ((_, dropped), _), _ = timing.first_call(compiled, params, x_BxTxD, r_BxTxD)  # warm-up
    ms = timing.time_jax(compiled, params, x_BxTxD, r_BxTxD, warmup=0, calls=1,
                         batches=reps).ms
    useful = useful_flops(variant, spec, B * T)
    peak = metrics_lib.peak_memory_bytes()
    return {
        "section": "layer", "name": variant, "batch": B, "seq": T, "tokens": B * T, "ms": ms,
        "useful_tflops": useful / (ms / 1e3) / 1e12,
        "xla_flops_ratio": xla_flops / useful if xla_flops else None,
        "xla_temp_gib": temp_bytes / 2**30 if temp_bytes is not None else None,
        "peak_gib": peak / 2**30 if peak is not None else None,
        "ragged_dot_ops": hlo.count("ragged-dot("),
        "dropped_frac": float(dropped) / (B * T * spec.moe.top_k) if variant == "capacity" else None,
        "status": "ok",
    }


def _emit(row: dict) -> None:
    sys.stdout.write(f"RESULT {json.dumps(row)}\n")  # one write: XLA's logs share the file
    sys.stdout.flush()


def layer_worker(job: dict) -> None:
    """Prints one ``RESULT {json}`` line per measurement (the check first, if asked), so that a
    crash loses only what had not been printed yet."""
    spec = model_spec(load_config(job["config"]).model)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if job.get("check"):
        try:
            _emit({**check_agreement(spec, job["check_batch"], job["check_seq"],
                                     bf16=job["check_bf16"]), **info})
        except Exception as err:  # reported as the row's status
            _emit({"section": "check", "name": "ragged vs onehot", "status": _failure(err), **info})
    for variant in job["variants"]:
        for B in job["batches"]:  # ascending: the peak after each is that size's own
            row = {"section": "layer", "name": variant, "batch": B, "seq": job["seq"],
                   "tokens": B * job["seq"], **info}
            if variant == "ragged_cudnn" and jax.default_backend() != "gpu":
                _emit({**row, "status": "skipped: GPU only"})
                continue
            if variant == "mosaic_gpu" and not device.probe().mosaic_gpu:
                _emit({**row, "status": "skipped: sm_90+ GPU only"})
                continue
            try:
                row.update(time_layer(variant, spec, B, job["seq"], job["reps"],
                                      job["capacity_factor"]))
            except Exception as err:  # out of memory, lowering...: the row says so
                row["status"] = _failure(err)
            _emit(row)


def _failure(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"failed: {type(err).__name__}: {text[0][:160] if text else ''}"


# ---------------------------------------------------------------------------------------------
# The orchestrator: subprocesses within a time budget
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """One subprocess: ``cmd`` with ``env_extra`` (XLA_FLAGS are appended to), output in
    ``log``, stopped at ``cap_s`` seconds or the budget's end."""

    key: str
    cmd: list[str]
    log: Path
    cap_s: float
    expect: list[dict]  # the rows this job should produce, as placeholders
    env_extra: dict = dataclasses.field(default_factory=dict)
    workdir: Path | None = None  # a training run's
    proc: subprocess.Popen | None = None
    started: float = 0.0
    limit_s: float = 0.0
    rc: int | None = None
    timed_out: bool = False
    wall_s: float = 0.0
    skipped: str = ""

    def start(self, limit_s: float, base_env: dict) -> None:
        env = dict(base_env)
        for k, v in self.env_extra.items():
            env[k] = f"{env[k]} {v}".strip() if k == "XLA_FLAGS" and env.get(k) else v
        self.limit_s, self.started = limit_s, time.monotonic()
        self._out = open(self.log, "w")  # closed by poll()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT)

    def poll(self) -> bool:
        """True once the subprocess has ended (killed at its limit)."""
        if self.proc.poll() is None:
            if time.monotonic() - self.started < self.limit_s:
                return False
            self.proc.kill()
            self.proc.wait()
            self.timed_out = True
        self.rc, self.wall_s = self.proc.returncode, time.monotonic() - self.started
        self._out.close()
        return True

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ended_as(self) -> str:
        """How the subprocess ended, for a row it never reported."""
        if self.skipped:
            return self.skipped
        if self.timed_out:
            return f"stopped at its limit of {self.limit_s:.0f} s"
        lines = [ln for ln in self.output().splitlines() if ln.strip()]
        return f"crashed (exit {self.rc}): {lines[-1].strip()[:160] if lines else 'no output'}"


def run_jobs(jobs: list[Job], parallel: int, deadline: float, base_env: dict) -> None:
    pending, running = list(jobs), []
    t0 = time.monotonic()
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            left = deadline - time.monotonic()
            if left < MIN_START_S:
                job.skipped = f"skipped: {left:.0f} s of --budget_s left"
                print(f"[moe_bench] {job.key}: {job.skipped}", flush=True)
                continue
            job.start(min(job.cap_s, left), base_env)
            print(f"[moe_bench] {time.monotonic() - t0:5.0f} s  start {job.key} "
                  f"(limit {job.limit_s:.0f} s)", flush=True)
            running.append(job)
        time.sleep(0.1)
        for job in [j for j in running if j.poll()]:
            running.remove(job)
            how = "stopped at its limit" if job.timed_out else f"exit {job.rc}"
            print(f"[moe_bench] {time.monotonic() - t0:5.0f} s  end   {job.key} ({how}, "
                  f"{job.wall_s:.0f} s)", flush=True)


def layer_jobs(a, work: Path) -> list[Job]:
    """The check rides with the first variant; with ``--isolate`` each variant has a process of
    its own (its peak memory its own, a crash its own), else one process runs them all (but
    ragged_cudnn, whose XLA flag must not touch the others)."""
    variants = [v for v in LAYER_VARIANTS if v in a.variants]
    shared = [v for v in variants if v != "ragged_cudnn"]  # that one needs its own XLA_FLAGS
    groups = [[v] for v in shared] if a.isolate else [shared] if shared else []
    groups += [["ragged_cudnn"]] if "ragged_cudnn" in variants else []
    jobs = []
    for i, group in enumerate(groups):
        spec = {"config": a.moe_config, "variants": group, "batches": a.batches, "seq": a.seq,
                "reps": a.reps, "capacity_factor": a.capacity_factor, "check": i == 0,
                "check_batch": a.check_batch, "check_seq": a.check_seq,
                "check_bf16": not a.smoke}
        expect = ([{"section": "check", "name": "ragged vs onehot"}] if i == 0 else []) + [
            {"section": "layer", "name": v, "batch": B, "seq": a.seq, "tokens": B * a.seq}
            for v in group for B in a.batches]
        env = {"XLA_FLAGS": CUDNN_RAGGED_DOT_FLAG} if group == ["ragged_cudnn"] else {}
        jobs.append(Job(key="layer " + ",".join(group),
                        cmd=[sys.executable, str(REPO / "benchmarks" / "moe_bench.py"),
                             "--worker", json.dumps(spec)],
                        log=work / f"layer_{'_'.join(group)}.log", cap_s=a.layer_timeout_s,
                        expect=expect, env_extra=env))
    return jobs


def train_jobs(a, work: Path) -> list[Job]:
    jobs = []
    for run in [r for r in TRAIN_RUNS if r in a.train_runs]:
        config = a.dense_config if run == "dense" else a.moe_config
        wd = work / f"train_{run}"
        cmd = [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"),
               f"--config={config}", f"--workdir={wd}", f"--out={wd}.md",
               f"--config.data.global_batch_size={a.batch}", f"--config.data.seq_len={a.seq}",
               f"--config.train.steps={a.steps + 1}", "--config.train.log_every=1",
               f"--config.train.microbatch_size={a.microbatch}",
               "--config.train.tensorboard=False", *a.train_overrides]
        env = {"XLA_FLAGS": CUDNN_RAGGED_DOT_FLAG} if run == "moe_cudnn" else {}
        if run in TRAIN_MATMULS:
            cmd.append(f"--config.model.moe.expert_matmul={TRAIN_MATMULS[run]}")
        jobs.append(Job(key=f"train {run}", cmd=cmd, log=work / f"train_{run}.log",
                        cap_s=a.train_timeout_s, env_extra=env, workdir=wd,
                        expect=[{"section": "train", "name": run, "config": config}]))
    return jobs


def layer_rows(job: Job) -> list[dict]:
    """The rows a layer job reported, and a placeholder saying how it ended for each missing."""
    got = []
    for line in job.output().splitlines():
        if line.startswith("RESULT "):
            try:  # the object, whatever a log line may have glued after it
                got.append(json.JSONDecoder().raw_decode(line[len("RESULT "):])[0])
            except ValueError:
                pass
    key = lambda r: (r["section"], r["name"], r.get("batch") if r["section"] == "layer" else 0)
    done = {key(r) for r in got}
    return got + [{**e, "status": job.ended_as()} for e in job.expect if key(e) not in done]


def apply_overrides(config, overrides) -> None:
    """``--config.a.b=value`` flags (as train_throughput.py takes them) applied to ``config``."""
    for item in overrides:
        key, _, value = item.removeprefix("--config.").partition("=")
        *path, leaf = key.split(".")
        node = config
        for part in path:
            node = node[part]
        try:
            node[leaf] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            node[leaf] = value


def _summary(workdir: Path) -> dict | None:
    """``metrics_lib.throughput_summary`` of a run's metrics.jsonl, a line cut short by a kill
    left out; None without a timed step."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return None
    good = []
    for line in path.read_text().splitlines():
        try:
            json.loads(line)
            good.append(line)
        except ValueError:
            pass
    clean = workdir.parent / f"{workdir.name}_metrics.jsonl"
    clean.write_text("\n".join(good) + "\n")
    try:
        return metrics_lib.throughput_summary(clean)
    except ValueError:  # no timed report
        return None


def train_row(job: Job, a) -> dict:
    """A training run's row: its metrics.jsonl (also when stopped at its limit), its table's
    peak memory, its micro-batch, and the counts of its config (``model.count_params``,
    ``model.flops_per_token``)."""
    e = job.expect[0]
    row = {**e, "batch": a.batch, "seq": a.seq}
    config = load_config(e["config"])
    apply_overrides(config, a.train_overrides)
    spec = model_spec(config.model, backend="cpu")  # the counts do not depend on the backend
    row.update(params=count_params(spec), active_params=count_params(spec, active=True),
               flops_per_token=flops_per_token(spec, a.seq))
    m = re.search(r"in micro-batches of (\d+) rows", job.output())
    row["microbatch"] = int(m.group(1)) if m else a.microbatch or a.batch
    s = _summary(job.workdir)
    if s is None:
        row["status"] = job.ended_as() if job.rc != 0 or job.skipped else "no timed step"
        return row
    row.update(steps_timed=s["windows"], tokens_per_s=s["tokens_per_s"], step_s=s["step_time_s"],
               mfu=s["mfu"], final_loss=s["final_loss"])
    table = Path(f"{job.workdir}.md")
    if table.exists():  # "| config | params | ... | peak memory / device | final loss |"
        last = [ln for ln in table.read_text().splitlines() if ln.startswith("| ")][-1]
        peak = last.strip("| \n").split("|")[8].strip()
        row["peak_gib"] = float(peak.split()[0]) if peak.endswith("GiB") else None
    row["status"] = "ok" if job.rc == 0 else f"partial ({s['windows']} steps): {job.ended_as()}"
    return row


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def _f(v, fmt: str, none: str = "n/a") -> str:
    return none if v is None else format(v, fmt)


def layer_table(rows: list[dict], spec: ModelSpec, config: str) -> list[str]:
    e = spec.moe
    out = [f"## The MoE FFN layer of {config}, forward + backward", "",
           f"d_model {spec.d_model}, {e.num_experts} experts of width {e.expert_dim}, top-"
           f"{e.top_k}, shared width {e.shared_dim}, compute {spec.dtype}, parameters "
           f"{spec.param_dtype}. Useful FLOPs: the active ones (router, k experts, shared).", ""]
    for c in (r for r in rows if r["section"] == "check"):
        if "out_rel_f32" in c:
            out += [f"Check, ragged vs onehot on {c['batch']} x {c['seq']} tokens "
                    f"(largest difference / largest value): float32 output "
                    f"{c['out_rel_f32']:.1e}, gradients {c['grad_rel_f32']:.1e} -> "
                    f"**{c['status']}** (tolerance {AGREE_TOL:g})"
                    + (f"; bfloat16 output {c['out_rel_bf16']:.1e}, gradients "
                       f"{c['grad_rel_bf16']:.1e}" if "out_rel_bf16" in c else "") + ".", ""]
        else:
            out += [f"Check, ragged vs onehot: {c['status']}", ""]
    base = {r["batch"]: r["ms"] for r in rows
            if r["section"] == "layer" and r["name"] == "ragged" and "ms" in r}
    out += ["| variant | batch x seq | ms | useful TFLOP/s | time / ragged | XLA FLOPs / useful "
            "| XLA scratch GiB | peak GiB | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["section"] == "layer"):
        shape = f"{r['batch']} x {r['seq']}"
        if "ms" not in r:
            out.append(f"| {r['name']} | {shape} |  |  |  |  |  |  | {r['status']} |")
            continue
        notes = []
        if r["name"].startswith("ragged"):
            notes.append(f"{r['ragged_dot_ops']} ragged-dot ops kept by XLA" if r["ragged_dot_ops"]
                         else "ragged_dot rewritten by XLA (no ragged-dot left)")
        if r.get("dropped_frac") is not None:
            notes.append(f"{100 * r['dropped_frac']:.1f}% of assignments dropped")
        ratio = r["ms"] / base[r["batch"]] if r["batch"] in base else None
        out.append(f"| {r['name']} | {shape} | {r['ms']:.2f} | {r['useful_tflops']:.3g} | "
                   f"{_f(ratio, '.2f')} | {_f(r['xla_flops_ratio'], '.2f')} | "
                   f"{_f(r['xla_temp_gib'], '.2f')} | {_f(r['peak_gib'], '.1f')} | "
                   f"{'; '.join(notes)} |")
    return out + [""]


def train_table(rows: list[dict], a) -> list[str]:
    out = [f"## The training step: {a.moe_config} against {a.dense_config}", "",
           f"{a.batch} x {a.seq} tokens per step, {a.steps} timed steps after the first "
           f"(medians per step), micro-batches {a.microbatch or 'automatic'}; MFU from "
           f"model.flops_per_token (a mixture's active FLOPs)"
           + (f"; overrides {' '.join(a.train_overrides)}" if a.train_overrides else "") + ".",
           "", "| run | config | params | active params | batch x seq | micro-batch | "
           "FLOPs/token | steps timed | tokens/s | s/step | MFU | peak GiB | final loss | "
           "status |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    millions = lambda v: _f(v and v / 1e6, ",.1f", "") + ("M" if v else "")
    for r in rows:
        mfu = r.get("mfu")
        out.append(
            f"| {r['name']} | {os.path.basename(r['config'])} | {millions(r.get('params'))} | "
            f"{millions(r.get('active_params'))} | {a.batch} x {a.seq} | "
            f"{r.get('microbatch', '')} | {_f(r.get('flops_per_token'), '.3g', '')} | "
            f"{r.get('steps_timed', '')} | {_f(r.get('tokens_per_s'), ',.0f', '')} | "
            f"{_f(r.get('step_s'), '.3f', '')} | {_f(mfu and 100 * mfu, '.1f')}"
            f"{'%' if mfu else ''} | {_f(r.get('peak_gib'), '.1f')} | "
            f"{_f(r.get('final_loss'), '.3f', '')} | {r['status']} |")
    by = {r["name"]: r for r in rows if r.get("tokens_per_s")}
    for moe in ("moe", *TRAIN_MATMULS):
        if "dense" in by and moe in by:
            d, m = by["dense"], by[moe]
            mfus = (f"; MFU {100 * m['mfu']:.1f}% against {100 * d['mfu']:.1f}%"
                    if m.get("mfu") and d.get("mfu") else "")
            out += ["", f"{moe} / dense: tokens/s x{m['tokens_per_s'] / d['tokens_per_s']:.2f}"
                        f"{mfus}."]
    return out + [""]


CSV_FIELDS = ("section", "name", "config", "batch", "seq", "tokens", "ms", "useful_tflops",
              "xla_flops_ratio", "xla_temp_gib", "peak_gib", "ragged_dot_ops", "dropped_frac",
              "out_rel_f32", "grad_rel_f32", "out_rel_bf16", "grad_rel_bf16", "params",
              "active_params", "microbatch", "flops_per_token", "steps_timed", "tokens_per_s",
              "step_s", "mfu", "final_loss", "status")


def write_outputs(out_dir: Path, md: str, rows: list[dict], jobs: list[Job]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe_bench.md").write_text(md)
    with open(out_dir / "moe_bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(out_dir / "moe_bench.log", "w") as f:
        for job in jobs:
            f.write(f"===== {job.key}: {shlex.join(job.cmd)}\n{job.output()}\n")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return sorted(int(v) for v in text.split(",") if v.strip())


def _names(allowed):
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
        return names
    return parse


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("all", "layer", "train"), default="all")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny configs and shapes, quickest compiler, measurements in parallel")
    ap.add_argument("--out_dir", default="runs/moe_bench", help="moe_bench.md, .csv, .log")
    ap.add_argument("--work_dir", default="", help="runs and logs; default a new temporary folder")
    ap.add_argument("--moe_config", default=None, help="default configs/moe_1b.py")
    ap.add_argument("--dense_config", default=None, help="default configs/1b.py")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096)")
    ap.add_argument("--batches", type=_ints, default=None, help="layer: rows, e.g. 1,8")
    ap.add_argument("--batch", type=int, default=None, help="train: rows per step (default 8)")
    ap.add_argument("--steps", type=int, default=None, help="train: timed steps (default 10)")
    ap.add_argument("--microbatch", type=int, default=0, help="train: rows per pass; 0 = automatic")
    ap.add_argument("--reps", type=int, default=None, help="layer: timed runs (default 5)")
    ap.add_argument("--check_batch", type=int, default=2)
    ap.add_argument("--check_seq", type=int, default=None, help="default 64")
    ap.add_argument("--capacity_factor", type=float, default=1.25)
    ap.add_argument("--variants", type=_names(LAYER_VARIANTS), default=None,
                    help=f"layer variants, of {','.join(LAYER_VARIANTS)} (default all)")
    ap.add_argument("--train_runs", type=_names(TRAIN_RUNS), default=["dense", "moe"],
                    help=f"of {','.join(TRAIN_RUNS)}")
    ap.add_argument("--train_override", dest="train_overrides", action="append", default=None,
                    help="--train_override=--config.x.y=v: a config flag for both training "
                         "runs (repeatable)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="one process per layer variant (default; --smoke: one for all)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes at a time (default 1; --smoke: 3, on the CPU only)")
    ap.add_argument("--budget_s", type=float, default=520.0, help="wall-clock for all of it")
    ap.add_argument("--mem_fraction", type=float, default=0.9,
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION of the subprocesses, unless the "
                         "environment sets it; 0: JAX's default")
    ap.add_argument("--layer_timeout_s", type=float, default=150.0)
    ap.add_argument("--train_timeout_s", type=float, default=240.0)
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    smoke = a.smoke
    defaults = dict(moe_config="configs/moe_tiny.py" if smoke else "configs/moe_1b.py",
                    dense_config="configs/tiny.py" if smoke else "configs/1b.py",
                    seq=32 if smoke else 4096, batches=[2] if smoke else [1, 8],
                    batch=2 if smoke else 8, steps=2 if smoke else 10, reps=2 if smoke else 5,
                    check_seq=16 if smoke else 64, isolate=not smoke, jobs=3 if smoke else 1,
                    train_overrides=list(SMOKE_TRAIN_OVERRIDES) if smoke else [],
                    variants=[v for v in LAYER_VARIANTS
                              if not (smoke and v in ("ragged_cudnn", "mosaic_gpu"))])
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for field in ("seq", "batch", "steps", "reps", "check_batch", "check_seq", "jobs"):
        if getattr(a, field) < 1:
            ap.error(f"--{field} must be >= 1, got {getattr(a, field)}")
    if not a.batches or min(a.batches) < 1:
        ap.error(f"--batches must be positive integers, got {a.batches}")
    if a.microbatch < 0 or (a.microbatch and a.batch % a.microbatch):
        ap.error(f"--microbatch {a.microbatch} must be 0 or divide --batch {a.batch}")
    return a


def _guard(fn, job: Job, a) -> list[dict]:
    """``fn``'s row(s) for ``job``; where reading them fails, its expected rows saying why (the
    tables are written whatever happened)."""
    try:
        out = fn(job) if fn is layer_rows else fn(job, a)
        return out if isinstance(out, list) else [out]
    except Exception as err:
        return [{**e, "status": f"unreadable: {_failure(err)}"} for e in job.expect]


def main(argv=None) -> str:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.worker:
        layer_worker(json.loads(a.worker))
        return ""
    t_start = time.monotonic()
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="moe_bench_"))
    work = work / time.strftime("%Y%m%d-%H%M%S") if a.work_dir else work
    work.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ, PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                             os.environ.get("PYTHONPATH")])))
    if a.smoke:
        base_env["XLA_FLAGS"] = f"{base_env.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
    if a.mem_fraction > 0:  # moe_1b's training state: 16 bytes x 4.4B parameters in float32
        base_env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{a.mem_fraction:g}")
    layer = layer_jobs(a, work) if a.mode in ("all", "layer") else []
    extra = [j for j in layer if set(j.key.split()[1].split(",")) <= set(EXTRA_VARIANTS)]
    # The core layer rows, the training runs, then the extra layer rows, in the time left.
    jobs = [j for j in layer if j not in extra] + (
        train_jobs(a, work) if a.mode in ("all", "train") else []) + extra
    # Nothing here touches a device before the subprocesses are done: the GPU is theirs.
    run_jobs(jobs, a.jobs, t_start + a.budget_s, base_env)

    lrows = [r for j in jobs if j.key.startswith("layer") for r in _guard(layer_rows, j, a)]
    lrows.sort(key=lambda r: (r["section"] != "check", LAYER_VARIANTS.index(r["name"])
                              if r["name"] in LAYER_VARIANTS else -1, r.get("batch") or 0))
    trows = [r for j in jobs if j.key.startswith("train") for r in _guard(train_row, j, a)]
    try:
        device = f"{jax.devices()[0].device_kind}, JAX {jax.__version__}"
    except Exception as err:  # the table is written whatever state the device is in
        device = f"device unknown ({type(err).__name__}), JAX {jax.__version__}"
    lines = [f"# Mixture of experts: {device}, {time.strftime('%Y-%m-%d')}", "",
             f"Command: `python benchmarks/moe_bench.py {shlex.join(argv or sys.argv[1:])}` "
             f"({time.monotonic() - t_start:.0f} s; XLA_PYTHON_CLIENT_MEM_FRACTION="
             f"{base_env.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 'default')})", ""]
    if a.mode in ("all", "layer"):
        spec = model_spec(load_config(a.moe_config).model, backend="cpu")
        lines += layer_table(lrows, spec, a.moe_config)
    if a.mode in ("all", "train"):
        lines += train_table(trows, a)
    md = "\n".join(lines)
    write_outputs(Path(a.out_dir), md, lrows + trows, jobs)
    print(md, flush=True)
    return md


if __name__ == "__main__":
    main()
