"""Run by tests/test_context_parallel.py in a subprocess with 8 CPU devices (JAX_NUM_CPU_DEVICES=8).

1. The KDA op split over a context axis of 2, 4 and 8 devices (``kda_context_parallel``, impl
   "xla" and "recurrent"; "pallas" in interpret mode on one small case) against the float64
   NumPy recurrence (tests/kda_numpy.py), with packed documents crossing shard boundaries, one
   starting exactly at a boundary, and an initial state: the outputs and the final state; the
   gradients of q, k, v, g, beta and the initial state by central differences of the NumPy
   recurrence along directions confined to ONE shard's tokens, for every shard; and every
   gradient element against the one-device op.
2. The whole model ("KM": a KDA and an MLA layer) as train_lib builds it, on one device and on
   meshes with context = 8 and data x context = 2 x 4, batches placed by the trainer's batch
   sharding (tokens split over context), packed documents crossing shard boundaries: the loss
   and the gradient of every parameter (every shard of it: the arrays are gathered whole);
   the lowered program must contain the all-gather and the collective permute.
   With the gate in the op (``A_log``, ``dt_bias``, the gate's pre-activation f for g; the
   Pallas kernel at context = 2): outputs, final state and the gradients of every input and of
   A_log and dt_bias (replicated over the shards: their gradients are summed across them)
   against the one-device op fed the same f.
3. Bad combinations: errors that name the field.
4. eval.py's scorer reading a window in 2 pieces with the cache carried, each piece split over
   context = 4 (``--config.mesh.context=4``): the next-token NLLs against one device's; a
   --piece_len that does not split is named.

Prints one line "RESULT {json}".
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kimi_k3 import evaluation, model_state, train_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3.config import run_spec
from kimi_k3.eval_scoring import EvalOptions, Scorer
from kimi_k3.ops.kda import kda
from kimi_k3.ops.kda_context import kda_context_parallel
from kimi_k3.trees import path_str
from tests.helpers import load_config
from tests.kda_numpy import kda_numpy, rel_err

B, T, H, HV, K, V = 2, 32, 1, 2, 4, 3
CHUNK = 4
# (context size, impl) of the op checks: each implementation once, each size once. (A fourth
# case, recurrent at 2, repeated an implementation and a size the others cover, for a compile.)
CASES = [(4, "xla"), (8, "recurrent"), (2, "pallas")]


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

    # Jitted: run eagerly, the recurrence's gradient dispatches (and compiles) op by op, about
    # five times slower than compiling it whole.
    ref_grads = jax.jit(jax.grad(one_device_loss, argnums=tuple(range(6))))(*f32)
    cases = CASES
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


def small_model_config(context: int, data: int):
    """A two-layer "KM" model (one KDA, one MLA layer) at test size."""
    c = load_config("tiny.py")
    m = c.model
    m.num_layers, m.kda_per_mla = 2, 1
    m.d_model, m.num_heads, m.kda.head_dim, m.kda.num_v_heads = 32, 2, 8, 4
    m.kda.impl, m.kda.chunk_size = "recurrent", CHUNK  # the op checks cover "xla" and "pallas"
    m.mla.num_heads, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim = 2, 16, 8
    m.mla.shared_head_dim, m.mla.v_head_dim = 4, 8
    m.mlp_dim, m.attn_res_block_size = 64, 2
    m.mla.attn_block_size = 16  # blocks of the flash loop, not one direct block
    c.data.seq_len, c.data.global_batch_size = MODEL_T, MODEL_B
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.context, c.mesh.tensor = data, 1, 1, context, 1
    c.train.microbatch_size = MODEL_B
    return c


MODEL_B, MODEL_T = 4, 64


def model_batch():
    """Packed documents: they cross the shard boundaries of context 2, 4 and 8 (8 tokens per
    shard at 8), one starts exactly at token 32 (a boundary of every context size)."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 256, size=(MODEL_B, MODEL_T)).astype(np.int32)
    lengths = [[5, 14, 13, 19, 13], [64], [31, 1, 32], [3, 20, 9, 30, 2]]
    seg = np.stack([np.repeat(np.arange(1, len(ls) + 1), ls) for ls in lengths]).astype(np.int32)
    return {"tokens": tokens, "segment_ids": seg}


def model_gradients(context: int, data: int, batch):
    """(loss, gradients as NumPy, the tokens' sharding spec, the collectives in the lowered
    program) of the mean next-token loss. The parameters are random draws (the same on every
    mesh), not the initialiser's: compiling the initialiser would cost more than the check."""
    config = small_model_config(context, data)
    devices = jax.devices()[: context * data]
    mesh = mesh_lib.make_mesh(config.mesh, devices)
    setup = train_lib.build(config, mesh)
    rng = np.random.default_rng(4)
    params = jax.tree.map(
        lambda a, sh: jax.device_put(np.float32(rng.normal(size=a.shape) * 0.3), sh),
        setup.abstract_state["params"], setup.state_shardings["params"])

    def loss(params, tokens, segs):
        model = model_state.merge_model(setup.graphdef, params, setup.rest)
        s, n = train_lib.next_token_loss(model, tokens, segs)
        return s / n

    gb = train_lib.global_batch(batch, setup.batch_sharding, MODEL_B)
    with setup.context():
        lowered = jax.jit(jax.value_and_grad(loss)).lower(params, gb["tokens"],
                                                          gb["segment_ids"])
        value, grads = lowered.compile()(params, gb["tokens"], gb["segment_ids"])
    text = lowered.as_text()
    ops = [op for op in ("all_gather", "collective_permute") if f"stablehlo.{op}" in text]
    return float(value), jax.device_get(grads), str(gb["tokens"].sharding.spec), ops


def model_errors() -> dict:
    batch = model_batch()
    loss_ref, grads_ref, _, _ = model_gradients(1, 1, batch)
    out = {"single_loss": loss_ref}
    # Context 2 and 4 alone are not run: every mesh is a compile of its own (about a tenth of
    # this check), and these two add no behaviour of the model's: data2_context4 splits each
    # row over the same 4 shards (and adds a data axis), context8 is the longest chain of
    # states passed, and the op at context 2 (its two-shard exchange) is checked in part 1.
    for name, (context, data) in {"context8": (8, 1), "data2_context4": (4, 2)}.items():
        loss, grads, spec, ops = model_gradients(context, data, batch)
        # Relative per parameter; one whose true gradient is zero (the first layer's Attention
        # Residual read has a single source, so its pseudo-query gets none: rounding noise of
        # 1e-14) is measured against a millionth of the largest gradient instead.
        floor = 1e-6 * max(float(np.linalg.norm(r)) for r in jax.tree.leaves(grads_ref))
        errs = {path_str(p): float(np.linalg.norm(g - r) / max(np.linalg.norm(r), floor))
                for (p, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                                     jax.tree.leaves(grads_ref), strict=True)}
        worst = max(errs, key=errs.get)
        out[name] = {"loss_rel": abs(loss - loss_ref) / abs(loss_ref), "grad_rel": errs[worst],
                     "worst_param": worst, "num_params": len(errs), "tokens_spec": spec,
                     "collectives": ops}
    return out


def bad_combinations() -> dict:
    """The errors of combinations that cannot work: they name the field."""
    out = {}
    config = small_model_config(8, 1)
    config.data.seq_len = 48  # not a multiple of 8 x 4
    try:
        run_spec(config)
    except ValueError as e:
        out["seq_len"] = str(e)
    config = small_model_config(16, 1)
    try:
        mesh_lib.make_mesh(config.mesh)
    except ValueError as e:
        out["context_too_large"] = str(e)
    config = small_model_config(-1, 1)  # context = all 8 devices, resolved in build
    config.data.seq_len = 16
    try:
        train_lib.build(config, mesh_lib.make_mesh(config.mesh))
    except ValueError as e:
        out["seq_len_resolved"] = str(e)
    return out


def prefill_nll(context: int, batch, pieces: int = 2):
    """(next-token NLL [B, T], collectives in the compiled piece) of the model reading one row
    of ``batch`` in ``pieces`` pieces with its cache carried, through eval.py's scorer
    (``eval_scoring.Scorer``), each piece split over ``context`` devices."""
    config = small_model_config(1, 1)
    config.mesh.context = context
    setup = train_lib.build(small_model_config(1, 1), mesh_lib.make_mesh(
        small_model_config(1, 1).mesh, jax.devices()[:1]))
    rng = np.random.default_rng(4)
    params = jax.tree.map(lambda a: jnp.asarray(np.float32(rng.normal(size=a.shape) * 0.3)),
                          setup.abstract_state["params"])
    model = model_state.merge_model(setup.graphdef, params, setup.rest)
    opts = EvalOptions(context_lengths=(MODEL_T,), piece_len=MODEL_T // pieces)
    mesh, rules = evaluation.context_mesh(config, opts, [config])
    scorer = Scorer(model, mesh=mesh, rules=rules)
    window = np.concatenate([batch["tokens"][:1], batch["tokens"][:1, :1]], axis=1)  # L + 1
    nll = scorer.piecewise_nll(window, piece_len=MODEL_T // pieces)
    text = next(iter(scorer._compiled.values())).as_text()
    return nll, [op for op in ("all-gather", "collective-permute") if op in text]


def prefill_errors() -> dict:
    batch = model_batch()
    ref, _ = prefill_nll(1, batch)
    nll, ops = prefill_nll(4, batch)
    out = {"context4": rel_err(nll, ref), "collectives": ops}
    config = small_model_config(1, 1)
    config.mesh.context = 4
    try:  # pieces of 24 tokens do not split into 4 shards of whole chunks of 4
        evaluation.context_mesh(config, EvalOptions(context_lengths=(MODEL_T,), piece_len=24), [config])
    except ValueError as e:
        out["piece_len_error"] = str(e)
    return out


def op_gate_errors(n: int = 2, impl: str = "pallas") -> dict:
    """The context-parallel op with the gate in the op (bounded form) against the one-device
    op with the same gate: outputs, final state, and every gradient (f, A_log, dt_bias too)."""
    args, seg = op_inputs(seed=2)
    rng = np.random.default_rng(3)
    f = rng.normal(size=(B, T, HV, K))
    A_log, dt_bias = 0.5 * rng.normal(size=HV), rng.normal(size=(HV, K))
    q, k, v, _, beta, S0 = (jnp.asarray(x, jnp.float32) for x in args)
    f, A_log, dt_bias = (jnp.asarray(x, jnp.float32) for x in (f, A_log, dt_bias))
    ins = [q, k, v, f, beta, S0, A_log, dt_bias]
    seg_j = jnp.asarray(seg)
    w_o = jnp.asarray(rng.normal(size=(B, T, HV, V)), jnp.float32)
    w_S = jnp.asarray(rng.normal(size=(B, HV, K, V)), jnp.float32)
    kw = dict(initial_state=None, output_final_state=True, segment_ids=seg_j, chunk_size=CHUNK,
              lower_bound=-5.0)

    def one_device(q, k, v, f, beta, S0, A_log, dt_bias):
        o, S = kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, impl="recurrent",
                   **{**kw, "initial_state": S0})
        return jnp.sum(o * w_o) + jnp.sum(S * w_S), (o, S)

    mesh = context_mesh(n)

    def split(q, k, v, f, beta, S0, A_log, dt_bias):
        o, S = kda_context_parallel(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, mesh=mesh,
                                    context_axes="context", impl=impl,
                                    **{**kw, "initial_state": S0})
        return jnp.sum(o * w_o) + jnp.sum(S * w_S), (o, S)

    grad = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=tuple(range(8)), has_aux=True))
    (_, (o_ref, S_ref)), g_ref = grad(one_device)(*ins)
    with jax.set_mesh(mesh):
        (_, (o, S)), g = grad(split)(*ins)
    names = ("q", "k", "v", "f", "beta", "S0", "A_log", "dt_bias")
    return {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref),
            **{f"d{name}": rel_err(a, b) for name, a, b in zip(names, g, g_ref, strict=True)}}


def main():
    assert jax.device_count() == 8, jax.devices()
    which = sys.argv[1:] or ["op", "op_gate", "model", "bad", "prefill"]
    parts = {"op": op_errors, "op_gate": op_gate_errors, "model": model_errors,
             "bad": bad_combinations, "prefill": prefill_errors}
    out = {name: parts[name]() for name in which}
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
