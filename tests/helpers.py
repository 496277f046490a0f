"""What several test modules share: the repository's configs, fast compiles for small programs,
the tiny models and KDA inputs, subprocess environments, reading a run's outputs, and a fake
device probe. Test modules import from here, never from each other."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from kimi_k3 import config_files
from kimi_k3.config import add_training_defaults, default_model_config
from kimi_k3.model import HybridLM
from kimi_k3.runtime import RUN_ONCE_COMPILER_OPTIONS, jax_setting
from pallas_kernels import device
from tests.xla_flags import SUBPROCESS_XLA_FLAGS

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def load_config(spec: str) -> ml_collections.ConfigDict:
    """``kimi_k3.config_files.load_config`` with a bare file name (``"tiny.py:arg"``) taken
    from the repository's configs/ folder."""
    path, sep, arg = os.fspath(spec).partition(":")
    if os.sep not in path and not Path(path).is_file():
        path = os.fspath((CONFIGS / path).with_suffix(".py"))
    return config_files.load_config(path + sep + arg)


# ---------------------------------------------------------------------------------------------
# Compiling small programs
# ---------------------------------------------------------------------------------------------

# The tests' small in-process programs are compiled far more often than they run long: with
# XLA's CPU backend optimisations off (the options the library compiles its run-once programs
# with) they compile in a third to a half less time, and every float32 tolerance holds. Not
# for programs that run many steps (training loops): those run several times slower.
FAST_COMPILE = RUN_ONCE_COMPILER_OPTIONS

# jax.jit with FAST_COMPILE (static arguments etc. as keywords, like jax.jit).
fast_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


@contextlib.contextmanager
def run_once_compiles():
    """Inside, every program compiles with FAST_COMPILE's optimisations off, however it is
    jitted (the library's own jits too: ``train_lib.build``'s step, which takes no compiler
    options): for a test that runs a library program once or twice. Not around training loops."""
    with jax_setting("jax_disable_most_optimizations", True):
        yield


def env(cache: str, devices: int = 1, xla_flags: str = SUBPROCESS_XLA_FLAGS) -> dict:
    """The environment of a CPU subprocess with ``devices`` devices, sharing the session's
    compilation cache, with ``xla_flags`` (tests/xla_flags.py)."""
    e = dict(os.environ)
    e.update(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(devices),
        XLA_FLAGS=xla_flags,
        JAX_COMPILATION_CACHE_DIR=cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=str(REPO),
    )
    e.pop("JAX_COORDINATOR_ADDRESS", None)
    return e


# ---------------------------------------------------------------------------------------------
# Tiny models and inputs
# ---------------------------------------------------------------------------------------------


def tiny_config(pattern: str = "KKM", vocab: int = 64) -> ml_collections.ConfigDict:
    """A run config whose model is a few layers of width 32 (``pattern``), heads of 16."""
    c = ml_collections.ConfigDict()
    m = default_model_config()
    m.vocab_size, m.d_model, m.pattern, m.num_layers = vocab, 32, pattern, len(pattern)
    m.num_heads, m.kda.head_dim, m.kda.chunk_size = 2, 16, 16
    m.mla.num_heads, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim = 2, 16, 16
    m.mla.shared_head_dim, m.mla.v_head_dim, m.mla.attn_block_size = 8, 16, 16
    m.mlp_dim, m.attn_res_block_size = 64, 2
    c.model = m
    return add_training_defaults(c)


def build(model_cfg, seed: int) -> HybridLM:
    """A HybridLM with its initialiser's random weights, drawn with rbg keys in one jitted
    program (the seed traced: one compile per config): the initialiser op by op with threefry
    keys spends far longer in XLA:CPU compiles."""
    key = model_cfg.to_json_best_effort(sort_keys=True)
    if key not in _INITIALISERS:
        make = lambda s: HybridLM(model_cfg, rngs=nnx.Rngs(jax.random.key(s, impl="rbg")))
        _INITIALISERS[key] = (fast_jit(lambda s: nnx.state(make(s))),
                              nnx.graphdef(nnx.eval_shape(make, 0)))
    init, graphdef = _INITIALISERS[key]
    return nnx.merge(graphdef, init(jnp.int32(seed)))


_INITIALISERS = {}  # a model config (as JSON) -> (its jitted initialiser, its graphdef)


def make_inputs(rng, B=2, T=100, H=2, HV=4, K=16, V=8, gate="normal", dtype=np.float32):
    """Random KDA inputs: L2-normalised q, k (as the layer makes them), gates in the bounded
    range, or extreme gates (some channels near -1000 per step, the rest near 0)."""
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V))
    if gate == "normal":
        g = -5.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV, K)) - 2.0))
    else:
        g = -rng.uniform(1e-6, 1e-3, (B, T, HV, K))
        fast = rng.random(K) < 0.5
        g[..., fast] = -rng.uniform(900.0, 1100.0, (B, T, HV, int(fast.sum())))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV))))
    arrs = [x.astype(np.float32) for x in (q, k, v, g, beta)]
    if dtype != np.float32:
        arrs = [jnp.asarray(x, dtype) for x in arrs[:3]] + [jnp.asarray(x) for x in arrs[3:]]
    return [jnp.asarray(x) for x in arrs]


# ---------------------------------------------------------------------------------------------
# Runs of train.py
# ---------------------------------------------------------------------------------------------

# configs/tiny.py at test size: layers "KM" (one KDA, one MLA), 32-token rows, no held-out
# split (no eval compile), a constant lr after warmup (so runs of different lengths agree), and
# KDA's recurrent form, the definition, which is the fastest on a CPU at this length.
TINY = [
    "--config=configs/tiny.py",
    "--config.model.num_layers=2",
    "--config.model.kda_per_mla=1",
    "--config.model.kda.impl=recurrent",
    "--config.data.seq_len=32",
    "--config.data.global_batch_size=4",
    "--config.data.eval_fraction=0.0",
    "--config.opt.schedule=constant",
    "--config.opt.warmup_steps=2",
    "--config.train.log_every=1",
    "--config.train.progress_bar=False",
    "--config.train.tensorboard=False",
]


def losses(workdir) -> dict[int, float]:
    """step -> train loss from metrics.jsonl ({} before it exists; a line still being written
    is left for the next read)."""
    path = Path(workdir) / "metrics.jsonl"
    out = {}
    if path.exists():
        for line in path.read_text().splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            r = json.loads(line)
            if r["split"] == "train":
                out[r["step"]] = r["loss"]
    return out


def ckpt_steps(workdir) -> list[int]:
    """The steps saved under ``workdir/checkpoints``, in order."""
    d = Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


# ---------------------------------------------------------------------------------------------
# The device probe
# ---------------------------------------------------------------------------------------------


def fake_device(monkeypatch, platform: str = "gpu", **fields) -> None:
    """``pallas_kernels.device.probe`` answers for ``platform`` with ``fields`` changed (e.g.
    ``triton=False``: a JAX without Pallas-Triton); other platforms as probed."""
    real = device.probe

    def probe(asked=None):
        found = real(asked)
        return dataclasses.replace(found, **fields) if found.platform == platform else found

    monkeypatch.setattr(device, "probe", probe)
