"""Run by tests/test_aot.py in a subprocess with 4 CPU devices (JAX_NUM_CPU_DEVICES=4).

A "KM" model (one KDA layer, one MLA layer) whose KDA runs the Pallas kernel and whose MLA
attention runs splash attention, both in interpret mode, on a mesh of data 2 x tensor 2 (rows
and heads split) against the same model without a mesh: the loss and the gradient of every
parameter, from random tokens drawn from the seed in argv[1]. On the mesh every kernel call
must sit inside a ``shard_map`` (``sharding.per_device``): the compiler cannot partition a
kernel, and Mosaic refuses to. Prints one line "RESULT {json}".
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kimi_k3 import mesh as mesh_lib
from kimi_k3 import sharding
from kimi_k3.config import run_spec
from kimi_k3.model_state import make_model, merge_model, split_model
from tests.helpers import load_config

B, T = 4, 128  # splash takes whole blocks of 128 tokens


def config():
    c = load_config("tiny.py")
    c.model.num_layers, c.model.kda_per_mla = 2, 1  # "KM"
    c.model.kda.impl, c.model.mla.attn_impl = "pallas", "pallas"  # interpret mode on the CPU
    c.data.seq_len, c.data.global_batch_size = T, B
    c.mesh.data, c.mesh.tensor = 2, 2
    return c


def sub_jaxprs(value):
    """The jaxprs an equation's parameter holds (a jaxpr, a closed one, or a sequence)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for v in value:
            yield from sub_jaxprs(v)


def kernel_calls(jaxpr, inside: bool = False) -> list[bool]:
    """For every pallas_call of ``jaxpr`` (its sub-jaxprs too): whether a shard_map holds it."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(inside)
            continue
        for sub in (j for v in eqn.params.values() for j in sub_jaxprs(v)):
            out += kernel_calls(sub, inside or eqn.primitive.name == "shard_map")
    return out


def main(seed: int) -> dict:
    spec = run_spec(config())
    graphdef, params, rest = split_model(make_model(spec.model, 0))
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, spec.model.vocab_size, (B, T)), jnp.int32)
    segs = jnp.asarray(np.repeat([[1] * (T // 2) + [2] * (T // 2)], B, 0), jnp.int32)

    def loss(params, tokens, segs):
        model = merge_model(graphdef, params, rest)
        nll, _ = model.token_nll(tokens, jnp.roll(tokens, -1, axis=1), segs)
        return nll.mean()

    grad = jax.jit(jax.value_and_grad(loss))
    one_loss, one_grads = grad(params, tokens, segs)
    mesh = mesh_lib.make_mesh(spec.mesh)
    rules = sharding.make_rules(mesh, spec.mesh.axis_rules)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        calls_mesh = kernel_calls(jax.make_jaxpr(grad)(params, tokens, segs).jaxpr)
        placed = jax.device_put((tokens, segs), mesh_lib.batch_sharding(mesh))
        mesh_loss, mesh_grads = grad(params, *placed)
    calls_one = kernel_calls(jax.make_jaxpr(grad)(params, tokens, segs).jaxpr)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-12)),
                        one_grads, mesh_grads)
    return {"loss": [float(one_loss), float(mesh_loss)],
            "grad_rel": max(jax.tree.leaves(diff)),
            "kernels_mesh": calls_mesh, "kernels_one": calls_one}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(int(sys.argv[1]))))
