"""Run by tests/test_moe.py in a subprocess with 8 CPU devices (JAX_NUM_CPU_DEVICES=8).

1. The MoE layer on meshes (data, fsdp, expert, tensor) = (1, 1, 8, 1) and (1, 2, 2, 2) against
   the layer on one device without a mesh: outputs and gradients of the input and every
   weight, dropless and with capacity buffers (a factor at which nothing can drop); and on
   (2, 1, 4, 1) with rules under which the expert axis does not split the tokens ("psum"
   dispatch); LatentMoE's layer on (1, 2, 2, 2). Rules that split the tokens over some expert
   axes only are refused. The "ragged" exchange (``ragged_errors``) on fresh random inputs of
   the seed in argv[2] (else a random one, printed in the result).
2. A small HybridLM with MoE FFNs ("MMM": a dense first layer, then two scanned MoE layers)
   through train_lib: 8 steps on one device in 2 micro-batches (the loss falls), then 3 steps
   from the same initial state on the (1, 2, 2, 2) mesh in one pass; their losses, parameters
   and routing biases (the loads of micro-batches add up to the batch's); the biases saved and
   restored by the Checkpointer.

Prints one line "RESULT {json}".
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import model_state as model_state_lib
from kimi_k3 import sharding, train_lib
from kimi_k3.config import DEFAULT_RULES, MoeSpec, add_training_defaults, default_model_config
from kimi_k3.layers.moe import WI_NAMES, MoE
from kimi_k3.model import HybridLM
from kimi_k3.trees import path_str

MESHES = {"expert8": (1, 1, 8, 1), "fsdp2_expert2_tensor2": (1, 2, 2, 2)}


def mesh_of(sizes, devices=None):
    cfg = ml_collections.ConfigDict(dict(zip(("data", "fsdp", "expert", "tensor"), sizes,
                                             strict=True)))
    return mesh_lib.make_mesh(cfg, devices)


def layer_errors() -> dict:
    """Largest relative difference (outputs and gradients) to the one-device layer, per mode and
    mesh. Capacity buffers of C = n (a factor of E / k) cannot drop: they must equal dropless."""
    spec = MoeSpec(num_experts=8, top_k=3, expert_dim=12, num_shared=1, shared_dim=12,
                   renormalize=True, routed_scaling_factor=2.446, n_group=2, topk_group=2,
                   first_k_dense=0, router_float32=True, bias_update_rate=0.0,
                   balance_loss_coef=0.0, capacity_factor=0.0)
    B, T, D = 8, 4, 16
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    R = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    layer = nnx.jit(lambda: MoE(D, spec, rngs=nnx.Rngs(jax.random.key(1, impl="rbg"))))()
    layer.bias[...] = jnp.asarray(rng.normal(size=8) * 0.1, jnp.float32)
    _, params, rest = nnx.split(layer, nnx.Param, ...)

    def run(spec):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: MoE(D, spec, rngs=nnx.Rngs(0))))

        @jax.jit
        def grads(params, rest, x):
            def loss(params, x):
                y = nnx.merge(graphdef, params, rest, copy=True)(x)
                return jnp.sum(y * R), y
            (_, y), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
            return y, g

        return jax.device_get(grads(params, rest, x))

    want = run(spec)
    out = {}
    # Tokens split over data and fsdp only: the experts' devices share them.
    psum_rules = tuple((n, ("data", "fsdp") if n == "activation_batch" else a)
                       for n, a in DEFAULT_RULES)
    cases = [("dropless", spec, name, sizes, DEFAULT_RULES) for name, sizes in MESHES.items()]
    cases += [("capacity", dataclasses.replace(spec, capacity_factor=8 / 3),
               "fsdp2_expert2_tensor2", MESHES["fsdp2_expert2_tensor2"], DEFAULT_RULES),
              ("dropless", spec, "expert4_not_splitting_tokens", (2, 1, 4, 1), psum_rules),
              ("dense", dataclasses.replace(spec, expert_matmul="dense"),
               "expert4_not_splitting_tokens", (2, 1, 4, 1), psum_rules)]
    wants = {id(spec): want}
    # The blocked kernels (interpret mode here) against the one-device sorted form, on experts
    # of width 16 (the kernels' tiles), with tokens moving to their experts and shared by them.
    blocked = dataclasses.replace(spec, expert_dim=16, shared_dim=16, expert_matmul="blocked")
    layer_b = nnx.jit(lambda: MoE(D, blocked, rngs=nnx.Rngs(jax.random.key(2, impl="rbg"))))()
    _, params_b, rest_b = nnx.split(layer_b, nnx.Param, ...)
    cases += [("blocked", blocked, "expert8", MESHES["expert8"], DEFAULT_RULES),
              ("blocked", blocked, "expert4_not_splitting_tokens", (2, 1, 4, 1), psum_rules)]
    # LatentMoE: the experts (width 10, split over fsdp as "embed") on the latent tokens.
    latent = dataclasses.replace(spec, latent_dim=10)
    layer_l = nnx.jit(lambda: MoE(D, latent, rngs=nnx.Rngs(jax.random.key(3, impl="rbg"))))()
    _, params_l, rest_l = nnx.split(layer_l, nnx.Param, ...)
    cases += [("latent", latent, "fsdp2_expert2_tensor2", MESHES["fsdp2_expert2_tensor2"],
               DEFAULT_RULES)]
    for mode, s, name, sizes, rules in cases:
        if mode in ("blocked", "latent"):
            params, rest = (params_b, rest_b) if mode == "blocked" else (params_l, rest_l)
            if id(s) not in wants:
                wants[id(s)] = run(dataclasses.replace(s, expert_matmul="ragged"))
        mesh = mesh_of(sizes)
        with jax.set_mesh(mesh), sharding.axis_rules(sharding.make_rules(mesh, rules)):
            got = run(s)
        out[f"{mode}/{name}"] = max(
            float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(wants.get(id(s), want)),
                            strict=True))
    return out


def ragged_errors(seed: int) -> dict:
    """ep_exchange="ragged" (ragged_all_to_all, here through its CPU reference): largest
    relative difference of outputs and gradients (input and weights) to the one-device layer
    and, on two meshes, to the "all_tokens" exchange on the same mesh; fresh random inputs and
    weights of odd sizes. "skewed": every token's choices on the first device's experts (its
    receive buffer full); "blocked": the experts' Pallas kernels on the received rows."""
    rng = np.random.default_rng(seed)
    base = MoeSpec(num_experts=8, top_k=3, expert_dim=7, num_shared=1, shared_dim=5,
                   renormalize=True, routed_scaling_factor=2.446, n_group=2, topk_group=2,
                   first_k_dense=0, router_float32=True, bias_update_rate=0.0,
                   balance_loss_coef=0.0, capacity_factor=0.0, ep_exchange="ragged")
    # (name, spec, mesh sizes, B, T, D, bias added to device 0's experts, against all_tokens)
    cases = [("expert8", base, (1, 1, 8, 1), 8, 5, 13, 0.0, True),
             ("fsdp2_expert2_tensor2", dataclasses.replace(base, expert_dim=6), (1, 2, 2, 2),
              4, 7, 10, 0.0, False),
             ("skewed_expert4", dataclasses.replace(base, top_k=2, n_group=1, topk_group=1),
              (2, 1, 4, 1), 8, 3, 11, 10.0, True),
             # the blocked kernels (interpret mode) on the received rows: widths of 16
             ("blocked_expert8", dataclasses.replace(base, expert_dim=16, shared_dim=16,
                                                     expert_matmul="blocked"),
              (1, 1, 8, 1), 8, 3, 16, 0.0, False)]
    out = {}
    for name, spec, sizes, B, T, D, skew, against_all_tokens in cases:
        layer = nnx.jit(lambda spec=spec, D=D: MoE(
            D, spec, rngs=nnx.Rngs(jax.random.key(int(rng.integers(2**31)), impl="rbg"))))()
        E_l = spec.num_experts // sizes[2]
        bias = rng.normal(size=spec.num_experts) * 0.1 + skew * (np.arange(8) < E_l)
        layer.bias[...] = jnp.asarray(bias, jnp.float32)
        _, params, rest = nnx.split(layer, nnx.Param, ...)
        x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
        R = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)

        def run(s, D=D, params=params, rest=rest, x=x, R=R):
            graphdef = nnx.graphdef(nnx.eval_shape(lambda: MoE(D, s, rngs=nnx.Rngs(0))))

            @jax.jit
            def grads(params, x):
                def loss(params, x):
                    y = nnx.merge(graphdef, params, rest, copy=True)(x)
                    return jnp.sum(y * R), y
                (_, y), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
                return y, g

            return jax.device_get(grads(params, x))

        rel = lambda a, b: max(float(np.abs(u - v).max() / max(np.abs(v).max(), 1e-6))
                               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
        one = run(dataclasses.replace(spec, expert_matmul="ragged"))
        mesh = mesh_of(sizes)
        with jax.set_mesh(mesh), sharding.axis_rules(sharding.make_rules(mesh, DEFAULT_RULES)):
            ragged = run(spec)
            out[f"{name}/one_device"] = rel(ragged, one)
            if against_all_tokens:
                out[f"{name}/all_tokens"] = rel(
                    ragged, run(dataclasses.replace(spec, ep_exchange="all_tokens")))
    return out


def mixed_rules_error() -> str:
    """The error for experts split over "expert" (a token axis) and "tensor" (not one)."""
    mesh = mesh_of((1, 1, 2, 4))
    split = {"expert": ("expert", "tensor"), "mlp": None}
    rules = tuple((n, split.get(n, a)) for n, a in DEFAULT_RULES)
    try:
        with jax.set_mesh(mesh), sharding.axis_rules(sharding.make_rules(mesh, rules)):
            sharding.expert_layout(WI_NAMES)
    except ValueError as e:
        return str(e)
    return ""


def model_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    m = c.model = default_model_config()
    m.vocab_size, m.d_model, m.num_layers, m.kda_per_mla = 64, 32, 3, 0  # "MMM"
    m.mla.num_heads, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim = 2, 16, 8
    m.mla.shared_head_dim, m.mla.v_head_dim = 4, 8
    m.mlp_dim, m.attn_res = 64, "none"  # plain residuals: a faster compile
    m.moe.num_experts, m.moe.top_k, m.moe.expert_dim, m.moe.num_shared = 8, 2, 16, 1
    m.moe.first_k_dense = 1  # "M" unrolled, then "M" x 2 scanned
    m.moe.bias_update_rate = 0.01
    add_training_defaults(c)
    c.data.seq_len, c.data.global_batch_size = 16, 8
    c.opt.lr, c.opt.warmup_steps, c.opt.schedule = 1e-2, 1, "constant"
    c.opt.eps = 1e-3  # keeps Adam's first updates smooth in the gradient (train_sharded_check)
    return c


def batches(n):
    """Rows counting up by a per-row stride from a random start: learnable in a few steps."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        start, stride = rng.integers(0, 64, (8, 1)), rng.integers(1, 4, (8, 1))
        toks = ((start + stride * np.arange(16)) % 64).astype(np.int32)
        out.append({"tokens": toks, "segment_ids": np.ones((8, 16), np.int32)})
    return out


def initial_state(config, setup):
    """The train state the trainer's initialiser would make, drawn with rbg keys: XLA:CPU
    compiles those initialisers far faster than threefry's."""
    model = nnx.jit(lambda: HybridLM(config.model, rngs=nnx.Rngs(jax.random.key(0, impl="rbg"))))()
    _, params, model_state, _ = model_state_lib.split_for_training(model)
    return {"params": params, "opt_state": setup.tx.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(1)), "model_state": model_state}


def train(config, mesh, state, data, microbatch):
    config.train.microbatch_size = microbatch
    setup = train_lib.build(config, mesh)
    state = jax.device_put(state or initial_state(config, setup), setup.state_shardings)
    init, losses, states = jax.device_get(state), [], []
    for b in data:
        with setup.context():
            state, m = setup.train_step(state, train_lib.global_batch(b, setup.batch_sharding, 8))
        losses.append(float(m["loss"]))
        states.append(jax.device_get(state))
    return setup, init, losses, states, state


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                             strict=True))


def main():
    assert jax.device_count() == 8, jax.devices()
    out = {"layer": layer_errors(), "mixed_rules_error": mixed_rules_error()}
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else int.from_bytes(os.urandom(4), "little")
    out["ragged"], out["ragged_seed"] = ragged_errors(seed), seed
    config, data = model_config(), batches(8)
    _, init, losses, states, _ = train(config, mesh_of((1, 1, 1, 1), jax.devices()[:1]), None,
                                       data, microbatch=4)
    out["single_losses"] = losses
    setup, _, sharded, sharded_states, last = train(config, mesh_of((1, 2, 2, 2)), init, data[:3],
                                                    microbatch=8)
    out["sharded_losses"] = sharded
    out["param_diff"] = max_diff(sharded_states[-1]["params"], states[2]["params"])
    out["bias_diff"] = max_diff(sharded_states[-1]["model_state"], states[2]["model_state"])
    out["bias_moved"] = max(float(np.abs(b).max())
                            for b in jax.tree.leaves(states[-1]["model_state"]))
    out["specs"] = {path_str(k).rsplit("/", 1)[-1]: str(v.sharding.spec)
                    for k, v in jax.tree_util.tree_leaves_with_path(last["params"])
                    if "experts" in path_str(k)}
    ck = ckpt_lib.Checkpointer(sys.argv[1], ml_collections.ConfigDict(
        dict(every_steps=1, keep=1, async_save=False)))
    ck.save(3, last, {"position": 0})
    _, restored, _ = ck.restore(setup.abstract_state)
    ck.close()
    out["restored_bias_diff"] = max_diff(restored["model_state"], sharded_states[-1]["model_state"])
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
