"""The train state of a run on a mesh, before anything is allocated: its shapes, its shardings
and the optimizer that makes part of it.

    layout = state_layout(run_spec(config), mesh)
    layout.abstract_state      # {"params", "opt_state", "step", "rng"[, "model_state"]}:
                               # ShapeDtypeStructs carrying their target shardings
    layout.state_shardings     # the same tree of NamedShardings
    layout.tx, layout.schedule # the optax optimizer and its learning-rate schedule
    state, rest = layout.make_state()   # traceable: call it under jit (the trainer does)

The trainer (``train_lib.build``) adds the jitted steps to it; the Hugging Face import
(``kimi_k3.hf``) places released weights onto the same shardings and writes a step 0 the
trainer resumes from. Shapes come from ``nnx.eval_shape``; nothing is initialised here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from kimi_k3 import mesh as mesh_lib
from kimi_k3 import optim
from kimi_k3 import sharding as sharding_lib
from kimi_k3.config import RunSpec
from kimi_k3.layers.moe import ExpertBias
from kimi_k3.model_state import make_model, split_for_training


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What a run's train state is on ``mesh``: see the module docstring."""

    mesh: jax.sharding.Mesh
    rules: tuple  # the logical axis rules (config.mesh.axis_rules, normalised)
    abstract_model: nnx.Module  # the model under nnx.eval_shape
    graphdef: object
    abstract_rest: nnx.State  # the model's state that is neither a parameter nor carried
    tx: optax.GradientTransformation
    schedule: Callable
    abstract_state: dict  # ShapeDtypeStructs carrying the target shardings
    state_shardings: dict
    make_state: Callable[[], tuple[dict, nnx.State]]  # (the initial train state, the rest)

    def context(self):
        """The mesh and the logical rules, in force while the model is traced."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(sharding_lib.axis_rules(self.rules))
        return stack


def state_layout(spec: RunSpec, mesh, model_fn=None) -> StateLayout:
    """The train state of ``spec`` on ``mesh``: parameter shardings from the logical axis names
    (divisibility checked, the error naming the parameter), the optimizer's state sharded like
    the parameters it follows, the step and RNG replicated, and the routing biases of a mixture
    of experts (carried, updated and saved beside the parameters) when the model has them.

    ``model_fn(seed) -> nnx.Module`` builds the model (default: ``HybridLM(spec.model)``); it
    is called under ``nnx.eval_shape`` here and inside ``make_state``, never eagerly.
    """
    rules, seed = spec.mesh.axis_rules, spec.seed
    if model_fn is None:
        model_fn = lambda s: make_model(spec.model, s)

    abstract_model = nnx.eval_shape(lambda: model_fn(seed))
    graphdef, abs_params_state, abs_model_state, abs_rest = nnx.split(
        abstract_model, nnx.Param, ExpertBias, ...)
    abs_params = nnx.to_pure_dict(abs_params_state)
    names = sharding_lib.variable_axes(abs_params_state)
    param_shardings = sharding_lib.tree_shardings(abs_params, names, mesh, rules, root="params/")

    tx, schedule = optim.make_optimizer(spec.opt, spec.train.steps, abs_params, names)
    repl = mesh_lib.replicated(mesh)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    opt_shardings = sharding_lib.shardings_like_params(abs_opt, abs_params, param_shardings, repl)
    state_shardings = {"params": param_shardings, "opt_state": opt_shardings,
                       "step": repl, "rng": repl}
    has_model_state = bool(jax.tree.leaves(abs_model_state))
    if has_model_state:
        state_shardings["model_state"] = sharding_lib.tree_shardings(
            nnx.to_pure_dict(abs_model_state), sharding_lib.variable_axes(abs_model_state), mesh,
            rules, root="model_state/")

    def make_state():
        _, params, model_state, rest = split_for_training(model_fn(seed))
        state = {"params": params, "opt_state": tx.init(params),
                 "step": jnp.zeros((), jnp.int32), "rng": jax.random.PRNGKey(seed + 1)}
        if has_model_state:
            state["model_state"] = model_state
        return state, rest

    abs_state = jax.eval_shape(lambda: make_state()[0])
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abs_state,
        state_shardings)
    return StateLayout(mesh=mesh, rules=rules, abstract_model=abstract_model, graphdef=graphdef,
                       abstract_rest=abs_rest, tx=tx, schedule=schedule,
                       abstract_state=abstract_state, state_shardings=state_shardings,
                       make_state=make_state)
