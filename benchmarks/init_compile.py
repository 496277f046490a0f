"""Compile time of a model's initialiser: scanned against unrolled layers, and XLA's compiler
options for a run-once program.

    python benchmarks/init_compile.py --config=configs/1b.py
    python benchmarks/init_compile.py --config=configs/1b.py --options   # on the GPU

By default, for ``model.scan_layers`` True and False: seconds to trace + lower and to compile
``jax.jit(lambda: nnx.state(HybridLM(spec, rngs=nnx.Rngs(0))))`` on the default backend
(nothing runs). An unrolled stack builds its repeating unit under ``nnx.vmap`` and cuts it
into layers (``kimi_k3.model._unrolled_layers``), so its initialiser should compile about as
fast as the scanned one's.

With ``--options``: the config's own layers, compiled with XLA's defaults and with each set of
``INIT_OPTION_SETS`` (the persistent compilation cache off, so every compile is cold), each
run once; the table gives the compile and run seconds and how far each set's weights are from
the defaults' (largest |difference| over the largest |weight|, and the share of weights that
differ at all): a run-once program may trade kernel speed for compile time, never values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import timing
from kimi_k3.config import model_spec
from kimi_k3.model import HybridLM
from kimi_k3.runtime import RUN_ONCE_COMPILER_OPTIONS, run_once_compiler_options

config_flags.DEFINE_config_file("config", "configs/1b.py", "Config file.", lock_config=False)
flags.DEFINE_bool("options", False, "Compare XLA compiler options instead of scan / unrolled.")
FLAGS = flags.FLAGS

# The trainer's (LLVM without its optimisations), then ptxas at -O0 on top (GPU only).
INIT_OPTION_SETS = {
    "llvm O0": RUN_ONCE_COMPILER_OPTIONS,
    "llvm O0 + ptxas O0": {**RUN_ONCE_COMPILER_OPTIONS,
                           "xla_gpu_disable_gpuasm_optimizations": True},
}


def _initialiser(model_cfg, scan_layers: bool | None = None):
    model_cfg = model_cfg.copy_and_resolve_references()
    if scan_layers is not None:
        model_cfg.scan_layers = scan_layers
    spec = model_spec(model_cfg)
    return jax.jit(lambda: nnx.to_pure_dict(nnx.state(HybridLM(spec, rngs=nnx.Rngs(0)))))


def init_compile_seconds(model_cfg, scan_layers: bool) -> tuple[float, float]:
    """(trace + lower, compile) seconds of the initialiser with ``scan_layers``."""
    init = _initialiser(model_cfg, scan_layers)
    with timing.stopwatch() as lowering:
        lowered = init.lower()
    with timing.stopwatch() as compiling:
        lowered.compile()
    return lowering.seconds, compiling.seconds


def compare_options(model_cfg) -> None:
    """The ``--options`` table (see the module docstring)."""
    jax.config.update("jax_enable_compilation_cache", False)
    lowered = _initialiser(model_cfg).lower()
    platform = jax.devices()[0].platform
    print(f"the trainer's choice on {platform}: {run_once_compiler_options(platform)}")
    print("| compiler options | compile s | run s | max diff / max weight | weights that differ |")
    print("|---|---|---|---|---|")
    reference = None
    for name, options in {"XLA defaults": None, **INIT_OPTION_SETS}.items():
        with timing.stopwatch() as compiling:
            compiled = lowered.compile(options)
        with timing.stopwatch() as running:
            leaves = [np.asarray(x) for x in jax.tree.leaves(jax.block_until_ready(compiled()))]
        if reference is None:
            reference, diff = leaves, "(reference)"
        else:
            scale = max(float(np.max(np.abs(r))) for r in reference)
            worst = max(float(np.max(np.abs(a.astype(np.float64) - r))) for a, r
                        in zip(leaves, reference, strict=True))
            differ = sum(int(np.sum(a != r)) for a, r in zip(leaves, reference, strict=True))
            diff = f"{worst / scale:.1e} | {differ / sum(r.size for r in reference):.1e}"
        diff = diff if "|" in diff else f"{diff} | "
        print(f"| {name} | {compiling.seconds:.1f} | {running.seconds:.1f} | {diff} |", flush=True)
        del leaves


def main(argv):
    del argv
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: the initialiser of "
          f"{sys.argv[1:]}")
    if FLAGS.options:
        compare_options(FLAGS.config.model)
        return
    print("| layers | trace + lower s | compile s |\n|---|---|---|")
    for scan in (True, False):
        lower_s, compile_s = init_compile_seconds(FLAGS.config.model, scan)
        print(f"| {'scanned' if scan else 'unrolled'} | {lower_s:.1f} | {compile_s:.1f} |",
              flush=True)


if __name__ == "__main__":
    app.run(main)
