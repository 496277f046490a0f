"""Logical axis names, and the one place where they meet a device mesh.

The model never names a mesh axis. Every parameter carries logical names in its ``out_sharding``
metadata (``nnx.Param(..., out_sharding=("embed", "mlp"))``), and activations are constrained at
block boundaries with :func:`constrain` using ``activation_*`` names. A trainer picks the
parallelism by choosing *rules*, a tuple of ``(logical name, mesh axis or axes or None)`` pairs,
exactly as in ``flax.linen.logical_axis_rules``; changing them never touches model code.

Parameter axes:
    vocab    vocabulary                         embed    model width D
    heads    attention / KDA heads              kv       per-head feature dim
    mlp      MLP hidden dim                     kv_lora  MLA latent (kv_lora_rank)
    q_lora   MLA low-rank query dim             rank     KDA low-rank gate bottleneck
    conv     short-convolution taps             norm     norm scales over D
    layers   the stacked (scanned) layer axis

Activation axes: activation_batch, activation_length, activation_embed, activation_heads,
activation_kv, activation_mlp, activation_vocab.

Typical use in a trainer::

    rules = sharding.make_rules(mesh)                    # or your own tuple of pairs
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        model = sharding.create_sharded(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)), mesh, rules)
        ...  # jit the train step; activations follow the constraints inside the model

Without a mesh or without rules in context, :func:`constrain` is the identity, so the model runs
unchanged on one device and in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from flax import linen as nn
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Every logical name the model uses, parameter axes first.
PARAM_AXES = ("vocab", "embed", "heads", "kv", "mlp", "kv_lora", "q_lora", "rank", "conv", "norm",
              "layers")
ACTIVATION_AXES = (
    "activation_batch", "activation_length", "activation_embed", "activation_heads",
    "activation_kv", "activation_mlp", "activation_vocab",
)
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

# BTD: the residual stream at a block boundary.
BTD = ("activation_batch", "activation_length", "activation_embed")
BTHK = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
BTF = ("activation_batch", "activation_length", "activation_mlp")
BTV = ("activation_batch", "activation_length", "activation_vocab")

# Data parallel over ("data", "fsdp"), parameters sharded over "fsdp" (ZeRO-3 style) along the
# model width and over "tensor" along heads / MLP / vocabulary (Megatron style).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("kv_lora", None),
    ("q_lora", None),
    ("rank", None),
    ("conv", None),
    ("norm", None),
    ("layers", None),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def make_rules(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> tuple:
    """``rules`` restricted to the axes ``mesh`` has: mesh axes it lacks are dropped (unsharded).

    Lets one rule set serve a 1-D data-parallel mesh and a 3-D ("data", "fsdp", "tensor") mesh.
    """
    present = set(mesh.axis_names)
    out = []
    for name, axes in rules:
        if axes is None:
            out.append((name, None))
            continue
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a in present)
        out.append((name, kept if len(kept) > 1 else (kept[0] if kept else None)))
    return tuple(out)


def axis_rules(rules: Rules):
    """Context manager putting ``rules`` in force for :func:`constrain` (flax's own context)."""
    return nn.logical_axis_rules(rules)


def _rules_in_context() -> bool:
    return bool(core_spmd.get_logical_axis_rules()) and not jax.sharding.get_abstract_mesh().empty


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names; the identity without a mesh and rules."""
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
    if not _rules_in_context():
        return x
    return nn.with_logical_constraint(x, tuple(names))


def param(value: jax.Array, names: Sequence[str | None]) -> nnx.Param:
    """An ``nnx.Param`` carrying logical axis names.

    Flax's eager sharding would look ``names`` up as mesh axes and fail on names a rule set
    leaves out, so it is switched off here; instead, when a mesh and rules are in context, the
    value is constrained by the same logical rules as activations (names without a rule stay
    unsharded). Under ``jax.jit`` that places each parameter where the rules say.
    """
    names = tuple(names)
    if len(names) != value.ndim:
        raise ValueError(f"param: {len(names)} axis names {names} for a value of rank {value.ndim}")
    if _rules_in_context():
        value = nn.with_logical_constraint(value, names)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def logical_to_mesh_sharding(tree, mesh: Mesh, rules: Rules):
    """NamedShardings for every ``nnx.Variable`` in ``tree`` (a module, an nnx.State, or their
    abstract versions from ``nnx.eval_shape``), same structure, ready for ``jax.jit``'s
    ``in_shardings`` / ``out_shardings`` or ``jax.device_put``.

    Names with no rule, and Variables without names, are replicated.
    """

    def one(x):
        if not isinstance(x, nnx.Variable):
            return x
        names = x.get_metadata().get("out_sharding")
        spec = nn.logical_to_mesh_axes(tuple(names), rules) if names else PartitionSpec()
        return x.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(make_model: Callable[[], nnx.Module], mesh: Mesh, rules: Rules) -> nnx.Module:
    """Builds ``make_model()`` directly into its sharded layout (no replicated copy first).

    The shapes come from ``nnx.eval_shape``; the initialiser then runs under ``jax.jit`` with
    ``out_shardings`` from :func:`logical_to_mesh_sharding`.
    """
    abstract = nnx.eval_shape(make_model)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = logical_to_mesh_sharding(abstract_state, mesh, rules)

    def init():
        return nnx.state(make_model())

    with jax.set_mesh(mesh), axis_rules(rules):
        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)
