"""Run in a subprocess with 8 CPU devices by tests/test_plan.py: for small configs under data,
fsdp, tensor, context and expert meshes, the planner's per-device estimate (less its runtime
reserve) against XLA's compiled memory analysis of the real train step (arguments + outputs -
aliased + temporaries), and its state bytes against the real shardings'. Prints one JSON line
per case."""

import json
import math
import sys

import jax
import jax.numpy as jnp
from absl import logging

from kimi_k3 import mesh as mesh_lib
from kimi_k3 import plan, train_lib
from kimi_k3.config_files import load_config

CASES = {
    "data": ("tiny.py", dict(data=8), {}),
    "fsdp": ("tiny.py", dict(fsdp=8), {}),
    "fsdp_tensor": ("tiny.py", dict(fsdp=2, tensor=4), {}),
    "fsdp_context": ("tiny.py", dict(fsdp=2, context=4), {"data.seq_len": 512}),
    "fsdp_expert": ("moe_tiny.py", dict(fsdp=2, expert=4), {}),
    "fsdp_micro_full": ("tiny.py", dict(fsdp=8), {"data.global_batch_size": 32,
                                                   "train.microbatch_size": 16,
                                                   "model.remat": "full"}),
}


def config_of(name: str):
    file, mesh, fields = CASES[name]
    config = load_config(f"configs/{file}")
    fields = {"data.global_batch_size": 16, **fields,
              **{f"mesh.{a}": mesh.get(a, 1) for a in ("data", "fsdp", "expert", "context",
                                                       "tensor")}}
    for dotted, value in fields.items():
        section, leaf = dotted.split(".")
        config[section][leaf] = value
    return config


def check(name: str) -> dict:
    config = config_of(name)
    mesh = mesh_lib.make_mesh(config.mesh)
    sizes = dict(mesh.shape)
    setup = train_lib.build(config, mesh)
    tokens = jax.ShapeDtypeStruct((config.data.global_batch_size, config.data.seq_len),
                                  jnp.int32, sharding=setup.batch_sharding)
    with setup.context():
        ma = setup.train_step.lower(setup.abstract_state, {"tokens": tokens,
                                                           "segment_ids": tokens}
                                    ).compile().memory_analysis()
    xla = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
           + ma.temp_size_in_bytes)
    estimate = plan.memory_plan(config, sizes, setup.microbatch_size, plan.DEVICES["cpu"])
    real = {k: sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(v))
            for k, v in setup.abstract_state.items()}
    st = plan.state_bytes(setup.spec, sizes)
    return {"case": name, "xla": xla, "estimate": estimate.total - plan.RESERVE_BYTES,
            "params": [st.params, real["params"]], "opt_state": [st.opt_state,
                                                                  real["opt_state"]]}


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    for name in sys.argv[1:] or CASES:
        print("PLAN " + json.dumps(check(name)), flush=True)
