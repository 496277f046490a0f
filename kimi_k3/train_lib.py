"""The trainer: a HybridLM on a (data, fsdp, expert, tensor) device mesh.

    python train.py --config=configs/tiny.py --workdir=runs/tiny [--config.train.steps=500]

``train(config, workdir)`` reads top to bottom in sections: config, mesh, input, model and
optimizer (shapes from ``jax.eval_shape``, nothing allocated), sharding, update step,
checkpoint restore, loop. Everything it builds is importable (``build``, ``make_train_step``,
``next_token_loss``) so tests drive the same code without the command line. ``compile_ahead``
compiles a run's initialiser and step from shapes alone, nothing allocated: with JAX's
persistent cache on, the run then reads them from it (the benchmarks' ``--compile_only``).

Loss: the mean next-token cross-entropy over every position whose next token belongs to the
same document (``segment_ids[t + 1] == segment_ids[t] != 0``); the last token of a document
predicts nothing. With ``train.microbatch_size = m`` the global batch of B rows runs as B / m
micro-batches (forward and backward each), gradients are summed in float32 and divided by the
token count of the whole batch, so the update equals the one-shot step's. ``m = 0`` picks the
largest micro-batch the planner says fits the device (``plan_microbatch``, ``kimi_k3.plan``;
the next one up when the plan only just misses and XLA's compiled figure fits, ``near_miss``;
a stand-in model: XLA's estimate, ``choose_microbatch``), and a step the planner says cannot
fit is refused before it compiles (``train.memory_check``). Rows go
to micro-batches by ``micro_batch_order``: each device's own, fewer documents first.

Non-finite loss or gradient norm: the update of that step is never applied (parameters and
optimizer state stay as they were). ``train.nan_policy = "stop"`` then ends the run with an
error naming the step; ``"skip"`` counts it and goes on.

A mixture of experts (layers/moe.py) adds model state that is not a parameter: each layer's
routing bias (``ExpertBias``), carried in the train state as ``"model_state"`` and checkpointed
with it. After each applied update the step moves it toward balanced load,
b_e += moe.bias_update_rate * sign(mean_e' load_e' - load_e), from the loads the forward passes
measured over the whole global batch (``MoeStat``); a sequence-wise balance loss, when on, is
added to the objective (``loss`` reports the cross-entropy alone). Per MoE layer, the load's
max / mean over experts and the bias norm go to the metrics, with the dropped assignments
(capacity mode) and the balance loss.

At each evaluation (or every ``train.internals_every`` steps; 0 = never) the loop also runs the
internals report (``kimi_k3/internals.py``: per-layer KDA timescales, MLA reach, Attention
Residual weights, expert load on held-out rows) in a jitted function of its own
(``InternalsReport``); the training step never changes with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import compile_cache, optim, plan
from kimi_k3 import data as data_lib
from kimi_k3 import internals as internals_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import metrics as metrics_lib
from kimi_k3 import sharding as sharding_lib
from kimi_k3.config import ConfigError, RunSpec, check_context, kda_chunk, opt_spec, run_spec
from kimi_k3.layers.attention import documents_per_row
from kimi_k3.layers.dense import low_copies, precast, with_copies
from kimi_k3.layers.moe import ZEROED_STATE, Experts, MoeStat, update_bias
from kimi_k3.model import flops_per_token, layer_numbers, unused_expert_params
from kimi_k3.model_state import merge_model
from kimi_k3.run_dir import (
    RunFolderBusy,
    RunLock,
    absolute_path,
    check_workdir,
    config_changes,
    flat_config,
    make_workdir,
    previous_config,
    write_config,
)
from kimi_k3.runtime import (
    Interrupted,
    console,
    device_memory_bytes,
    quiet_library_logs,
    run_once_compiler_options,
)
from kimi_k3.train_state import state_layout
from pallas_kernels import device

# ---------------------------------------------------------------------------------------------
# A mixture of experts' measurements and routing biases
# ---------------------------------------------------------------------------------------------


def moe_stats(model) -> dict:
    """The measurements a forward pass left in ``model``'s MoE layers, as a flat dict
    {state path: array} ({} without a mixture of experts)."""
    return traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, MoeStat)))


def update_biases(model_state: dict, stats: dict, rate: float) -> dict:
    """Every routing bias of ``model_state`` moved by its layer's measured ``load`` in ``stats``
    (``moe_stats``'s flat dict) with ``moe.update_bias``."""
    flat = traverse_util.flatten_dict(model_state)
    return traverse_util.unflatten_dict(
        {path: update_bias(b, stats[path[:-1] + ("load",)], rate) for path, b in flat.items()})


# ---------------------------------------------------------------------------------------------
# Loss and update step
# ---------------------------------------------------------------------------------------------


def next_token_loss(model, tokens_BxT, segment_ids_BxT):
    """(summed cross-entropy, number of targets): position t predicts token t+1 when both
    lie in the same (non-padding) document. ``model.token_nll`` computes the head and the loss
    a chunk of tokens at a time, never the whole [B, T, V] float32 logits."""
    valid_BxT1 = (segment_ids_BxT[:, 1:] == segment_ids_BxT[:, :-1]) & (segment_ids_BxT[:, 1:] > 0)
    targets_BxT = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1)))  # the last position: no target
    nll_BxT, _ = model.token_nll(tokens_BxT, targets_BxT, segment_ids_BxT)
    with jax.named_scope("loss"):
        return jnp.sum(jnp.where(valid_BxT1, nll_BxT[:, :-1], 0.0)), jnp.sum(valid_BxT1)


def count_targets(segment_ids_BxT):
    s = segment_ids_BxT
    return jnp.sum((s[:, 1:] == s[:, :-1]) & (s[:, 1:] > 0))


def micro_batch_order(segment_ids_BxT: jax.Array, accum_steps: int) -> jax.Array:
    """[B / A, A] int32, A = accum_steps: which of the A consecutive rows i A .. i A + A - 1 of
    group i goes to micro-batch a (``micro_batches``): the rows with fewer documents first.

    Group i is position i of every micro-batch, and its rows lie on one device, so each device
    keeps its own rows. Sorting each group puts the rows of one document together in the first
    micro-batches: a micro-batch whose rows are each one document runs MLA's attention as plain
    causal attention on cuDNN (``attention._cudnn_attention``), cheaper than its packed layout
    (benchmarks/micro_batch_order.py counts such micro-batches in both orders). The step's
    sums over micro-batches do not depend on the order (up to rounding)."""
    B = segment_ids_BxT.shape[0]
    docs_GxA = documents_per_row(segment_ids_BxT).reshape(B // accum_steps, accum_steps)
    return jnp.argsort(docs_GxA, axis=1, stable=True).astype(jnp.int32)


def micro_batches(x_BxT: jax.Array, order_GxA: jax.Array) -> jax.Array:
    """[A, B / A, T]: micro-batch a holds row i A + order[i, a] of each group i."""
    G, A = order_GxA.shape
    x_GxAxT = x_BxT.reshape(G, A, -1)
    return jnp.take_along_axis(x_GxAxT, order_GxA[..., None], axis=1).transpose(1, 0, 2)


def make_train_step(graphdef, rest, tx, schedule, accum_steps: int, mesh, model_spec=None,
                    moe_layers=(), grad_accum_dtype: str = "float32"):
    """train_step(state, batch) -> (state, metrics), to be jitted.

    state: {"params", "opt_state", "step", "rng"}, and "model_state" (the routing biases) for a
    mixture of experts; batch: {"tokens", "segment_ids"} [B, T]. ``model_spec``: the ModelSpec
    (None for a stand-in model: nothing of a mixture of experts); ``moe_layers``: where each MoE
    layer's measurements lie (``moe_layer_paths``).

    With ``accum_steps`` > 1 micro-batches, ``grad_accum_dtype`` "float32" takes each one's
    gradient with respect to the float32 weights and sums them in float32; "bfloat16" takes it
    with respect to the weights rounded once to the compute dtype (``low_copies``: the matrices
    only) and sums it in that dtype, half the memory of both. The optimizer then sees the sum
    in float32 and updates the float32 weights either way. A mixture's expert matrices get
    their running sums handed in (``set_gradient_sums``) and come back summed: the
    blocked kernels add each micro-batch's products into them.
    """
    micro_spec = NamedSharding(mesh, PartitionSpec(None, *mesh_lib.batch_sharding(mesh).spec))
    moe = model_spec.moe if model_spec is not None else None
    bias_rate = moe.bias_update_rate if moe is not None else 0.0

    compute_dtype = model_spec.compute_dtype if model_spec is not None else None
    low_grads = (grad_accum_dtype == "bfloat16" and accum_steps > 1 and compute_dtype is not None
                 and jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16))

    def loss_sum(params, model_state, tokens, segment_ids, denom, copies, grad_sums=None):
        if copies is not None:
            params = with_copies(params, copies)
        model = merge_model(graphdef, params, rest, model_state)
        if grad_sums is not None:
            set_gradient_sums(model, grad_sums)
        s, n = next_token_loss(model, tokens, segment_ids)
        stats = moe_stats(model)
        balance = sum((v for p, v in stats.items() if p[-1] == "balance_loss"), jnp.zeros(()))
        # Each micro-batch's balance loss is a mean over its rows: their mean is the batch's.
        return s / denom + balance.sum() / accum_steps, (n, s / denom, stats)

    grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

    def train_step(state, batch):
        params, model_state = state["params"], state.get("model_state")
        tokens, segs = batch["tokens"], batch["segment_ids"]
        denom = jnp.maximum(count_targets(segs), 1).astype(jnp.float32)
        if accum_steps == 1:  # each weight is rounded once either way: no copies
            (_, (n, loss, stats)), grads = grad_fn(params, model_state, tokens, segs, denom,
                                                   None)
        else:
            # The weights in the compute dtype, rounded once here rather than in every
            # micro-batch.
            if low_grads:  # differentiated with respect to the copies themselves
                diff_params, copies = low_copies(params, compute_dtype), None
            else:
                diff_params = params
                copies = precast(params, compute_dtype) if compute_dtype is not None else None
            order = micro_batch_order(segs, accum_steps)

            def micro(x):
                return jax.lax.with_sharding_constraint(micro_batches(x, order), micro_spec)

            def body(carry, mb):
                acc_l, acc_n, acc_st, acc_g = carry
                # The experts' gradients come back with the running sums already added
                # (layers/moe.py's GradientSum): inside the weight-gradient kernels where they
                # can be, so a micro-batch's gradient of them is never held on its own.
                (_, (n, l, st)), g = grad_fn(diff_params, model_state, mb[0], mb[1], denom,
                                             copies, acc_g if moe is not None else None)
                summed = lambda path: moe is not None and _is_expert_matrix(path)
                acc_g = jax.tree_util.tree_map_with_path(
                    lambda path, a, b: b.astype(a.dtype) if summed(path)
                    else a + b.astype(a.dtype), acc_g, g)
                acc_st = jax.tree.map(jnp.add, acc_st, st)  # loads and drops add up
                return (acc_l + l, acc_n + n, acc_st, acc_g), None

            zeros = jax.tree.map(
                lambda p: jnp.zeros(p.shape, p.dtype if low_grads else jnp.float32), diff_params)
            micro_tokens, micro_segs = micro(tokens), micro(segs)
            _, (_, _, stats0) = jax.eval_shape(loss_sum, diff_params, model_state, micro_tokens[0],
                                               micro_segs[0], denom, copies)
            zero_stats = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), stats0)
            (loss, n, stats, grads), _ = jax.lax.scan(
                body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), zero_stats, zeros),
                (micro_tokens, micro_segs))
            stats = {p: v / accum_steps if p[-1] == "balance_loss" else v
                     for p, v in stats.items()}
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        with jax.named_scope("optimizer"):
            grad_norm = optax.tree.norm(grads)
            updates, new_opt = tx.update(grads, state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
        loss_finite, grad_finite = jnp.isfinite(loss), jnp.isfinite(grad_norm)
        update_finite = jnp.isfinite(optax.tree.norm(updates))
        finite = loss_finite & grad_finite & update_finite
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = {
            "params": keep(new_params, params),
            "opt_state": keep(new_opt, state["opt_state"]),
            "step": state["step"] + 1,
            "rng": jax.random.fold_in(state["rng"], state["step"]),
        }
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]),
                   "finite": finite, "loss_finite": loss_finite, "grad_finite": grad_finite,
                   "update_finite": update_finite, "targets": n}
        if model_state is not None:
            with jax.named_scope("expert_bias"):
                new_state["model_state"] = keep(update_biases(model_state, stats, bias_rate),
                                                model_state)
        if moe_layers:
            metrics.update(moe_metrics(stats, new_state["model_state"], moe_layers))
        return new_state, metrics

    return train_step


def _is_expert_matrix(path) -> bool:
    """Whether a parameter's tree path is a routed expert matrix (``Experts.wi`` / ``.wo``)."""
    names = [getattr(k, "key", None) for k in path]
    return len(names) >= 2 and names[-2] == "experts" and names[-1] in ("wi", "wo")


def set_gradient_sums(model, sums: dict) -> None:
    """Gives each ``Experts`` module of ``model`` its matrices' running gradient sums from
    ``sums`` (a tree like the parameters), as its ``GradientSum``s: the gradient the forward
    and backward pass then returns for those matrices is the sum plus its own."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Experts):
            here = sums
            for key in path:
                here = here[key]
            node.wi_sum.set_value(jax.lax.stop_gradient(here["wi"]))
            node.wo_sum.set_value(jax.lax.stop_gradient(here["wo"]))


def moe_layer_paths(spec, abstract_stats: dict) -> tuple:
    """((path of a layer's measurements, its layer numbers), ...), by first layer number: a
    scanned layer's path holds one slice per repeat (``model.layer_numbers``)."""
    paths = sorted({p[:-1] for p in abstract_stats}, key=lambda p: layer_numbers(spec, p)[0])
    return tuple((p, layer_numbers(spec, p)) for p in paths)


def moe_metrics(stats: dict, model_state: dict, moe_layers) -> dict:
    """Per MoE layer, in the order of ``moe_layers`` (a scanned path's repeats in turn): the
    load's max / mean over experts and the routing bias norm, [L_moe] each; the dropped
    assignments and the balance loss, summed over layers."""
    biases = traverse_util.flatten_dict(model_state)
    ratio, norm = [], []
    for path, _ in moe_layers:
        load = stats[path + ("load",)]  # [E] or [repeats, E]
        ratio.append((load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)).reshape(-1))
        norm.append(jnp.linalg.norm(biases[path + ("bias",)], axis=-1).reshape(-1))
    total = lambda key: sum(v.sum() for p, v in stats.items() if p[-1] == key)
    return {"moe_load_max_mean": jnp.concatenate(ratio), "moe_bias_norm": jnp.concatenate(norm),
            "moe_dropped": total("dropped"), "moe_balance_loss": total("balance_loss")}


def make_eval_step(graphdef, rest):
    """eval_step(model, batch) -> (summed cross-entropy, targets); ``model``: {"params"} and,
    for a mixture of experts, {"model_state"} (``model_part`` of a train state)."""
    def eval_step(model, batch):
        merged = merge_model(graphdef, model["params"], rest, model.get("model_state"))
        return next_token_loss(merged, batch["tokens"], batch["segment_ids"])

    return eval_step


def model_part(state: dict) -> dict:
    """What a forward pass needs of a train state: the parameters (and the model state)."""
    return {k: state[k] for k in ("params", "model_state") if k in state}


# ---------------------------------------------------------------------------------------------
# Everything a run needs, sharded for a mesh (no arrays allocated until ``init_state``)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    spec: RunSpec
    mesh: jax.sharding.Mesh
    rules: tuple
    graphdef: object
    rest: object
    tx: optax.GradientTransformation
    schedule: object
    abstract_state: dict  # ShapeDtypeStructs carrying the target shardings
    state_shardings: dict
    moe_layers: tuple  # ((state path, layer numbers), ...) of the MoE layers (moe_layer_paths)
    batch_sharding: NamedSharding
    train_step: object  # jitted
    eval_step: object  # jitted
    init_state: object  # () -> the sharded initial state (``init_program`` under the mesh)
    microbatch_size: int  # rows per forward/backward pass (train.microbatch_size, resolved)
    init_program: object  # jitted: () -> the initial state; called by ``init_state``

    def context(self):
        """The mesh and the logical rules, in force while the model is traced."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(sharding_lib.axis_rules(self.rules))
        return stack


MEMORY_HEADROOM = 0.85  # share of device memory the automatic micro-batch may plan to use


def _wait_until_ready(tree) -> None:
    """Blocks until every array of ``tree`` has been computed (the step timer's clock reads)."""
    jax.block_until_ready(tree)


def _platform(mesh) -> str:
    return mesh.devices.flat[0].platform


def gradient_scratch_bytes(rows: int, T: int, mesh, graphdef, rest, abstract_state,
                           batch_sharding, rules, compiler_options=None) -> int:
    """XLA's scratch memory (bytes per device) for the gradient of the mean loss of ``rows``
    rows of ``T`` tokens: what ``choose_microbatch`` plans a micro-batch by. It is compiled,
    never run."""

    def loss(params, model_state, tokens, segs):
        model = merge_model(graphdef, params, rest, model_state)
        s, c = next_token_loss(model, tokens, segs)
        return s / jnp.maximum(c, 1)

    tokens = jax.ShapeDtypeStruct((rows, T), jnp.int32, sharding=batch_sharding)
    with jax.set_mesh(mesh), sharding_lib.axis_rules(rules):
        compiled = jax.jit(jax.grad(loss)).lower(
            abstract_state["params"], abstract_state.get("model_state"), tokens,
            tokens).compile(compiler_options)
    return compiled.memory_analysis().temp_size_in_bytes


def choose_microbatch(B: int, T: int, mesh, graphdef, rest, abstract_state, batch_sharding,
                      rules, limit: int | None = None) -> int:
    """``train.microbatch_size = 0``: the largest micro-batch (a multiple of data x fsdp x expert
    that divides the global batch ``B``) whose forward + backward fits the device.

    XLA compiles the gradient of the smallest such micro-batch (run-once options: it never
    runs) and reports its scratch memory; activations grow with the rows, so a micro-batch of
    m rows is planned at m / smallest times that, plus the training state each device holds.
    With no known device memory (CPU), the whole batch is one micro-batch.
    """
    limit = device_memory_bytes() if limit is None else limit
    n = mesh_lib.data_parallel_size(mesh)
    sizes = [m for m in range(n, B + 1, n) if B % m == 0]
    if limit is None or not sizes:
        return B
    smallest = sizes[0]
    scratch = gradient_scratch_bytes(smallest, T, mesh, graphdef, rest, abstract_state,
                                     batch_sharding, rules,
                                     run_once_compiler_options(_platform(mesh)))
    state = sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
                for s in jax.tree.leaves(abstract_state))
    grads = sum(math.prod(s.sharding.shard_shape(s.shape)) * 4
                for s in jax.tree.leaves(abstract_state["params"]))  # float32 sums
    fits = [m for m in sizes if state + grads + scratch * m // smallest <= MEMORY_HEADROOM * limit]
    chosen = fits[-1] if fits else smallest
    logging.info("train.microbatch_size=0: %d rows (scratch %.1f GiB per %d rows, state + "
                 "gradients %.1f GiB, device %.1f GiB)", chosen, scratch / 2**30, smallest,
                 (state + grads) / 2**30, limit / 2**30)
    if not fits:
        logging.warning("even %d rows per micro-batch may not fit the device (%.1f GiB "
                        "estimated of %.1f); try a lighter model.remat", smallest,
                        (state + grads + scratch) / 2**30, limit / 2**30)
    return chosen


def plan_microbatch(config, mesh, microbatch: int = 0, check: bool = True,
                    limit: int | None = None) -> int:
    """The micro-batch a step runs: ``microbatch`` when given, else the largest the planner
    (``kimi_k3.plan``) says fits the device, or the whole batch where the device's memory is
    unknown (CPU). With ``check``, a step the planner says cannot fit is refused here, before
    anything compiles: a ConfigError with the estimate, the device's memory and what would
    fit (``plan.knobs``)."""
    limit = device_memory_bytes() if limit is None else limit
    B = int(config.data.global_batch_size)
    if limit is None:
        return microbatch or B
    sizes = dict(mesh.shape)
    device = plan.local_device(limit)
    if microbatch:
        chosen, estimate = microbatch, plan.memory_plan(config, sizes, microbatch, device, limit)
    else:
        chosen, estimate = plan.largest_microbatch(config, sizes, device, limit)
    logging.info("memory plan: micro-batch %s rows, %.1f GiB of %.1f GiB per device",
                 chosen or "no", estimate.total / 2**30, limit / 2**30)
    if estimate.fits or not check:
        return chosen or estimate.microbatch
    fixes = plan.knobs(config, estimate, device)
    raise ConfigError(
        f"config.train.microbatch_size: {estimate.microbatch} rows per micro-batch need about "
        f"{estimate.total / 2**30:.1f} GiB per device (python -m kimi_k3.plan --config=... "
        f"--devices={math.prod(sizes.values())} shows the table), more than the "
        f"{plan.MEMORY_HEADROOM:.0%} of {limit / 2**30:.1f} GiB a plan may use; "
        + ("what would fit: " + "; ".join(fixes) if fixes else
           "nothing on this mesh fits: more devices or a smaller model")
        + "; --config.train.memory_check=False tries anyway")


def near_miss(config, mesh, chosen: int, limit: int | None = None) -> int | None:
    """The micro-batch above the planner's ``chosen`` that its plan puts past
    ``plan.MEMORY_HEADROOM`` of the device but within all of it (``plan.near_miss``), or None:
    ``build`` lets XLA's compiled figure decide that one."""
    limit = device_memory_bytes() if limit is None else limit
    if limit is None:
        return None
    found = plan.near_miss(config, dict(mesh.shape), plan.local_device(limit), limit, chosen)
    if found is None:
        return None
    logging.info("memory plan: %d rows per micro-batch planned at %.1f GiB, past %.0f%% of "
                 "%.1f GiB but within it: compiling that step to see", found[0],
                 found[1].total / 2**30, 100 * plan.MEMORY_HEADROOM, limit / 2**30)
    return found[0]


def compiled_bytes(compiled) -> int:
    """Bytes per device a compiled step holds while it runs, from XLA's buffer assignment:
    arguments + outputs - the outputs written into donated arguments + temporaries."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


def build(config, mesh, model_fn=None) -> Setup:
    """Abstract shapes, shardings (checked for divisibility), the optimizer and the jitted
    init / train / eval functions on ``mesh``.

    ``config``: a RunSpec, or the ConfigDict (checked into one). ``model_fn(seed) ->
    nnx.Module`` builds the model (default: ``HybridLM(spec.model)``; with a model_fn of its
    own, a stand-in in tests, the config needs no model section); it is called under
    ``jax.eval_shape`` and inside the jitted initialiser, never eagerly.
    """
    spec = run_spec(config, with_model=model_fn is None)
    B, T = spec.data.global_batch_size, spec.data.seq_len
    if spec.train.microbatch_size:
        mesh_lib.check_batch(B, spec.train.microbatch_size, mesh)
    # mesh.context = -1 is resolved only now, against the devices.
    check_context(T, dict(mesh.shape).get(mesh_lib.CONTEXT_AXIS, 1), kda_chunk(spec.model))
    layout = state_layout(spec, mesh, model_fn)
    rules, graphdef, abs_rest = layout.rules, layout.graphdef, layout.abstract_rest
    abstract_state, state_shardings = layout.abstract_state, layout.state_shardings
    tx, schedule, init_state = layout.tx, layout.schedule, layout.make_state
    repl = mesh_lib.replicated(mesh)
    moe_layers = ()
    if spec.model is not None and spec.model.moe is not None:
        stats = traverse_util.flatten_dict(
            nnx.to_pure_dict(nnx.state(layout.abstract_model, MoeStat)))
        moe_layers = moe_layer_paths(spec.model, stats)

    batch_sharding = mesh_lib.batch_sharding(mesh)
    batch_shardings = {"tokens": batch_sharding, "segment_ids": batch_sharding}
    near = None
    if model_fn is None and not isinstance(config, RunSpec):
        micro = plan_microbatch(config, mesh, spec.train.microbatch_size,
                                check=spec.train.memory_check)
        if not spec.train.microbatch_size:
            near = near_miss(config, mesh, micro)
    else:  # a stand-in model, or a RunSpec: XLA's own estimate
        micro = spec.train.microbatch_size or choose_microbatch(
            B, T, mesh, graphdef, abs_rest, abstract_state, batch_sharding, rules)
    jit_init = jax.jit(lambda: init_state()[0], out_shardings=state_shardings,
                       compiler_options=run_once_compiler_options(_platform(mesh)))
    # The rest of the model's state: a constant of the steps. Measurements (MoeStat) are
    # overwritten by every forward pass and gradient sums start empty, so zeros will do
    # (ZEROED_STATE); anything else comes from the initialiser (compiled for it alone).
    abs_stats, abs_other = nnx.split_state(abs_rest, ZEROED_STATE, ...)
    stats = jax.tree.map(lambda x: jax.device_put(jnp.zeros(x.shape, x.dtype), repl), abs_stats)
    other = abs_other
    if jax.tree.leaves(abs_other):
        with jax.set_mesh(mesh), sharding_lib.axis_rules(rules):
            other = jax.jit(lambda: nnx.split_state(init_state()[1], ZEROED_STATE, ...)[1],
                            out_shardings=jax.tree.map(lambda _: repl, abs_other))()
    rest = nnx.merge_state(stats, other)

    def step_of(rows: int):
        step = make_train_step(graphdef, rest, tx, schedule, B // rows, mesh, spec.model,
                               moe_layers, spec.train.grad_accum_dtype)
        return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                       out_shardings=(state_shardings, repl), donate_argnums=(0,))

    train_step = step_of(micro)
    if near is not None:
        # The plan says maybe; the compiled step says exactly. The run's own call of this step
        # then finds the program in JAX's in-process cache: nothing compiles twice.
        limit = device_memory_bytes()
        candidate = step_of(near)
        with jax.set_mesh(mesh), sharding_lib.axis_rules(rules):
            need = compiled_bytes(candidate.lower(
                abstract_state, _abstract_batch(B, T, batch_sharding)).compile())
        fits = need + plan.RESERVE_BYTES <= limit
        logging.info("memory plan: the step of %d rows per micro-batch needs %.1f GiB by XLA's "
                     "buffer assignment, + %.1f GiB reserve of %.1f GiB: %s", near,
                     need / 2**30, plan.RESERVE_BYTES / 2**30, limit / 2**30,
                     f"{near} rows" if fits else f"{micro} rows stay")
        if fits:
            micro, train_step = near, candidate
    eval_step = jax.jit(make_eval_step(graphdef, rest),
                        in_shardings=(model_part(state_shardings), batch_shardings),
                        out_shardings=repl)

    def init_fn():
        with jax.set_mesh(mesh), sharding_lib.axis_rules(rules):
            return jit_init()

    return Setup(spec, mesh, rules, graphdef, rest, tx, schedule, abstract_state,
                 state_shardings, moe_layers, batch_sharding, train_step, eval_step, init_fn,
                 micro, jit_init)


@dataclasses.dataclass(frozen=True)
class Precompiled:
    """A program ``compile_ahead`` compiled: its name, the seconds to trace, lower and compile
    it (or read it from the cache), what JAX's persistent cache did meanwhile, and the
    micro-batch (rows) of the setup it was compiled for."""

    name: str
    seconds: float
    cache: compile_cache.Count
    microbatch: int

    def __str__(self) -> str:
        how = self.cache.source()
        if not (self.cache.hits or self.cache.misses):
            how += (" (the cache is off, or it took less than "
                    "jax_persistent_cache_min_compile_time_secs)")
        return f"{self.name} {self.seconds:.1f} s, {how} (micro-batch {self.microbatch} rows)"


def abstract_batch(setup: Setup) -> dict:
    """A global batch in shapes alone, as ``global_batch`` makes it: {"tokens", "segment_ids"},
    int32 [B, T] ShapeDtypeStructs placed by ``setup.batch_sharding``."""
    return _abstract_batch(setup.spec.data.global_batch_size, setup.spec.data.seq_len,
                           setup.batch_sharding)


def _abstract_batch(B: int, T: int, sharding) -> dict:
    x_BxT = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sharding)
    return {"tokens": x_BxT, "segment_ids": x_BxT}


def compile_ahead(setup: Setup) -> list[Precompiled]:
    """Compiles what a run of ``setup`` compiles before its first step, the initialiser and
    the train step, from shapes alone (``setup.abstract_state``, ``abstract_batch``): nothing
    is allocated, and each program is lowered as the run's own call lowers it (``init_state()``,
    ``train_step(state, batch)`` under ``setup.context()``: the same HLO, shardings, donation
    and compiler options), so with JAX's persistent cache on (kimi_k3.compile_cache) the run
    reads them from it. ``build`` compiled what it needed on the way (``choose_microbatch``'s
    gradient, for a RunSpec with ``train.microbatch_size = 0``), into the cache as well."""
    programs = (("initialiser", setup.init_program, ()),
                ("train_step", setup.train_step, (setup.abstract_state, abstract_batch(setup))))
    done = []
    for name, fn, args in programs:
        t0 = time.perf_counter()
        with compile_cache.counting() as count, setup.context():
            fn.lower(*args).compile()
        done.append(Precompiled(name, time.perf_counter() - t0, count, setup.microbatch_size))
    return done


def moe_report(m: dict, moe_layers) -> dict:
    """A step's MoE metrics for the report: per layer ``moe_load_max_mean/layer<l>`` and
    ``moe_bias_norm/layer<l>``, their largest value over layers (``moe_load_max_mean``,
    ``moe_bias_norm``), ``moe_dropped`` and ``moe_balance_loss``; {} without a mixture."""
    if not moe_layers:
        return {}
    layers = [n for _, numbers in moe_layers for n in numbers]
    out = {}
    for key in ("moe_load_max_mean", "moe_bias_norm"):
        values = [float(v) for v in np.asarray(m[key])]
        out[key] = max(values)
        out.update({f"{key}/layer{n}": v for n, v in zip(layers, values, strict=True)})
    out["moe_dropped"] = int(m["moe_dropped"])
    out["moe_balance_loss"] = float(m["moe_balance_loss"])
    return out


def check_finite(step: int, m: dict, policy: str, latest_checkpoint=lambda: None) -> bool:
    """The host's view of a step's ``finite`` flag. A non-finite step's update was not
    applied; under ``policy="stop"`` this raises FloatingPointError naming the step, the
    quantity that was not finite and the checkpoint a restart would resume from (from
    ``latest_checkpoint()``: a step, a description of one, or None); under "skip" it logs a
    warning and returns False."""
    if bool(m["finite"]):
        return True
    bad = [name for key, name in (("loss_finite", "the loss"), ("grad_finite", "the gradient"),
                                  ("update_finite", "the optimizer's update")) if not bool(m.get(key, True))]
    if not bad:
        bad = ["the loss or the gradient"]
    hint = ""
    if bad == ["the optimizer's update"]:
        hint = (" (loss and gradient were finite: the optimizer itself overflowed; look at "
                "opt.eps, opt.lr and the parameter dtype)")
    msg = (f"step {step}: loss {float(m['loss'])} and gradient norm {float(m['grad_norm'])}: "
           f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not finite{hint}; that "
           f"update was not applied")
    if policy == "stop":
        latest = latest_checkpoint()
        where = ("no checkpoint has been saved yet, so a restart begins at step 0"
                 if latest is None else f"the latest checkpoint is step {latest}, where a "
                 f"restart with the same --workdir resumes")
        raise FloatingPointError(
            f"{msg}. Stopping (train.nan_policy='stop'); {where}. Lower opt.lr, or set "
            f"train.nan_policy='skip'")
    logging.warning("%s (train.nan_policy='skip')", msg)
    return False


def global_batch(local: dict[str, np.ndarray], sharding, global_rows: int) -> dict:
    """This host's rows -> global arrays sharded over data x fsdp x expert."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (global_rows, *v.shape[1:]))
        for k, v in local.items()
    }


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def run_summary(spec: RunSpec, *, workdir, config_name, mesh, n_params, train_rows, eval_rows,
                eval_batches, start, ckpt_dir, microbatch, split=None) -> str:
    """The first screen of a run: what is trained, on what, where, and where things go.
    ``split``: the ``data.Split`` read (its tokenizer, held-out rule and sizes)."""
    m, d, o, t = spec.model, spec.data, spec.opt, spec.train
    B, T = d.global_batch_size, d.seq_len
    mesh_text = " x ".join(f"{a} {n}" for a, n in mesh.shape.items())
    devices = f"{mesh.size} {jax.devices()[0].platform} device{'s' if mesh.size > 1 else ''}"
    source = d.source if d.source == "stdlib" else f"{d.source} {','.join(d.paths)!r}"
    if split is not None:
        source += f", tokenizer {split.tokenizer}"
    held_out = f", {eval_rows:,} held-out rows" if eval_rows else ""
    resume = (f"resuming from step {start:,} of {t.steps:,}" if start
              else f"from scratch to step {t.steps:,}")
    experts = ""
    if m.moe is not None:
        e = m.moe
        experts = (f"; MoE from layer {e.first_k_dense + 1}: {e.num_experts} experts, top-"
                   f"{e.top_k} + {e.num_shared} shared, "
                   f"{'dropless' if not e.capacity_factor else f'capacity {e.capacity_factor:g}'}"
                   f", {n_params - unused_expert_params(m):,} parameters active per token")
    kinds = []
    if "K" in m.pattern:
        kinds.append(f"KDA impl {m.kda.impl}")
    if "M" in m.pattern:
        kinds.append(f"attention impl {m.mla.attn_impl}")
    lines = [
        f"kimi_k3 train  {config_name}  ->  {workdir}",
        f"  model       {m.num_layers} layers {m.pattern} ({m.pattern.count('K')} KDA, "
        f"{m.pattern.count('M')} MLA), d_model {m.d_model}, vocab {m.vocab_size}, "
        f"{n_params:,} parameters, {m.dtype}"
        f"{' with FP8 projections (MFU on bf16-equivalent FLOPs)' if m.fp8 else ''}, "
        f"attn_res {m.attn_res}; {', '.join(kinds)}"
        f"{experts}",
        f"  data        {source}: {train_rows:,} train rows{held_out} of {T} tokens; "
        f"batch {B} x {T} = {B * T:,} tokens per step"
        + (f" in micro-batches of {microbatch} rows" if microbatch < B else ""),
        *([f"  held out    {split.describe()}{no_eval_hint(split, eval_rows, B, T)}"]
          if split is not None else []),
        f"  mesh        {mesh_text} over {devices} ({jax.process_count()} process"
        f"{'es' if jax.process_count() > 1 else ''})",
        f"  steps       {resume}; {o.name} lr {o.lr:g} ({o.schedule}, warmup "
        f"{o.warmup_steps}); eval every {t.eval_every or t.steps} steps "
        f"({eval_batches} batches)",
        f"  checkpoints {ckpt_dir + f' every {spec.checkpoint.every_steps} steps' if ckpt_dir else 'off'}",
        f"  writes      {workdir}/metrics.jsonl, {metrics_lib.CURVES} (at each eval), "
        f"config.json{', tensorboard/' if t.tensorboard else ''}",
    ]
    return "\n".join(lines)


def no_eval_hint(split, eval_rows: int, B: int, T: int) -> str:
    """For the first screen's held-out line: why there is no held-out loss, and the fix
    ("" when there is one). The fraction that would give one batch of B rows is rounded up."""
    if split.rule == "none" or eval_rows >= B:
        return ""
    total = split.train.num_tokens + split.eval_tokens
    need = math.ceil(100 * B * (T + 1) / total) / 100 if total else 1.0  # rows cut at T
    fix = (f"raise data.eval_fraction to {need:g} or give data.eval_paths" if need < 0.5
           else "give data.eval_paths (or more data)")
    return (f"; NO held-out loss: {eval_rows} rows of {T} tokens, fewer than one batch of {B} "
            f"({fix})")


class RunFolder:
    """The run folder's lock while a trainer writes it (``run_dir.RunLock``, process 0's).

    A folder that exists is locked at once (``lock``), before the slow checks, so a second
    trainer is refused at once; one that does not is created and locked only once everything
    has been checked (``create``), so a run refused on bad input leaves nothing behind."""

    def __init__(self, workdir: str, chief: bool):
        self.workdir, self.chief = workdir, chief
        self._lock: RunLock | None = None
        self.locked = False

    def lock(self) -> None:
        """Takes the lock; every process raises RunFolderBusy when process 0 could not
        (multi-host: process 0's verdict, given to all)."""
        busy = None
        if self.chief:
            try:
                self._lock = RunLock(self.workdir)
            except RunFolderBusy as e:
                busy = e
        if jax.process_count() > 1:
            refused = multihost_utils.broadcast_one_to_all(jnp.int32(busy is not None))
            if bool(refused) and busy is None:
                busy = RunFolderBusy(f"--workdir: {self.workdir!r} is in use by another "
                                     f"trainer (process 0 says who)")
        if busy is not None:
            raise busy
        self.locked = True

    def create(self) -> None:
        """Creates the folder (process 0) and locks it, unless it was locked already."""
        if not self.locked:
            if self.chief:
                make_workdir(self.workdir)
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("kimi_k3_workdir_created")
            self.lock()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def resume_changes(old, config, spec: RunSpec, start: int) -> list[str]:
    """What a resumed run changes from its previous start (``old``: that start's config, or
    None), one line per field, and what a change of the optimizer's fields or of train.steps
    does to the learning rate at the step it resumes from."""
    if old is None:
        return []
    fields = config_changes(old, config)
    if not fields:
        return []
    lines = [f"changed since the last start: {f}" for f in fields]
    if any(f.startswith(("opt.", "train.steps")) for f in fields):
        try:
            was = float(optim.lr_schedule(opt_spec(old.opt), int(old.train.steps))(start))
        except (ValueError, KeyError, AttributeError, TypeError):  # an older config's fields
            was = None
        now = float(optim.lr_schedule(spec.opt, spec.train.steps)(start))
        if was is None:
            lines.append(f"the learning rate at step {start} is now {now:.3g}")
        else:
            lines.append(f"the learning-rate schedule follows the new fields from step {start}: "
                         f"{was:.3g} -> {now:.3g} there (a schedule is a function of the step, "
                         f"so a new peak or length bends it from here on)")
    return lines


def train(config, workdir: str, config_name: str = "config") -> dict:
    """Trains ``config`` (the ConfigDict of a configs/ file) in ``workdir``, resuming from its
    latest checkpoint; returns the last train and eval metrics.

    The config is checked once, into a RunSpec (kimi_k3/config.py). Nothing is written before
    everything that can be checked is: the fields, the workdir, the mesh, the data files, the
    optimizer and the checkpoint to resume from. So a run that fails on bad input leaves the
    workdir as it was, and creates none that did not exist.

    One trainer per run folder (``RunFolder``): a second is refused with RunFolderBusy naming
    the holder. A run stopped by SIGTERM, SIGINT (Ctrl-C) or a multi-host preemption notice
    saves the step it reached, waits for the save, then raises ``runtime.Interrupted`` (exit 75
    from train.py); a save that fails raises ``checkpoint.CheckpointSaveError`` (exit 1).
    """
    # ---- Config -----------------------------------------------------------------------------
    spec = run_spec(config)
    workdir = check_workdir(workdir, create=False)
    quiet_library_logs()
    chief = jax.process_index() == 0
    folder = RunFolder(workdir, chief)
    exists = os.path.isdir(workdir)
    if jax.process_count() > 1:  # every process takes the same path: process 0's
        exists = bool(multihost_utils.broadcast_one_to_all(jnp.int32(exists)))
    if exists:
        folder.lock()
    try:
        return _train(spec, config, workdir, config_name, folder)
    finally:
        folder.release()


def _train(spec: RunSpec, config, workdir: str, config_name: str, folder: RunFolder) -> dict:
    """``train`` once the config and the run folder are checked."""
    chief = folder.chief
    tc, dc = spec.train, spec.data
    B, T = dc.global_batch_size, dc.seq_len

    # ---- Mesh -------------------------------------------------------------------------------
    mesh = mesh_lib.make_mesh(spec.mesh)

    # ---- Input ------------------------------------------------------------------------------
    split = data_lib.load_split(dc, spec.model.vocab_size)
    train_rows = data_lib.PackedRows(split.train, T, spec.seed, dc.shuffle)
    eval_rows = data_lib.PackedRows(split.eval, T, 0, False) if split.eval else None
    eval_batches = min(tc.eval_batches, eval_rows.num_rows // B) if eval_rows else 0
    if eval_rows and eval_batches == 0:
        logging.warning("held-out split has %d rows, fewer than one batch of %d: no eval",
                        eval_rows.num_rows, B)

    # ---- Model, optimizer, sharding, update step ---------------------------------------------
    setup = build(config, mesh)
    host_rows = data_lib.host_batch_slice(setup.batch_sharding, (B, T))
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(setup.abstract_state["params"]))
    fpt = float(flops_per_token(spec.model, T))
    peak = metrics_lib.peak_flops_per_device(device.probe().kind,
                                             tc.peak_tflops_per_device)

    # ---- Checkpoint restore -------------------------------------------------------------------
    folder.create()
    if spec.checkpoint.enabled:
        ckpt_dir = absolute_path(spec.checkpoint.dir or os.path.join(workdir, "checkpoints"))
        ckpt = ckpt_lib.Checkpointer(ckpt_dir, spec.checkpoint)
    else:
        ckpt_dir, ckpt = "", ckpt_lib.NoCheckpoints()
    last = {"train": {}, "eval": {}}
    writer = bar = preempt = loop = None
    try:
        it = data_lib.BatchIterator(train_rows, B, host_rows)
        restored = ckpt.restore(setup.abstract_state)
        start = 0 if restored is None else restored[0]
        if start >= tc.steps:
            console(f"{workdir}: already at step {start} of train.steps={tc.steps}; nothing to "
                    f"train (raise --config.train.steps to go on)")
            return last
        if restored is None:
            state = setup.init_state()
        else:
            _, state, data_state = restored
            it.restore(data_state)

        # ---- Outputs: only now that the run can start ------------------------------------
        changed = resume_changes(previous_config(workdir), config, spec, start) if start else []
        if chief:
            write_config(config, workdir, start)
        console(run_summary(spec, workdir=workdir, config_name=config_name, mesh=mesh,
                            n_params=n_params, train_rows=train_rows.num_rows,
                            eval_rows=eval_rows.num_rows if eval_rows else 0,
                            eval_batches=eval_batches, start=start, ckpt_dir=ckpt_dir,
                            microbatch=setup.microbatch_size, split=split))
        if restored is not None:
            console(f"resumed from step {start} ({ckpt_dir}/{start}); data position "
                    f"{it.position:,} rows")
        for line in changed:
            console(f"  {line}")
        for step, why, moved in ckpt.set_aside:
            console(f"  not from step {step}, which is unreadable ({why}): moved to {moved}")
        logging.info("config:\n%s", "\n".join(flat_config(config)))
        if not spec.checkpoint.enabled:
            logging.warning("checkpoint.enabled is False: nothing of this run is saved")
        writer = metrics_lib.MetricsWriter(workdir, enabled=chief, tensorboard=tc.tensorboard,
                                           start=start)
        writer.text("config", "```\n" + "\n".join(flat_config(config)) + "\n```")
        bar = metrics_lib.ProgressBar(tc.steps, enabled=chief and tc.progress_bar)
        writer.console = bar.write
        preempt = ckpt_lib.PreemptionFlag()
        internals = InternalsReport.build(spec, setup, eval_rows, workdir, chief)
        if internals is not None:
            console(internals.describe())
        console(f"compiling the train step (the progress bar starts after step {start + 1})")
        loop = _Loop(spec, setup, ckpt, writer, bar, preempt,
                     _Evaluator(eval_rows, eval_batches, host_rows, B), fpt, peak,
                     internals=internals)
        last = loop.run(state, it, start)
    finally:
        if preempt is not None:
            preempt.restore_handler()
        ckpt.close()  # waits for the last save: a failed one raises CheckpointSaveError
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.plot()  # curves.png to the last report, however the run ended
            writer.close()
    if loop is not None and loop.stopped_at is not None:
        step = loop.stopped_at
        saved = (f"saved step {step} in {ckpt_dir}/{step}; run the same command again to "
                 f"resume from it" if spec.checkpoint.enabled else
                 "nothing was saved (checkpoint.enabled=False)")
        raise Interrupted(f"stopped at step {step} of {tc.steps} on {loop.stopped_by}; {saved}")
    return last


@dataclasses.dataclass
class _Evaluator:
    """The held-out loss over ``batches`` global batches of ``rows`` (none when 0)."""

    rows: data_lib.PackedRows | None
    batches: int
    host_rows: slice
    batch_size: int

    def loss(self, setup: Setup, state) -> dict:
        """{"loss", "perplexity"} of ``state``'s model; {} without held-out batches."""
        if not self.batches:
            return {}
        ev = data_lib.BatchIterator(self.rows, self.batch_size, self.host_rows)
        tot, cnt = 0.0, 0
        with setup.context():
            for _ in range(self.batches):
                s, n = setup.eval_step(model_part(state),
                                       global_batch(next(ev), setup.batch_sharding,
                                                    self.batch_size))
                tot, cnt = tot + float(s), cnt + int(n)
        loss = tot / max(cnt, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


@dataclasses.dataclass
class InternalsReport:
    """The internals report (kimi_k3/internals.py) of the model on the first held-out rows:
    when it is due (``train.internals_every``; -1 follows the evaluations), and its own jitted
    function (compiled at its first use, never part of the training step). Process 0 writes the
    metrics (split "internals") and redraws ``internals_*.png`` in the run folder."""

    every: int  # steps between reports; -1: at each evaluation
    eval_every: int
    steps: int
    batch: dict  # the held-out rows, global arrays
    fn: object  # jitted: (model part of the state, batch) -> internals.measure's dict
    workdir: str
    chief: bool

    @classmethod
    def build(cls, spec: RunSpec, setup: Setup, eval_rows, workdir: str,
              chief: bool) -> InternalsReport | None:
        """None when off: ``internals_every=0``, a stand-in model, or no held-out row per
        data-parallel device (said when an interval was asked for; the default, at each
        held-out evaluation, has nothing to report on without held-out data)."""
        tc, B, T = spec.train, spec.data.global_batch_size, spec.data.seq_len
        if tc.internals_every == 0 or setup.spec.model is None:  # off, or a stand-in model
            return None
        available = eval_rows.num_rows if eval_rows is not None else 0
        n = internals_lib.internals_rows(B, mesh_lib.data_parallel_size(setup.mesh), available)
        if n == 0 and tc.internals_every > 0:
            logging.warning("train.internals_every=%d: no internals report (the held-out split "
                            "has %d rows of %d tokens, fewer than one per data-parallel device)",
                            tc.internals_every, available, T)
        if n == 0:
            return None
        lo, hi = data_lib.host_batch_slice(setup.batch_sharding, (n, T))
        batch = global_batch(eval_rows.rows(range(lo, hi)), setup.batch_sharding, n)
        shardings = {"tokens": setup.batch_sharding, "segment_ids": setup.batch_sharding}
        fn = jax.jit(internals_lib.internals_fn(setup.graphdef, setup.rest),
                     in_shardings=(model_part(setup.state_shardings), shardings),
                     out_shardings=mesh_lib.replicated(setup.mesh))
        return cls(tc.internals_every, tc.eval_every, tc.steps, batch, fn, workdir, chief)

    def describe(self) -> str:
        """The first screen's line."""
        when = (f"every {self.every} steps" if self.every > 0 else
                f"at each eval (every {self.eval_every or self.steps} steps)")
        return (f"  internals   {when} on {self.batch['tokens'].shape[0]} held-out rows -> "
                f"metrics.jsonl (split internals), internals_*.png")

    def due(self, step: int) -> bool:
        """At every ``every`` steps (or every evaluation's) and at the last step."""
        every = self.eval_every if self.every < 0 else self.every
        return step == self.steps or bool(every and step % every == 0)

    def record(self, setup: Setup, state, step: int, writer: metrics_lib.MetricsWriter) -> None:
        with setup.context():
            stats = self.fn(model_part(state), self.batch)
        stats = jax.tree.map(np.asarray, jax.device_get(stats))
        writer.write(step, internals_lib.flat_metrics(stats, setup.spec.model), split="internals")
        if not self.chief:
            return
        try:
            internals_lib.write_plots(stats, setup.spec.model, self.workdir,
                                      title=f"{os.path.basename(self.workdir)} step {step}")
        except Exception as e:  # a picture is never worth stopping a run for
            logging.warning("could not draw the internals plots in %s (%s: %s); training goes on",
                            self.workdir, type(e).__name__, e)


@dataclasses.dataclass
class _Loop:
    """The steps from a start to ``train.steps``: update, report, save, evaluate.

    ``run`` returns {"train": the last logged train metrics, "eval": the last eval metrics}.
    Between log lines the loop keeps a window of losses and a clock: the clock starts after the
    first step (which includes compilation) and pauses for evaluations.
    """

    spec: RunSpec
    setup: Setup
    ckpt: ckpt_lib.Checkpointer | ckpt_lib.NoCheckpoints
    writer: metrics_lib.MetricsWriter
    bar: metrics_lib.ProgressBar
    preempt: ckpt_lib.PreemptionFlag
    evaluator: _Evaluator
    flops_per_token: float
    peak: float | None
    last_train: dict = dataclasses.field(default_factory=dict)
    last_eval: dict = dataclasses.field(default_factory=dict)
    # where and why the loop stopped before train.steps (None: it did not)
    stopped_at: int | None = None
    stopped_by: str = ""
    # the window since the last log line: summed loss, counted and skipped steps
    window_loss: float = 0.0
    window_steps: int = 0
    window_skipped: int = 0
    # the clock: when it last read, and how many steps had been dispatched then
    clock_t: float | None = None
    clock_step: int = 0
    internals: InternalsReport | None = None  # the internals report, when on

    def run(self, state, it, start: int) -> dict:
        tc = self.spec.train
        B = self.spec.data.global_batch_size
        self.clock_step = start
        step, pending = start, None
        saved_at = start if start else None
        while step < tc.steps:
            if self.preempt.is_set() or self.ckpt.reached_preemption(step):
                self.stopped_by = self.preempt.received or "a preemption notice"
                logging.warning("stopping on %s: saving step %d", self.stopped_by, step)
                if saved_at != step:
                    self.ckpt.save(step, state, it.state())
                    saved_at = step
                self.stopped_at = step
                break
            batch = global_batch(next(it), self.setup.batch_sharding, B)
            with self.setup.context():
                state, m = self.setup.train_step(state, batch)
            step += 1
            if pending is not None:
                self._report(*pending, state, step)
            pending = (step, m)
            if self.ckpt.should_save(step):
                self.ckpt.save(step, state, it.state())
                saved_at = step
            if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
                self._report(*pending, state, step)
                pending = None
                self._evaluate(state, step)
            if self.internals is not None and step < tc.steps and self.internals.due(step):
                if pending is not None:
                    self._report(*pending, state, step)
                    pending = None
                self._look_inside(state, step)
        if pending is not None:
            self._report(*pending, state, step)
        if step == tc.steps:
            if saved_at != step:
                self.ckpt.save(step, state, it.state())
            self._evaluate(state, step)
            if self.internals is not None:
                self._look_inside(state, step)
        return {"train": self.last_train, "eval": self.last_eval}

    def _evaluate(self, state, step: int) -> None:
        """The held-out loss at ``step`` (with held-out data), then curves.png redrawn;
        neither counts as training time."""
        result = self.evaluator.loss(self.setup, state)
        if result:
            self.last_eval = result
            self.writer.write(step, result, split="eval")
            if self.clock_t is not None:  # evaluation time is not training time
                self.clock_t, self.clock_step = time.perf_counter(), step
        drawing = time.perf_counter()
        self.writer.plot()
        if self.clock_t is not None:  # nor is drawing time
            self.clock_t += time.perf_counter() - drawing

    def _look_inside(self, state, step: int) -> None:
        """The internals report at ``step``; not training time, as an evaluation is not."""
        self.internals.record(self.setup, state, step, self.writer)
        if self.clock_t is not None:
            self.clock_t, self.clock_step = time.perf_counter(), step

    def _report(self, step: int, m, newest, dispatched: int) -> None:
        """Host side of a finished step: NaN check, progress, periodic metrics. ``newest`` is
        the newest dispatched state and ``dispatched`` the steps dispatched so far."""
        tc, ckpt = self.spec.train, self.ckpt
        B, T = self.spec.data.global_batch_size, self.spec.data.seq_len
        m = jax.device_get(m)
        loss = float(m["loss"])
        latest = lambda: (None if ckpt.latest_step() is None
                          else f"{ckpt.latest_step()} ({ckpt.directory}/{ckpt.latest_step()})")
        if not check_finite(step, m, tc.nan_policy, latest):
            self.window_skipped += 1
        else:
            self.window_loss += loss
            self.window_steps += 1
        self.bar.start(step - 1)  # after the first step, so its rate and ETA leave out compilation
        self.bar.update(1, loss=loss)
        log = step % tc.log_every == 0 or step == tc.steps
        # The clock is read only when every dispatched step has finished, so a window's time
        # is exactly that of the steps it counts: a micro-batched step can return from dispatch
        # partly run, so guessing how many had finished misreads a window. The wait costs one
        # step's overlap of host and device per log window.
        if self.clock_t is None or log:
            _wait_until_ready(newest)
        now = time.perf_counter()
        if self.clock_t is None:  # the first step includes compilation: time from its end
            self.clock_t, self.clock_step = now, dispatched
        if not log:
            return
        steps_timed = dispatched - self.clock_step
        rec = {"loss": self.window_loss / max(self.window_steps, 1),
               "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"])}
        rec["perplexity"] = math.exp(min(rec["loss"], 50.0))
        rec.update(moe_report(m, self.setup.moe_layers))
        if steps_timed > 0:
            dt = now - self.clock_t
            tps = steps_timed * B * T / dt
            rec.update(step_time_s=dt / steps_timed, tokens_per_s=tps,
                       mfu=metrics_lib.mfu(self.flops_per_token, tps, self.peak,
                                           jax.device_count()))
            self.clock_t, self.clock_step = now, dispatched
        if self.window_skipped:
            rec["skipped_steps"] = self.window_skipped
        self.writer.write(step, rec)
        self.last_train = rec
        self.window_loss, self.window_steps, self.window_skipped = 0.0, 0, 0
