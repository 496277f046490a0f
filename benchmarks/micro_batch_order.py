r"""MLA attention over a config's real global batches, micro-batch by micro-batch, in the rows'
given order and in the training step's order (``train_lib.micro_batch_order``: each device's
rows with fewer documents first): the share of micro-batches whose rows are each one document
(the ones cuDNN runs as plain causal attention) and the attention's forward+backward ms per
global step, one layer.

    python benchmarks/micro_batch_order.py --config=configs/1b.py --microbatch_size=4
    python benchmarks/micro_batch_order.py --config=configs/tiny.py --microbatch_size=2 \
        --seq=64 --steps=2 --impl=xla                                  # CPU smoke run

The rows come from the config's data (the stdlib corpus by default), ``--steps`` global batches
of ``data.global_batch_size`` rows from the start; q, k, v are random with the MLA layer's
shapes (``--heads``, head dims 192 / 128). Only the segment ids change between the two orders,
so the difference is what the order saves per MLA layer; the whole step saves it once per MLA
layer (configs/1b.py: 5).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import timing
from kimi_k3 import data as data_lib
from kimi_k3 import train_lib
from kimi_k3.config_files import load_config
from kimi_k3.layers.attention import attention, documents_per_row

REPO = Path(__file__).resolve().parents[1]


def global_batches(config, steps: int, seq: int) -> list[np.ndarray]:
    """The segment ids [B, seq] of the first ``steps`` global batches of the config's data."""
    train, _ = data_lib.load_split_streams(config.data, config.model.vocab_size)
    rows = data_lib.PackedRows(train, seq, config.seed, config.data.shuffle)  # as train.py
    B = config.data.global_batch_size
    return [rows.rows(range(s * B, (s + 1) * B))["segment_ids"] for s in range(steps)]


def orders(segs_BxT: np.ndarray, accum: int) -> dict[str, np.ndarray]:
    """{"given": the rows' own order, "step": the training step's}: [A, B / A, T] each."""
    segs = jnp.asarray(segs_BxT)
    given = jnp.tile(jnp.arange(accum, dtype=jnp.int32), (segs.shape[0] // accum, 1))
    return {"given": np.asarray(train_lib.micro_batches(segs, given)),
            "step": np.asarray(train_lib.micro_batches(
                segs, train_lib.micro_batch_order(segs, accum)))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/1b.py")
    ap.add_argument("--microbatch_size", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--steps", type=int, default=4, help="global batches timed")
    ap.add_argument("--seq", type=int, default=0, help="tokens per row (0: the config's)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--impl", default="auto", help="attention impl (auto: cuDNN on the GPU)")
    ap.add_argument("--reps", type=int, default=3,
                    help="timed passes over the batches (benchmarks/timing.py: the median)")
    a = ap.parse_args(argv)
    path, sep, arg = a.config.partition(":")
    if not Path(path).is_file() and (REPO / path).is_file():  # configs/... from elsewhere
        path = str(REPO / path)
    config = load_config(path + sep + arg)
    B, T = config.data.global_batch_size, a.seq or config.data.seq_len
    if a.microbatch_size <= 0 or B % a.microbatch_size:
        ap.error(f"--microbatch_size must divide data.global_batch_size={B}, got "
                 f"{a.microbatch_size}")
    for name in ("steps", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    accum = B // a.microbatch_size
    batches = global_batches(config, a.steps, T)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    rng = np.random.default_rng(0)
    m, H = a.microbatch_size, a.heads
    q, k = (jnp.asarray(rng.standard_normal((m, T, H, 192)), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((m, T, H, 128)), dtype)
    w = jnp.asarray(rng.standard_normal((m, T, H, 128)), jnp.float32)

    def loss(q, k, v, seg):
        o = attention(q, k, v, scale=192 ** -0.5, segment_ids=seg, impl=a.impl)
        return jnp.sum(o.astype(jnp.float32) * w)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    per_order = {name: [] for name in ("given", "step")}
    for segs in batches:
        for name, mbs in orders(segs, accum).items():
            per_order[name].extend(jnp.asarray(x) for x in mbs)
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: {a.config}, {a.steps} global "
          f"batches of {B} x {T} in micro-batches of {m} rows, {H} heads, impl={a.impl}",
          flush=True)
    print("| order | micro-batches of one document per row | attention fwd+bwd ms per step |")
    print("|---|---|---|")
    for name, mbs in per_order.items():
        one_doc = np.mean([int(jnp.max(documents_per_row(s))) == 1 for s in mbs])
        for s in mbs:  # every branch compiled, each kind of batch run once
            jax.block_until_ready(step(q, k, v, s))

        def one_pass(mbs=mbs):  # every micro-batch back to back; the last one's outputs
            out = None
            for s in mbs:
                out = step(q, k, v, s)
            return out

        t = timing.time_jax(one_pass, warmup=0, calls=1, batches=a.reps)
        ms = t.ms / a.steps
        print(f"| {name} | {one_doc:.1%} | {ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
