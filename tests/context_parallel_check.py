"""Run by tests/test_context_parallel.py in a subprocess with 8 CPU devices (JAX_NUM_CPU_DEVICES=8).

1. The KDA op split over a context axis of 2, 4 and 8 devices (``kda_context_parallel``, impl
   "xla" and "recurrent"; "pallas" in interpret mode on one small case) against the float64
   NumPy recurrence (tests/kda_numpy.py), with packed documents crossing shard boundaries, one
   starting exactly at a boundary, and an initial state: the outputs and the final state; the
   gradients of q, k, v, g, beta and the initial state by central differences of the NumPy
   recurrence along directions confined to ONE shard's tokens, for every shard; and every
   gradient element against the one-device op.
2. The whole model through train_lib: one training step on one device and on meshes with
   context = 2, 4, 8 and data x context = 2 x 4 (packed documents crossing shard boundaries):
   the loss, and every parameter's gradient (from the first AdamW step's update) elementwise.
3. Bad combinations: errors that name the field.

Prints one line "RESULT {json}".
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kimi_k3.ops.kda import kda
from kimi_k3.ops.kda_context import kda_context_parallel
from tests.kda_numpy import kda_numpy, rel_err

B, T, H, HV, K, V = 2, 32, 1, 2, 4, 3
CHUNK = 4


def context_mesh(n: int, data: int = 1):
    devices = np.asarray(jax.devices()[: n * data]).reshape(data, n)
    return jax.sharding.Mesh(devices, ("data", "context"))


def op_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, K))
    k = rng.normal(size=(B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, HV, V))
    g = -rng.uniform(0.01, 0.5, size=(B, T, HV, K))
    beta = rng.uniform(0.1, 0.9, size=(B, T, HV))
    S0 = rng.normal(size=(B, HV, K, V)) * 0.5
    # Row 0: documents cross the shard boundaries of n = 2, 4, 8 (4 tokens per shard at n = 8)
    # and one starts exactly at token 16 (a boundary for every n); row 1: one document.
    seg = np.zeros((B, T), np.int32)
    seg[0] = np.repeat([1, 2, 3, 4], [6, 10, 11, 5])
    seg[1] = 1
    args = [np.asarray(np.float32(x), np.float64) for x in (q, k, v, g, beta, S0)]
    return args, seg


def op_errors() -> dict:
    """Largest relative errors of the context-parallel op against the references."""
    args, seg = op_inputs()
    q, k, v, g, beta, S0 = args
    o_ref, S_ref = kda_numpy(q, k, v, g, beta, initial_state=S0, segment_ids=seg)
    rng = np.random.default_rng(1)
    w_o = rng.normal(size=o_ref.shape)
    w_S = rng.normal(size=S_ref.shape)

    def np_loss(*a):
        o, S = kda_numpy(*a[:5], initial_state=a[5], segment_ids=seg)
        return float(np.sum(o * w_o) + np.sum(S * w_S))

    out = {}
    f32 = [jnp.asarray(x, jnp.float32) for x in args]
    seg_j = jnp.asarray(seg)
    w_o_j, w_S_j = jnp.asarray(w_o, jnp.float32), jnp.asarray(w_S, jnp.float32)

    def one_device_loss(q, k, v, g, beta, S0):
        o, S = kda(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                   segment_ids=seg_j, impl="recurrent")
        return jnp.sum(o * w_o_j) + jnp.sum(S * w_S_j)

    ref_grads = jax.grad(one_device_loss, argnums=tuple(range(6)))(*f32)
    cases = [(2, "xla"), (4, "xla"), (8, "xla"), (4, "recurrent"), (2, "pallas")]
    for n, impl in cases:
        mesh = context_mesh(n)

        def loss(q, k, v, g, beta, S0, mesh=mesh, impl=impl):
            o, S = kda_context_parallel(
                q, k, v, g, beta, mesh=mesh, context_axes="context", initial_state=S0,
                output_final_state=True, segment_ids=seg_j, chunk_size=CHUNK, impl=impl)
            return jnp.sum(o * w_o_j) + jnp.sum(S * w_S_j), (o, S)

        with jax.set_mesh(mesh):
            (_, (o, S)), grads = jax.jit(jax.value_and_grad(
                loss, argnums=tuple(range(6)), has_aux=True))(*f32)
        err = {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}
        # Every gradient element against the one-device op, shard by shard.
        per_shard = []
        for gx, gr in zip(grads[:5], ref_grads[:5], strict=True):
            for i in range(n):
                sl = slice(i * T // n, (i + 1) * T // n)
                per_shard.append(rel_err(gx[:, sl], gr[:, sl]))
        err["grad_vs_one_device"] = max(per_shard + [rel_err(grads[5], ref_grads[5])])
        # Directional derivatives of the float64 recurrence, one shard's tokens at a time.
        fd = []
        if impl != "pallas" or n == 2:
            for a in range(6):
                shards = range(n) if a < 5 else [None]
                for i in shards:
                    d = rng.normal(size=args[a].shape)
                    if i is not None:
                        mask = np.zeros(T)
                        mask[i * T // n:(i + 1) * T // n] = 1
                        d = d * mask.reshape((1, T) + (1,) * (d.ndim - 2))
                    eps = 1e-6
                    plus = [x + eps * d if j == a else x for j, x in enumerate(args)]
                    minus = [x - eps * d if j == a else x for j, x in enumerate(args)]
                    num = (np_loss(*plus) - np_loss(*minus)) / (2 * eps)
                    ana = float(np.sum(np.asarray(grads[a], np.float64) * d))
                    fd.append(abs(ana - num) / max(abs(num), 1e-3))
        err["grad_vs_float64"] = max(fd)
        out[f"{impl}_context{n}"] = err
    return out


def main():
    assert jax.device_count() == 8, jax.devices()
    out = {"op": op_errors()}
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
