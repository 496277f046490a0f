r"""The one way to run the GPU benchmarks: a registry of BENCHMARKS.md's measurements by name, each
run in its own subprocess with a time limit, its log and files in ``--out_dir/<name>/``.

    python3 benchmarks/run.py --list                     # every name: card, files, wheels
    python3 benchmarks/run.py kda_kernel --print         # the command lines, not run
    python3 benchmarks/run.py kda_kernel attention --out_dir=runs/bench
    python3 benchmarks/run.py long_context --out_dir=runs/bench     # a group: its three entries
    python3 benchmarks/run.py all --out_dir=runs/bench   # every GPU entry this host can run

On a GPU machine without a package index (the project's lent cards), carry the wheels its image
lacks in ``.whl/`` and let the runner install them (``pip install --no-index --no-deps --target``
into a temporary folder put first on the children's PYTHONPATH); ``--pack`` leaves only
``summary.md`` and ``results.tgz`` in ``--out_dir`` (a folder that must come back whole):

    python3 benchmarks/run.py kda_kernel kda_kernel_long --wheels=.whl --out_dir=$OUT --pack
    python3 benchmarks/run.py dense_anchor --anchor=PATH/TO/dense_anchor.py --wheels=.whl \
        --out_dir=$OUT

The wheels: ml-collections (every entry) and tensorboardX (the training runs), which the
project needs and a CUDA JAX + PyTorch image may lack; fla-core and jax-linear-attention for
the KDA peers (their columns read "—" without them). ``--list`` names each entry's.

Each entry (``REGISTRY``) gives its command lines, the card it needs, the files it writes under
``--out_dir/<name>/`` besides ``log.txt`` (every command's output, with the command), and the
wheels it imports. An entry may also have ``prepare`` commands: started together before its
measured commands, each within its own time limit (their outputs in ``log.txt`` once all have
ended), the measured commands then one after another; ``--print`` shows them as ``cmd &`` lines
and a ``wait``. The training entries whose steps take minutes to compile use them, or their
script's own ``--compile_first``, to compile every program at once into a JAX compilation cache
(``{work}/jax_cache``) that their measured commands read. In the commands, ``{python}`` is this
interpreter, ``{out}`` the entry's folder, ``{work}`` a scratch folder (run folders, traces,
compilation caches: not kept with the results; ``--work_dir`` keeps it across calls),
``{anchor}`` the ``--anchor`` script (the dense same-card baseline, a script the user
supplies; the entry is skipped without it) and ``{fla_tuning}`` a copy, in ``{out}``, of
``benchmarks/results/fla_autotune_h200.tgz`` (fla's autotuning results, which kda_kernel.py
extends: the copy comes back with the results). Each command gets the smaller of its own time
limit and what is left of ``--budget_s``; its process group is killed past it. ``summary.md``
lists every entry's status, seconds and files.

``--work_dir=DIR`` puts the scratch folders in DIR instead of a fresh temporary folder: before
an entry runs, its folder there is emptied but for its compilation cache (``jax_cache``), so a
call that was cut short leaves the programs it compiled to the next call on the same machine.

``all`` runs, in registry order, the entries whose card this host has (GPUs counted with
``nvidia-smi -L``) and whose needs are met, for up to the sum of their time limits (``--list``);
CPU entries and entries needing ``--anchor`` run when named. Groups (``GROUPS``) name several
entries at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import processes  # noqa: E402  (no JAX: the runner never touches the device)

FLA_TUNING = "benchmarks/results/fla_autotune_h200.tgz"
# Import names of the distributions the entries ask for.
WHEEL_MODULES = {"ml-collections": "ml_collections", "tensorboardX": "tensorboardX",
                 "fla-core": "fla", "jax-linear-attention": "jla"}
MIN_START_S = 30  # an entry is not started with less of --budget_s left
KEPT_IN_WORK = ("jax_cache",)  # what --work_dir keeps of an entry's scratch folder between calls
ONE_B = ("--d_model=2048", "--num_layers=20", "--heads=16", "--head_dim=128", "--kv_lora_rank=512")


@dataclasses.dataclass(frozen=True)
class Command:
    """One command line of an entry: ``argv`` (placeholders as in the module docstring), its
    time limit, extra environment, and ``stdout``: a file in ``{out}`` for its standard output
    (the table of a script that prints it), else the log."""

    argv: tuple[str, ...]
    timeout_s: int = 540
    env: tuple[tuple[str, str], ...] = ()
    stdout: str = ""


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A registry entry: what it measures (``what``, the BENCHMARKS.md section), its commands,
    the GPUs it needs (0: CPU) and on which card (``card``), the files it writes in its folder,
    the wheels it needs (``wheels``) or uses when present (``optional``), whether it needs
    ``--anchor``, and ``prepare``: commands started together before ``commands`` (compiling
    ahead), each within its own time limit."""

    what: str
    commands: tuple[Command, ...]
    gpus: int = 1
    card: str = "any CUDA GPU"
    writes: tuple[str, ...] = ()
    wheels: tuple[str, ...] = ("ml-collections",)
    optional: tuple[str, ...] = ()
    needs_anchor: bool = False
    prepare: tuple[Command, ...] = ()

    def time_limit(self) -> int:
        """Seconds at most: the longest prepare command's, then every command's in turn."""
        return max((c.timeout_s for c in self.prepare), default=0) + sum(
            c.timeout_s for c in self.commands)


def py(script: str, *args: str, **kw) -> Command:
    """``{python} script args...`` as a Command."""
    env = tuple(kw.pop("env", {}).items())
    return Command(("{python}", script, *args), env=env, **kw)


HOPPER = "a Hopper GPU (H100 or H200: the Mosaic GPU kernels need sm_90)"
H200 = "an H200 (BENCHMARKS.md's card for it: some points or batches need its memory)"
FP8_CARD = "an H100 (FP8 matrix units: sm_89 or later; BENCHMARKS.md's FP8 card)"
TRAIN = ("ml-collections", "tensorboardX")
# The FP8 runs (model.matmul_format="fp8") import Qwix, the quantisation library.
FP8 = (*TRAIN, "qwix")
# configs/small.py's shapes for the FP8 loss curves: 8 rows of 2048 tokens, 300 steps, nothing
# but training (no held-out split, no checkpoints), non-finite steps counted rather than fatal.
FP8_LOSS_FLAGS = ("--config.data.global_batch_size=8 --config.train.steps=300 "
                  "--config.opt.warmup_steps=50 --config.train.log_every=10 "
                  "--config.data.eval_fraction=0.0 --config.checkpoint.enabled=False "
                  "--config.train.nan_policy=skip --config.train.tensorboard=False")
# configs/small.py as a mixture (16 experts of 384, top-4, one shared; layer 1 dense) for the
# bf16-state loss curves: 8 rows in micro-batches of 2 (the gradient sums the bf16 option
# changes), 300 steps, nothing but training.
MOE_LOSS_FLAGS = ("--config.model.moe.num_experts=16 --config.model.moe.top_k=4 "
                  "--config.model.moe.expert_dim=384 --config.model.moe.num_shared=1 "
                  "--config.model.moe.first_k_dense=1 --config.train.microbatch_size=2 "
                  + FP8_LOSS_FLAGS)
NO_CMDBUF = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}  # every kernel its own trace event
# JAX's allocator growing on demand: PyTorch (fla) shares the card in the same process.
SHARED = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
# A compilation cache shared by an entry's commands: what its prepare commands compile (several
# processes at once, their allocators growing on demand) its measured commands read.
JAX_CACHE = "--compilation_cache={work}/jax_cache"

DECODE_CARD = "an H100 (the card of BENCHMARKS.md's decoding table)"
DECODE_FILES = ("decode.md", "decode.csv", "decode_ms_per_token.png")
EVAL_CARD = "an H100 (the card of BENCHMARKS.md's table of the evaluation at 1M tokens)"


def _decode_bench(*flags: str, max_seconds: int = 85) -> Command:
    """decode_bench.py at 131K and 1M, the 1B shapes, 20 timed steps, the variants and batches
    of ``flags``, ``max_seconds`` for each (variant, context) point."""
    return py("benchmarks/decode_bench.py", "--out_dir={out}", *ONE_B,
              "--contexts=131072,1048576", *flags, "--warmup=2", "--steps=20",
              f"--max_seconds={max_seconds}", "--grace_seconds=10",
              env={"JAX_COMPILATION_CACHE_DIR": "{work}/jax_cache"})


REGISTRY: dict[str, Benchmark] = {
    "kda_kernel": Benchmark(
        "KDA kernel against fla and jla: configs/small.py's and configs/1b.py's shapes",
        (py("benchmarks/kda_kernel.py", "--no_xla", "--no_gate_in_kernel", "--shapes",
            "small,8x4096", "--fla_tuning", "{fla_tuning}", "--out", "{out}/peers_small_8x4096.md",
            env=SHARED),),
        card=HOPPER, writes=("peers_small_8x4096.md", "fla_autotune.tgz"),
        optional=("fla-core", "jax-linear-attention")),
    "kda_kernel_long": Benchmark(
        "KDA kernel against fla and jla: long rows (16K, 64K, 256K tokens)",
        (py("benchmarks/kda_kernel.py", "--no_xla", "--no_gate_in_kernel", "--shapes",
            "2x16384,1x65536,1x262144", "--fla_tuning", "{fla_tuning}", "--out",
            "{out}/peers_long.md", env=SHARED),),
        card=HOPPER, writes=("peers_long.md", "fla_autotune.tgz"),
        optional=("fla-core", "jax-linear-attention")),
    "kda_breakdown": Benchmark(
        "KDA by kernel: each kernel of ours timed alone at configs/small.py's shape (in the log)",
        (py("benchmarks/kda_kernel.py", "--no_fla", "--no_jla", "--shapes", "small",
            "--breakdown", "--out", "{out}/kda_kernel_small.md", env=SHARED),),
        card=HOPPER, writes=("kda_kernel_small.md",)),
    "kda_ncu": Benchmark(
        "KDA by kernel: Nsight Compute over ours, fla and jla at configs/small.py's shape",
        (Command(("bash", "benchmarks/kda_ncu.sh", "sum"), timeout_s=580,
                 env=(("SHAPE", "small"), ("IMPLS", "ours fla jla"),
                      ("FLA_TUNING", "{fla_tuning}"), ("OUT", "{out}"), ("W", "{work}"))),),
        card=HOPPER + " with Nsight Compute (ncu)",
        writes=("sum_ours.txt", "sum_fla.txt", "sum_jla.txt", "ncu.tgz (the CSVs)"),
        optional=("fla-core", "jax-linear-attention")),
    "kda_stress": Benchmark(
        "KDA kernel against impl=\"xla\" under extreme inputs (a correctness probe; the log)",
        (py("benchmarks/kda_stress.py", timeout_s=300),), card=HOPPER),
    "train_1b": Benchmark(
        "Training step and MFU: configs/1b.py as written (train.py's loop)",
        (py("benchmarks/train_throughput.py", "--config=configs/1b.py",
            "--config.train.microbatch_size=4", "--config.train.steps=6",
            "--config.train.log_every=2", "--workdir={work}/run_1b", "--out={out}/throughput_1b.md"),),
        card=H200, writes=("throughput_1b.md",), wheels=TRAIN),
    "train_small": Benchmark(
        "Training step and MFU: configs/small.py",
        (py("benchmarks/train_throughput.py", "--config=configs/small.py",
            "--config.train.steps=20", "--config.train.log_every=5", "--workdir={work}/run_small",
            "--out={out}/throughput_small.md", timeout_s=300),),
        writes=("throughput_small.md",), wheels=TRAIN),
    "fp8_train": Benchmark(
        "FP8 training: configs/1b.py (8 rows a step) in bf16 and FP8, both steps compiled at "
        "once first (train_throughput.py --compile_first), then each run, then the anchor",
        (py("benchmarks/train_throughput.py", "--config=configs/1b.py",
            "--config.data.global_batch_size=8",
            "--config.train.steps=6", "--config.train.log_every=2", "--variant=bf16=",
            "--variant=fp8=--config.model.matmul_format=fp8", "--anchor={anchor}",
            "--compile_first", JAX_CACHE, "--timeout_s=300", "--workdir={work}/runs",
            "--out={out}/fp8_1b.md", timeout_s=600),),
        card=FP8_CARD, writes=("fp8_1b.md",), wheels=FP8, needs_anchor=True),
    "fp8_loss": Benchmark(
        "FP8 training: loss at configs/small.py's shapes, FP8 against bf16 and a second seed",
        (py("benchmarks/loss_curves.py", "--config=configs/small.py", "--work_dir={work}/runs",
            f"--flags={FP8_LOSS_FLAGS}", "--jobs=3", "--train=bf16=",
            "--train=bf16_seed1=--config.seed=1", "--train=fp8=--config.model.matmul_format=fp8",
            "--noise=bf16_seed1", "--timeout_s=420", "--out={out}/fp8_loss.png",
            "--table={out}/fp8_loss.md", timeout_s=450),),
        card=FP8_CARD, writes=("fp8_loss.md", "fp8_loss.png"), wheels=FP8),
    "fp8_matmul": Benchmark(
        "FP8 training: the products alone at configs/1b.py's projection shapes, FP8 against bf16, "
        "the quantisation and the FP8 GEMM apart, and whether XLA made them cuBLASLt FP8 GEMMs",
        (py("benchmarks/fp8_matmul_bench.py", timeout_s=240, stdout="fp8_matmul.md"),),
        card=FP8_CARD, writes=("fp8_matmul.md",), wheels=FP8),
    "internals_cost": Benchmark(
        "The internals report's cost: configs/small.py's training step against one report",
        (py("benchmarks/internals_cost.py", "--config=configs/small.py",
            "--out={out}/internals_cost_small.md", timeout_s=420),),
        writes=("internals_cost_small.md",)),
    "plan_check": Benchmark(
        "The planner's memory estimate against the measured peak (configs/1b.py, small.py)",
        (py("benchmarks/plan_check.py", "--cases=1b,small", "--steps=2",
            "--out={out}/plan_check.md", timeout_s=540),),
        writes=("plan_check.md",), wheels=TRAIN),
    "dense_anchor": Benchmark(
        "Training step and MFU: the dense same-card anchor (--anchor, a script the user supplies)",
        (Command(("{python}", "{anchor}", "--remat", "dots", "--batch", "8"), timeout_s=300,
                 stdout="dense_anchor.txt"),),
        card=H200, writes=("dense_anchor.txt",), wheels=(), needs_anchor=True),
    "step_profile": Benchmark(
        "Where the step's time goes: configs/1b.py, 8 rows in micro-batches of 4, by model part",
        (py("benchmarks/step_profile.py", "--config=configs/1b.py",
            "--config.data.global_batch_size=8", "--config.train.microbatch_size=4", "--steps=6",
            "--trace_steps=2", "--trace_dir={work}/trace", "--out={out}/step_profile_1b.md",
            "--ops_out={out}/step_profile_1b_ops.csv", env=NO_CMDBUF),),
        card=H200, writes=("step_profile_1b.md", "step_profile_1b_ops.csv"), wheels=TRAIN),
    "micro_batch_order": Benchmark(
        "Micro-batch order: one MLA layer's attention over configs/1b.py's batches, two orders",
        (py("benchmarks/micro_batch_order.py", "--config=configs/1b.py", "--microbatch_size=4",
            "--steps=4", timeout_s=240, stdout="micro_batch_order_4.md"),
         py("benchmarks/micro_batch_order.py", "--config=configs/1b.py", "--microbatch_size=4",
            "--steps=16", timeout_s=300, stdout="micro_batch_order_16.md")),
        writes=("micro_batch_order_4.md", "micro_batch_order_16.md")),
    "long_context_3to1": Benchmark(
        "Long context: 3:1 at the 1B shapes, forward and prefill, 8K to 1M tokens",
        (py("benchmarks/long_context_memory.py", *ONE_B, "--variants=3:1", "--piece_len=65536",
            "--repeats=1", "--seq_lens=8192,131072,524288,1048576", "--max_seconds=120",
            "--out_dir={out}"),),
        card=H200, writes=("long_context_memory.md", "long_context_memory.csv",
                           "long_context_time.png", "long_context_memory.png")),
    "long_context_mla": Benchmark(
        "Long context: all-MLA at the 1B shapes, 8K to 512K tokens, then its prefill at 1M",
        (py("benchmarks/long_context_memory.py", *ONE_B, "--variants=all-MLA", "--piece_len=65536",
            "--repeats=1", "--seq_lens=8192,131072,524288", "--max_seconds=80",
            "--out_dir={out}/series", timeout_s=300),
         py("benchmarks/long_context_memory.py", *ONE_B, "--variants=all-MLA", "--modes=prefill",
            "--piece_len=65536", "--repeats=1", "--seq_lens=1048576", "--max_seconds=260",
            "--out_dir={out}/prefill_1m", timeout_s=330)),
        card=H200, writes=("series/long_context_memory.md", "prefill_1m/long_context_memory.md",
                           "(each with its .csv and plots)")),
    "long_context_kda": Benchmark(
        "Long context: all-KDA at the 1B shapes, 8K to 1M tokens",
        (py("benchmarks/long_context_memory.py", *ONE_B, "--variants=all-KDA", "--piece_len=65536",
            "--repeats=1", "--seq_lens=8192,131072,524288,1048576", "--max_seconds=40",
            "--out_dir={out}", timeout_s=240),),
        card=H200, writes=("long_context_memory.md", "long_context_memory.csv",
                           "long_context_time.png", "long_context_memory.png")),
    "eval_1m": Benchmark(
        "Evaluation at 1M tokens: eval.py on configs/1b.py, an empty compilation cache, then full",
        (Command(("{python}", "eval.py", "--config=configs/1b.py", "--checkpoint=init",
                  "--context_lengths=1M", "--piece_len=65536", "--max_windows=1",
                  "--short_docs=concat", "--config.data.eval_fraction=0.5",
                  "--compilation_cache={work}/jax_cache", "--workdir={out}/cold"), timeout_s=300),
         Command(("{python}", "eval.py", "--config=configs/1b.py", "--checkpoint=init",
                  "--context_lengths=1M", "--piece_len=65536", "--max_windows=1",
                  "--short_docs=concat", "--config.data.eval_fraction=0.5",
                  "--compilation_cache={work}/jax_cache", "--workdir={out}/warm"), timeout_s=240)),
        card=EVAL_CARD, writes=("cold/ and warm/: eval.py's JSON, CSV and plots",)),
    "decode": Benchmark(
        "Decoding: time per output token, all-MLA against 3:1 at the 1B shapes, 8K to 1M",
        (_decode_bench("--variants=3:1,all-MLA", "--search=jump", "--max_batch=64",
                       max_seconds=170),),
        card=DECODE_CARD, writes=DECODE_FILES),
    "decode_unfused": Benchmark(
        "Decoding: 3:1's batch-1 step with each projection its own product (--no-fuse), to set "
        "beside the decode entry's fused step from the same card",
        (_decode_bench("--variants=3:1", "--max_batch=1", "--no-fuse"),),
        card=DECODE_CARD, writes=DECODE_FILES),
    "decode_step_kernel": Benchmark(
        "Decoding: 3:1's batch-1 step with each KDA layer's work after its projections as one "
        "kernel (--kda_step_impl=pallas), to set beside the decode entry's XLA step",
        (_decode_bench("--variants=3:1", "--max_batch=1", "--kda_step_impl=pallas"),),
        card=DECODE_CARD, writes=DECODE_FILES),
    "decode_profile": Benchmark(
        "Decoding: batch 1's step at 131K by model part (kernels, idle time), 3:1 and all-MLA",
        (py("benchmarks/decode_bench.py", "--out_dir={out}", *ONE_B, "--contexts=131072",
            "--variants=3:1,all-MLA", "--max_batch=1", "--warmup=2", "--steps=10",
            "--max_seconds=90", "--profile_dir={work}/traces",
            env={"JAX_COMPILATION_CACHE_DIR": "{work}/jax_cache"}),),
        writes=("decode.md", "decode.csv")),
    "attention": Benchmark(
        "Attention at configs/1b.py's MLA shapes: one document per row, then packed documents",
        (py("benchmarks/attention_bench.py", "--batch=4", "--doc_len=100000",
            "--impls=cudnn,cudnn:rows", timeout_s=240, stdout="one_document_per_row.md"),
         py("benchmarks/attention_bench.py", "--batch=4", "--doc_len=5000",
            "--impls=cudnn:runs=32,cudnn:runs=8,cudnn:runs=4", timeout_s=240,
            stdout="packed_rooms.md")),
        writes=("one_document_per_row.md", "packed_rooms.md")),
    "cache_attention": Benchmark(
        "Cache attention: one 64K-token block of MLA's cache through cuDNN",
        (py("benchmarks/cache_attention_bench.py", timeout_s=240, stdout="cache_attention.md"),),
        writes=("cache_attention.md",)),
    "short_conv": Benchmark(
        "Short convolutions: KDA's q/k (silu_l2), v (silu) and no activation",
        tuple(py("benchmarks/short_conv_bench.py", f"--activation={act}", timeout_s=180,
                 stdout=f"{act}.md") for act in ("silu_l2", "silu", "none")),
        writes=("silu_l2.md", "silu.md", "none.md")),
    "swiglu": Benchmark(
        "SwiGLU backward: XLA's fusion against the Pallas kernel, with a launch sweep",
        (py("benchmarks/swiglu_bench.py", "--tiles",
            "32,256,4;8,256,4;16,512,4;16,256,8;32,128,4;64,256,8", timeout_s=240,
            stdout="backward.md"),),
        writes=("backward.md",)),
    "attn_res": Benchmark(
        "Attention Residual read: configs/1b.py's depth mixing against the plain residual stream",
        (py("benchmarks/attn_res_bench.py", "--variants=model,fused", timeout_s=300,
            stdout="attn_res_bench.md"),),
        writes=("attn_res_bench.md",)),
    "routed_experts": Benchmark(
        "Mixture of experts: the routed experts of moe_1b's two-row micro-batch, blocked kernels "
        "against the equal-group einsum ceiling",
        (py("benchmarks/routed_experts_bench.py", "--tokens=8192", "--impls=blocked,ceiling",
            "--kernels=gmm,wgrad", timeout_s=240, stdout="routed_experts.md"),),
        card=HOPPER, writes=("routed_experts.md",)),
    "moe_train": Benchmark(
        "Mixture of experts: the training step of configs/moe_1b.py as written, profiled, then "
        "configs/1b.py's (both compiled at once first)",
        tuple(py("benchmarks/step_profile.py", f"--config=configs/{name}.py", "--steps=2",
                 "--trace_steps=1", f"--trace_dir={{work}}/trace_{name}",
                 f"--out={{out}}/profile_{name}.md", f"--ops_out={{out}}/ops_{name}.csv",
                 JAX_CACHE, timeout_s=330)
              for name in ("moe_1b", "1b")),
        card="an H100 (the 80 GB card moe_1b must fit)",
        writes=("profile_moe_1b.md", "profile_1b.md", "ops_moe_1b.csv", "ops_1b.csv"),
        wheels=TRAIN,
        prepare=tuple(py("benchmarks/step_profile.py", f"--config=configs/{name}.py",
                         "--compile_only", JAX_CACHE, timeout_s=420, env=SHARED)
                      for name in ("moe_1b", "1b"))),
    "moe_state_loss": Benchmark(
        "Mixture of experts: loss with bf16 moments and gradient sums against float32 state, "
        "configs/small.py with 16 experts",
        (py("benchmarks/loss_curves.py", "--config=configs/small.py", "--work_dir={work}/runs",
            f"--flags={MOE_LOSS_FLAGS}", "--jobs=3", "--train=f32=",
            "--train=f32_seed1=--config.seed=1",
            "--train=bf16_state=--config.opt.moments_dtype=bfloat16 "
            "--config.train.grad_accum_dtype=bfloat16",
            "--noise=f32_seed1", "--timeout_s=420", "--out={out}/moe_state_loss.png",
            "--table={out}/moe_state_loss.md", timeout_s=450),),
        writes=("moe_state_loss.md", "moe_state_loss.png"), wheels=TRAIN),
    "grouped_matmul": Benchmark(
        "The grouped matmul alone: Mosaic GPU against an equal-group einsum",
        (py("benchmarks/grouped_matmul_bench.py", "--impls=mosaic_gpu,einsum", timeout_s=240,
            stdout="grouped_matmul.md"),),
        card=HOPPER, writes=("grouped_matmul.md",)),
    "init_compile": Benchmark(
        "Initialiser compile: configs/1b.py's, XLA's defaults against the run-once options",
        (py("benchmarks/init_compile.py", "--config=configs/1b.py", "--options", timeout_s=420,
            stdout="1b_options.md"),),
        writes=("1b_options.md",)),
    "scaling": Benchmark(
        "Scaling over GPUs of one host: configs/1b.py on 1 and 2 GPUs, 4 rows per GPU",
        (py("benchmarks/scaling.py", "--config=configs/1b.py", "--counts=1,2",
            "--per_device_batch=4", "--steps=20", "--log_every=5", "--out_dir={out}"),),
        gpus=2, card="2 GPUs of one host", writes=("scaling.md", "scaling.csv", "scaling.png"),
        wheels=TRAIN),
    "context_parallel": Benchmark(
        "Context-parallel memory: configs/1b.py's step compiled for 8 fake CPU devices",
        (py("benchmarks/context_parallel_memory.py", "--config=configs/1b.py", "--devices=8",
            "--tokens_per_device=512,1024", "--out_dir={out}", timeout_s=1800),),
        gpus=0, card="CPU", writes=("context_parallel_memory.md", "context_parallel_memory.csv")),
    "mqar": Benchmark(
        "MQAR recall: all-KDA, 3:1 and all-MLA on multi-query associative recall",
        (py("benchmarks/mqar_sweep.py", "--config=configs/mqar.py", "--out_dir={out}",
            timeout_s=3600),),
        gpus=0, card="CPU", writes=("mqar_sweep.md", "mqar_sweep.csv", "mqar_sweep.png")),
}

GROUPS = {
    "kda": ("kda_kernel", "kda_kernel_long", "kda_breakdown"),
    "train": ("train_1b", "train_small", "dense_anchor", "step_profile", "micro_batch_order",
              "plan_check"),
    "long_context": ("long_context_3to1", "long_context_mla", "long_context_kda"),
    "moe": ("routed_experts", "moe_train", "moe_state_loss"),
    "kernels": ("attention", "cache_attention", "short_conv", "swiglu", "attn_res"),
    "fp8": ("fp8_train", "fp8_matmul", "fp8_loss"),
}


# ---------------------------------------------------------------------------------------------
# Selecting and describing entries
# ---------------------------------------------------------------------------------------------


def visible_gpus() -> int:
    """GPUs this host has (``nvidia-smi -L``; 0 without it), or CUDA_VISIBLE_DEVICES' count."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def select(names: list[str], gpus: int, have_anchor: bool) -> list[str]:
    """Registry names for the command line's names (entries, groups, ``all``), in order, each
    once. Raises ValueError naming an unknown one."""
    out = []
    for name in names:
        if name == "all":
            picked = [n for n, b in REGISTRY.items() if 1 <= b.gpus <= gpus
                      and (have_anchor or not b.needs_anchor)]
        elif name in GROUPS:
            picked = list(GROUPS[name])
        elif name in REGISTRY:
            picked = [name]
        else:
            raise ValueError(f"no benchmark or group {name!r}: one of {sorted(REGISTRY)}, "
                             f"a group of {sorted(GROUPS)}, or all (--list describes them)")
        out += [n for n in picked if n not in out]
    return out


def describe(name: str) -> str:
    b = REGISTRY[name]
    gpus = "CPU" if b.gpus == 0 else f"{b.gpus} GPU{'s' if b.gpus > 1 else ''}"
    wheels = ", ".join([*b.wheels, *(f"{w} (optional)" for w in b.optional)]) or "none"
    files = ", ".join(["log.txt", *b.writes])
    limit = b.time_limit()
    lines = [f"{name}: {b.what}", f"    card: {gpus}, {b.card}; time limit {limit} s",
             f"    writes: {name}/ {files}", f"    wheels: {wheels}"]
    if b.needs_anchor:
        lines.append("    needs: --anchor=PATH (the dense anchor script)")
    if b.prepare:
        lines.append(f"    first: {len(b.prepare)} commands together (compiling ahead)")
    return "\n".join(lines)


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


def quote(text: str) -> str:
    """``shlex.quote``, leaving a word of safe characters and ``$VARIABLES`` as it is."""
    return text if re.fullmatch(r"[\w@%+=:,./$-]+", text) else shlex.quote(text)


def command_line(cmd: Command, values: dict[str, str]) -> str:
    """The shell form of ``cmd`` with its placeholders filled: ENV=... argv [> stdout]."""
    env = [f"{k}={quote(fill(v, values))}" for k, v in cmd.env]
    argv = [quote(fill(a, values)) for a in cmd.argv]
    redirect = [">", quote(os.path.join(values["out"], cmd.stdout))] if cmd.stdout else []
    return " ".join([*env, *argv, *redirect])


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def install_wheels(wheel_dir: str, site: str) -> None:
    """``pip install --no-index --no-deps --target site`` of every wheel in ``wheel_dir``."""
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if not wheels:
        raise SystemExit(f"--wheels: no .whl files in {wheel_dir!r}")
    print(f"[run] installing {len(wheels)} wheels from {wheel_dir} into {site}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", site, *wheels],
                   check=True)


def child_env(site: str | None) -> dict[str, str]:
    """The children's environment: the repository (and the installed wheels) on PYTHONPATH,
    unbuffered output."""
    path = [p for p in (site, str(REPO), os.environ.get("PYTHONPATH")) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


def missing_modules(wheels, env: dict[str, str]) -> list[str]:
    """The distributions of ``wheels`` whose module the children's interpreter cannot find."""
    if not wheels:
        return []
    mods = [WHEEL_MODULES.get(w, w) for w in wheels]
    code = ("import importlib.util, sys\n"
            "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    out = subprocess.run([sys.executable, "-c", code, *mods], env=env, capture_output=True,
                         text=True, cwd=REPO)
    gone = set(out.stdout.split())
    return [w for w, m in zip(wheels, mods, strict=True) if m in gone]


def run_command(cmd: Command, values: dict[str, str], env: dict[str, str], log, timeout: float):
    """Runs one command in its own process group, output to ``log`` (stdout to its file when it
    names one); kills the group past ``timeout``. Returns (exit code or "timed out", seconds)."""
    log.write(f"$ {command_line(cmd, values)}\n")
    log.flush()
    with contextlib.ExitStack() as stack:
        out = (stack.enter_context(open(os.path.join(values["out"], cmd.stdout), "w"))
               if cmd.stdout else log)
        ((rc, seconds),) = processes.run_at_once(
            [_popen_args(cmd, values, env, out, log)], [timeout])
    rc = f"timed out after {timeout:.0f} s" if rc is None else rc
    log.write(f"[run] exit {rc} after {seconds:.1f} s\n\n")
    log.flush()
    return rc, seconds


def _popen_args(cmd: Command, values: dict[str, str], env: dict[str, str], out, err) -> dict:
    """``subprocess.Popen``'s arguments for ``cmd`` with its placeholders filled."""
    return dict(args=[fill(a, values) for a in cmd.argv], cwd=REPO,
                env={**env, **{k: fill(v, values) for k, v in cmd.env}}, stdout=out, stderr=err)


def run_together(cmds, values: dict[str, str], env: dict[str, str], log,
                 limits) -> list[tuple[int | str, float]]:
    """Starts every command of ``cmds`` at once, each in its own process group with its output
    in a file of its own in ``{work}`` (stdout in its ``{out}`` file when it names one), and
    kills each group past its own limit (``limits``); once all have ended, their outputs go to
    ``log`` in turn, each after its command line. Returns (exit code or "timed out", seconds)
    for each command."""
    parts = [os.path.join(values["work"], f"together_{i}.log") for i in range(len(cmds))]
    with contextlib.ExitStack() as stack:
        popen_args = []
        for cmd, part in zip(cmds, parts, strict=True):
            err = stack.enter_context(open(part, "w"))
            out = (stack.enter_context(open(os.path.join(values["out"], cmd.stdout), "w"))
                   if cmd.stdout else err)
            popen_args.append(_popen_args(cmd, values, env, out, err))
        ended = processes.run_at_once(popen_args, limits)
    done = [(f"timed out after {limit:.0f} s" if rc is None else rc, seconds)
            for (rc, seconds), limit in zip(ended, limits, strict=True)]
    for cmd, part, (rc, seconds) in zip(cmds, parts, done, strict=True):
        log.write(f"$ {command_line(cmd, values)} &\n")
        with open(part, errors="replace") as f:
            shutil.copyfileobj(f, log)
        log.write(f"[run] exit {rc} after {seconds:.1f} s (started with the others)\n\n")
    log.flush()
    return done


def clear_scratch(work: Path) -> None:
    """--work_dir: an entry's scratch folder emptied but for what it keeps between calls."""
    for path in work.iterdir() if work.is_dir() else ():
        if path.name in KEPT_IN_WORK:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def run_entry(name: str, out_dir: Path, work_root: Path, env: dict[str, str], args,
              deadline: float) -> dict:
    """Every command of one entry; the summary's row."""
    b = REGISTRY[name]
    row = {"name": name, "status": "ok", "seconds": 0.0, "files": []}
    if b.needs_anchor and not args.anchor:
        row["status"] = "skipped: needs --anchor=PATH"
        return row
    missing = missing_modules(b.wheels, env)
    if missing:
        row["status"] = f"skipped: {', '.join(missing)} not importable (carry its wheel: --wheels)"
        return row
    absent = missing_modules(b.optional, env)
    out = out_dir / name
    work = work_root / name
    clear_scratch(work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    values = {"python": sys.executable, "out": str(out), "work": str(work),
              "anchor": os.path.abspath(args.anchor) if args.anchor else "",
              "fla_tuning": str(out / "fla_autotune.tgz")}
    if any("{fla_tuning}" in a for c in (*b.prepare, *b.commands)
           for a in (*c.argv, *dict(c.env).values())):
        shutil.copy(REPO / FLA_TUNING, values["fla_tuning"])
    print(f"[run] {name}: {b.what}", flush=True)
    if absent:
        print(f"[run] {name}: without {', '.join(absent)} (its columns stay empty)", flush=True)
    with open(out / "log.txt", "a") as log:
        left = deadline - time.monotonic()
        if b.prepare and left >= MIN_START_S:
            for cmd in b.prepare:
                print(f"[run]   $ {command_line(cmd, values)} &", flush=True)
            done = run_together(b.prepare, values, env, log,
                                [min(args.timeout_s or c.timeout_s, left) for c in b.prepare])
            row["seconds"] += max(seconds for _, seconds in done)
            failed = [rc for rc, _ in done if rc != 0]
            if failed:  # the measured commands run all the same, compiling what they lack
                row["status"] = "prepare: " + (f"exit {failed[0]}" if isinstance(failed[0], int)
                                               else failed[0])
        for cmd in b.commands:
            left = deadline - time.monotonic()
            if left < MIN_START_S:
                row["status"] = f"stopped: --budget_s spent before {cmd.argv[1]}"
                break
            limit = min(args.timeout_s or cmd.timeout_s, left)
            print(f"[run]   $ {command_line(cmd, values)}", flush=True)
            rc, seconds = run_command(cmd, values, env, log, limit)
            row["seconds"] += seconds
            if rc != 0 and row["status"] == "ok":
                row["status"] = f"exit {rc}" if isinstance(rc, int) else rc
    row["files"] = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    print(f"[run] {name}: {row['status']} ({row['seconds']:.0f} s)", flush=True)
    return row


def write_summary(out_dir: Path, rows: list[dict], argv: list[str]) -> str:
    lines = [f"# benchmarks/run.py, {time.strftime('%Y-%m-%d %H:%M:%S')}", "",
             f"Command: `python3 benchmarks/run.py {shlex.join(argv)}`", ""]
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        lines += [f"GPU: {g}" for g in smi.stdout.strip().splitlines()] + [""]
    except (OSError, subprocess.SubprocessError):
        lines += ["GPU: none (no nvidia-smi)", ""]
    lines += ["| benchmark | status | seconds | files |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['seconds']:.0f} | {', '.join(r['files'])} |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    (out_dir / "summary.md").write_text(text)
    return text


def pack(out_dir: Path, names: list[str]) -> Path:
    """Moves the entries' folders into ``out_dir/results.tgz``."""
    path = out_dir / "results.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            if (out_dir / name).exists():
                tar.add(out_dir / name, arcname=name)
    for name in names:
        shutil.rmtree(out_dir / name, ignore_errors=True)
    return path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="benchmarks, groups or 'all'")
    ap.add_argument("--list", action="store_true", help="describe every benchmark and group")
    ap.add_argument("--print", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--out_dir", default="runs/bench", help="one folder per benchmark in it")
    ap.add_argument("--wheels", default="", help="a folder of .whl files to install first")
    ap.add_argument("--anchor", default="", help="the dense anchor script (dense_anchor)")
    ap.add_argument("--budget_s", type=float, default=0.0,
                    help="seconds for everything (0: no limit but each command's own)")
    ap.add_argument("--timeout_s", type=float, default=0.0,
                    help="each command's limit instead of the registry's")
    ap.add_argument("--pack", action="store_true",
                    help="leave summary.md and results.tgz (the folders) in --out_dir")
    ap.add_argument("--work_dir", default="",
                    help="scratch folders here, each emptied before its entry but for its "
                         "compilation cache (default: a fresh temporary folder)")
    args = ap.parse_args(argv)
    if args.anchor and not os.path.isfile(args.anchor):
        ap.error(f"--anchor: no file {args.anchor!r}")
    if not args.list and not args.names:
        ap.error("name a benchmark, a group or all (--list describes them)")
    return ap, args


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap, args = parse_args(argv)
    if args.list:
        print("\n".join(describe(n) for n in REGISTRY))
        print("\ngroups: " + "; ".join(f"{g}: {', '.join(ns)}" for g, ns in GROUPS.items()))
        print("all: every GPU entry this host has the GPUs for (dense_anchor with --anchor)")
        return []
    try:  # --print: every GPU entry, whatever this host has
        names = select(args.names, 1 << 10 if args.print else visible_gpus(),
                       args.print or bool(args.anchor))
    except ValueError as err:
        ap.error(str(err))
    if args.print:  # {work} shown as a folder under /tmp, {fla_tuning} as the repository's
        values = {"python": "python3", "anchor": args.anchor or "PATH/TO/dense_anchor.py",
                  "fla_tuning": FLA_TUNING}
        for name in names:
            b = REGISTRY[name]
            filled = {**values, "out": f"{args.out_dir}/{name}",
                      "work": f"{args.work_dir or '/tmp/bench_work'}/{name}"}
            print(f"# {name}: {b.what}")
            if b.prepare:
                print("# started together, each within its limit; then the commands after "
                      "'wait', one at a time")
                print("\n".join(f"{command_line(cmd, filled)} &" for cmd in b.prepare))
                print("wait")
            for cmd in b.commands:
                print(command_line(cmd, filled))
        return []
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    site = tempfile.mkdtemp(prefix="bench_site_") if args.wheels else None
    if args.wheels:
        install_wheels(args.wheels, site)
    env = child_env(site)
    work_root = (Path(args.work_dir).resolve() if args.work_dir
                 else Path(tempfile.mkdtemp(prefix="bench_work_")))
    deadline = time.monotonic() + (args.budget_s or float("inf"))
    print(f"[run] {len(names)} benchmarks: {', '.join(names)}; results in {out_dir}, scratch in "
          f"{work_root}", flush=True)
    rows = []
    for name in names:
        rows.append(run_entry(name, out_dir, work_root, env, args, deadline))
        write_summary(out_dir, rows, argv)  # after every entry: a run cut short keeps it
    if args.pack:
        print(f"[run] packed into {pack(out_dir, names)}", flush=True)
    print(write_summary(out_dir, rows, argv))
    return rows


if __name__ == "__main__":
    main()
