"""A model from its spec, and the model as arrays: what the trainer and every reader share.

    model = make_model(spec_or_config_model, seed)      # HybridLM, initialised eagerly
    model = init_model(config.model, seed)              # the same weights, one jitted program
    init = ModelInit(config.model, seed); init.abstract  # its shapes, traced; init.run(): model
    graphdef, params, rest = split_model(model)         # params: a nested dict of arrays
    init_cache = empty_cache_fn(model)                  # model.init_cache as one program
    model = merge_model(graphdef, params, rest)         # fresh variables, safe under jit/grad

``split_for_training`` also separates the model state the trainer carries beside the
parameters (a mixture of experts' routing biases, ``ExpertBias``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from kimi_k3.layers.moe import ExpertBias
from kimi_k3.model import HybridLM
from kimi_k3.runtime import run_once_compiler_options


def make_model(model_spec, seed: int) -> HybridLM:
    """``HybridLM(model_spec)`` initialised from ``seed`` (a ModelSpec or config.model)."""
    return HybridLM(model_spec, rngs=nnx.Rngs(seed))


class ModelInit:
    """``make_model(model_cfg, seed)`` as one jitted program (``init_model``), traced and
    lowered when built: ``abstract`` is the model it makes, as shapes and dtypes, before the
    program is compiled (or read from the persistent cache) and run by ``run()``. A caller can
    compile programs for ``abstract`` meanwhile, and the model is still traced only once.

    Lowered here, not in ``run()``: tracing and lowering hold Python's lock, compiling and
    reading the cache do not, so a thread tracing for ``abstract`` overlaps the latter."""

    def __init__(self, model_cfg, seed: int):
        options = run_once_compiler_options(jax.default_backend())  # LLVM without optimisations
        traced = jax.jit(lambda: nnx.split(make_model(model_cfg, seed)),
                         compiler_options=options).trace()
        self._lowered = traced.lower()
        graphdef, state = traced.out_info
        self.abstract: HybridLM = nnx.merge(graphdef, jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                           weak_type=getattr(s, "weak_type", False)), state))

    def run(self) -> HybridLM:
        graphdef, state = self._lowered.compile()()
        return nnx.merge(graphdef, state)


def init_model(model_cfg, seed: int) -> HybridLM:
    """``make_model(model_cfg, seed)`` built inside one jitted program, as HybridLM's docstring
    asks: eagerly, every initialiser dispatches and compiles on its own. The same threefry
    keys, so the same weights up to float32 rounding (XLA fuses the initialisers'
    arithmetic).

    The model is traced once: its graphdef (static, no arrays) comes out of the jitted program
    beside the state rather than from a second trace under ``nnx.eval_shape``, host time
    spent on every call, the persistent compilation cache's hits included."""
    return ModelInit(model_cfg, seed).run()


def empty_cache_fn(model) -> Callable[[int, int], Any]:
    """``(batch_size, max_len) -> model.init_cache(batch_size, max_len)``, for an
    ``nnx.Module`` one jitted program per (batch_size, max_len), compiled on its first call:
    built eagerly, each dtype and shape of the cache's arrays is a program of its own, compiled
    afresh in every process (each takes less than the second JAX's persistent cache asks before
    it keeps a program). Any other model's ``init_cache`` is returned as it is. Keep the
    function: a new one compiles again."""
    if not isinstance(model, nnx.Module):
        return model.init_cache
    return jax.jit(model.init_cache, static_argnums=(0, 1))


def split_model(model):
    """(graphdef, params as a nested dict of arrays, the other state)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), rest


def split_for_training(model):
    """(graphdef, params, model state, the rest): params and the model state the trainer carries
    (the routing biases; {} without a mixture of experts) as nested dicts of arrays, the rest
    (constants, and measurements the forward pass overwrites) as an nnx State."""
    graphdef, params, model_state, rest = nnx.split(model, nnx.Param, ExpertBias, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(model_state), rest


def merge_model(graphdef, params, rest, model_state=None):
    """The model from ``split_model`` / ``split_for_training``'s parts. Its variables are fresh
    copies, so a forward pass under ``jit`` or ``grad`` may write its measurements into them."""
    states = [nnx.State(params)] + ([nnx.State(model_state)] if model_state else []) + [rest]
    return nnx.merge(graphdef, *states, copy=True)
