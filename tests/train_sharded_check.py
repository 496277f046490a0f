"""Run by tests/test_train.py in a subprocess with 8 CPU devices (JAX_NUM_CPU_DEVICES=8).

Trains the tiny config for a few steps on one device in 2 micro-batches (gradient
accumulation) and on a (data 2, fsdp 2, tensor 2) mesh in one pass, from the same initial
parameters and batches; prints one JSON line with the losses, the largest parameter difference
to the one-device run, and the partition specs the mesh gave some parameters. (Two runs, not
three: each costs an initialiser and a step compile; the accumulation path is checked against
the sharded one rather than in a run of its own.)
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from kimi_k3 import data as data_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import train_lib
from kimi_k3.trees import path_str
from tests.helpers import load_config

STEPS = 2


def small_tiny():
    """configs/tiny.py at test size."""
    c = load_config("tiny.py")
    c.model.num_layers, c.model.kda_per_mla = 2, 1  # "KM": one KDA, one MLA layer
    c.model.kda.impl = "recurrent"  # the definition; on CPU the fastest at this length
    c.data.seq_len, c.data.global_batch_size = 32, 8
    c.opt.warmup_steps = 1
    # Adam's first steps are nearly sign(g): with eps = 1e-8 a gradient entry of 1e-9 moves
    # its weight by ~lr/10 and a rounding difference in it by as much. A larger eps keeps the
    # update a smooth function of the gradient, so float32 rounding stays at its own size.
    c.opt.eps = 1e-3
    return c


def run(config, mesh_shape, accum, devices, batches):
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
    config.train.microbatch_size = config.data.global_batch_size // accum
    mesh = mesh_lib.make_mesh(config.mesh, devices)
    setup = train_lib.build(config, mesh)
    state = setup.init_state()
    init = jax.device_get(state["params"])
    losses = []
    for b in batches:
        gb = train_lib.global_batch(b, setup.batch_sharding, config.data.global_batch_size)
        with setup.context():
            state, m = setup.train_step(state, gb)
        losses.append(float(m["loss"]))
    specs = {path_str(k): str(v.sharding.spec)
             for k, v in jax.tree_util.tree_leaves_with_path(state["params"])}
    return losses, init, jax.device_get(state["params"]), specs


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b), strict=True))


def main():
    assert jax.device_count() == 8, jax.devices()
    config = small_tiny()
    train, _ = data_lib.load_split_streams(config.data, config.model.vocab_size)
    rows = data_lib.PackedRows(train, config.data.seq_len, seed=0)
    it = data_lib.BatchIterator(rows, config.data.global_batch_size, (0, 8))
    batches = [next(it) for _ in range(STEPS)]
    one = run(config, (1, 1, 1), 2, jax.devices()[:1], batches)
    out = {"single_loss": one[0]}
    r = run(config, (2, 2, 2), 1, jax.devices(), batches)
    out["sharded_loss"] = r[0]
    out["sharded_init_diff"] = max_diff(one[1], r[1])
    out["sharded_param_diff"] = max_diff(one[2], r[2])
    out["specs"] = r[3]
    out["param_scale"] = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(one[2]))
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
