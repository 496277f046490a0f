"""Compile time of a model's initialiser, scanned against unrolled layers.

    python benchmarks/init_compile.py --config=configs/1b.py

For ``model.scan_layers`` True and False: seconds to trace + lower and to compile
``jax.jit(lambda: nnx.state(HybridLM(spec, rngs=nnx.Rngs(0))))`` on the default backend
(nothing runs). An unrolled stack builds its repeating unit under ``nnx.vmap`` and cuts it
into layers (``kimi_k3.model._unrolled_layers``), so its initialiser should compile about as
fast as the scanned one's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_k3.config import model_spec
from kimi_k3.model import HybridLM

config_flags.DEFINE_config_file("config", "configs/1b.py", "Config file.", lock_config=False)
FLAGS = flags.FLAGS


def init_compile_seconds(model_cfg, scan_layers: bool) -> tuple[float, float]:
    """(trace + lower, compile) seconds of the initialiser with ``scan_layers``."""
    model_cfg = model_cfg.copy_and_resolve_references()
    model_cfg.scan_layers = scan_layers
    spec = model_spec(model_cfg)
    init = jax.jit(lambda: nnx.state(HybridLM(spec, rngs=nnx.Rngs(0))))
    t0 = time.perf_counter()
    lowered = init.lower()
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main(argv):
    del argv
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: the initialiser of "
          f"{sys.argv[1:]}")
    print("| layers | trace + lower s | compile s |\n|---|---|---|")
    for scan in (True, False):
        lower_s, compile_s = init_compile_seconds(FLAGS.config.model, scan)
        print(f"| {'scanned' if scan else 'unrolled'} | {lower_s:.1f} | {compile_s:.1f} |",
              flush=True)


if __name__ == "__main__":
    app.run(main)
