"""The ragged expert-parallel exchange (``model.moe.ep_exchange = "ragged"``): the CPU reference of
``ragged_all_to_all`` against a NumPy model of the collective's documented semantics, and the
real collective in the layer compiled for a TPU topology by libtpu. The layer itself, on 8 CPU
devices against one device and the "all_tokens" exchange, is in tests/moe_parallel_check.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kimi_k3 import aot, sharding
from kimi_k3.config import DEFAULT_RULES, MoeSpec
from kimi_k3.layers.moe import MoE
from kimi_k3.ops.ragged_exchange import ragged_all_to_all_reference


def numpy_ragged_all_to_all(operands, outputs, in_off, send, out_off, recv):
    """jax.lax.ragged_all_to_all's docstring as loops: sender d's slice i goes to device i // s,
    written there at the sender's output_offsets[i] with the receiver's recv_sizes for it."""
    P, L = len(operands), len(in_off[0])
    s = L // P
    results = [o.copy() for o in outputs]
    for d in range(P):
        for i in range(L):
            dst, j = i // s, d * s + i % s
            n = recv[dst][j]
            assert n == send[d][i]
            results[dst][out_off[d][i]:out_off[d][i] + n] = operands[d][in_off[d][i]:in_off[d][i] + n]
    return results


def place(sizes, capacity, rng):
    """Offsets of slices of ``sizes`` in a buffer of ``capacity`` rows: in a random order, with
    random gaps between them (the slack of the buffer spread at random)."""
    order = rng.permutation(len(sizes))
    gaps = rng.multinomial(capacity - sum(sizes), np.ones(len(sizes) + 1) / (len(sizes) + 1))
    offsets, at = np.zeros(len(sizes), np.int32), 0
    for k, i in enumerate(order):
        at += gaps[k]
        offsets[i] = at
        at += sizes[i]
    return offsets


def random_exchange(rng, P, s):
    """Sizes (some zero) and offsets of an exchange over P devices, s slices per peer, with
    buffers just large enough plus a random slack (row counts that are multiples of nothing)."""
    L = P * s
    send = rng.integers(0, 5, (P, L)) * (rng.random((P, L)) > 0.25)  # sender d, slice i
    recv = np.zeros((P, L), np.int64)  # receiver r, slice j = d s + t: sender d's slice r s + t
    for d in range(P):
        for i in range(L):
            recv[i // s, d * s + i % s] = send[d, i]
    A = int(send.sum(1).max()) + int(rng.integers(1, 4))
    M = int(recv.sum(1).max()) + int(rng.integers(1, 4))
    in_off = np.stack([place(send[d], A, rng) for d in range(P)])
    land = np.stack([place(recv[r], M, rng) for r in range(P)])  # on each receiver
    out_off = np.zeros((P, L), np.int32)  # sender's view: where its slice i lands on i // s
    for d in range(P):
        for i in range(L):
            out_off[d, i] = land[i // s, d * s + i % s]
    return A, M, in_off, send.astype(np.int32), out_off, recv.astype(np.int32)


def test_the_cpu_reference_is_ragged_all_to_all_as_documented(rng):
    """Outputs (rows no slice covers keep the output buffer's values) and the gradient of the
    operand (each received row's cotangent back at its sender's row), one and two slices per
    peer, on random sizes, orders and gaps; the docstring's own example."""
    f = jax.jit(jax.vmap(lambda *a: ragged_all_to_all_reference(*a, axis_name="i"),
                         axis_name="i"))
    example = f(jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32), jnp.zeros((2, 4)),
                jnp.array([[0, 1], [0, 1]]), jnp.array([[1, 2], [1, 1]]),
                jnp.array([[0, 0], [1, 2]]), jnp.array([[1, 1], [2, 1]]))
    np.testing.assert_array_equal(example, [[1, 3, 0, 0], [2, 2, 4, 0]])
    for P, s in ((int(rng.integers(2, 6)), 1), (int(rng.integers(2, 4)), 2)):
        A, M, in_off, send, out_off, recv = random_exchange(rng, P, s)
        operand = rng.normal(size=(P, A, 3)).astype(np.float32)
        output = rng.normal(size=(P, M, 3)).astype(np.float32)
        want = numpy_ragged_all_to_all(list(operand), list(output), in_off, send, out_off, recv)
        got = f(operand, output, in_off, send, out_off, recv)
        np.testing.assert_array_equal(np.asarray(got), np.stack(want))
        # The gradient: the transposed exchange (received rows' cotangents sent home).
        ct = rng.normal(size=(P, M, 3)).astype(np.float32)
        _, vjp = jax.vjp(f, operand, output, in_off, send, out_off, recv)
        want_grad = np.zeros_like(operand)
        for d in range(P):
            for i in range(P * s):
                n, dst = send[d, i], i // s
                want_grad[d, in_off[d, i]:in_off[d, i] + n] += ct[dst, out_off[d, i]:out_off[d, i] + n]
        np.testing.assert_allclose(vjp(jnp.asarray(ct))[0], want_grad, rtol=0, atol=0)


def compiled_layer_grads(spec: MoeSpec, mesh, B: int, T: int, D: int) -> tuple[str, str]:
    """(StableHLO, compiled HLO) of the layer's gradients (weights and input) for ``mesh``,
    bf16 tokens split over its expert axis, the layer drawn inside the program."""

    def moe_grads_for_tpu(x_BxTxD, key):
        graphdef, params, rest = nnx.split(
            MoE(D, spec, rngs=nnx.Rngs(key), dtype=jnp.bfloat16), nnx.Param, ...)
        loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest, copy=True)(x).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(params, x_BxTxD)

    x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec("expert")))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                               sharding=NamedSharding(mesh, PartitionSpec()))
    # Kept out of the session's persistent cache (conftest.py): an executable for chips this
    # machine lacks cannot be loaded back from it, and JAX would warn on every read.
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        with jax.set_mesh(mesh), sharding.axis_rules(sharding.make_rules(mesh, DEFAULT_RULES)):
            lowered = jax.jit(moe_grads_for_tpu).lower(x, key)
            return lowered.as_text(), lowered.compile().as_text()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def test_the_ragged_exchange_compiles_for_a_tpu_topology():
    """The layer's forward and backward pass on 8 v5e chips, one expert each, lowered on this
    CPU machine for the topology: the real collective (ragged-all-to-all in the compiled
    program: tokens out, their ids and weights out, outputs home, and the backward's
    transposes), and the CPU reference nowhere (no all-gather but the [P, P] counts')."""
    spec = MoeSpec(num_experts=8, top_k=2, expert_dim=64, num_shared=1, shared_dim=64,
                   renormalize=True, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                   first_k_dense=0, router_float32=True, bias_update_rate=0.0,
                   balance_loss_coef=0.0, capacity_factor=0.0, expert_matmul="ragged",
                   ep_exchange="ragged")
    mesh = aot.mesh_over(aot._one_axis("expert", 8), aot.topology_devices("v5e:2x4"))
    stablehlo, hlo = compiled_layer_grads(spec, mesh, 8, 24, 128)
    assert "ragged_all_to_all" in stablehlo
    lines = hlo.splitlines()
    calls = [line for line in lines if " ragged-all-to-all(" in line]
    assert len(calls) >= 5, calls  # forward 3; backward: the tokens' and weights' gradients
    gathers = [line for line in lines if " all-gather(" in line]
    assert all(" s32[8,8]" in line for line in gathers), gathers
    # and the "all_tokens" exchange has none
    _, hlo = compiled_layer_grads(dataclasses.replace(spec, ep_exchange="all_tokens"), mesh,
                                  8, 24, 128)
    assert " ragged-all-to-all(" not in hlo
