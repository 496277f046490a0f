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
    layers   the stacked (scanned) layer axis   expert   a mixture's routed experts

Activation axes: activation_batch, activation_length, activation_embed, activation_heads,
activation_kv, activation_mlp, activation_vocab.

Typical use in a trainer::

    rules = sharding.make_rules(mesh)                    # or your own tuple of pairs
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        model = sharding.create_sharded(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)), mesh, rules)
        ...  # jit the train step; activations follow the constraints inside the model

Without a mesh or without rules in context, :func:`constrain` is the identity, so the model runs
unchanged on one device and in tests.

Context parallelism (the "context" mesh axis under "activation_length"): the sequence-mixing
cores (KDA's recurrence and short convolutions, MLA's attention) run inside ``shard_map`` and
exchange what crosses shard boundaries themselves; :func:`context_layout` tells them the axes.

The mixture of experts leaves the compiler's automatic partitioning for its dispatch: it sorts
tokens per device and sends them to their experts' devices by all-to-all inside ``shard_map``.
:func:`expert_layout` tells it, from the same rules, which mesh axes split its tokens, its
experts and its experts' hidden width.

Kernels (the Pallas KDA kernel, splash and Triton attention) are partitioned by hand: a custom
call is opaque to the compiler's partitioner (Mosaic refuses outright: "Mosaic kernels cannot
be automatically partitioned"), so :func:`per_device` runs one inside ``shard_map`` on each
device's rows and heads, named by the same logical axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
from flax import linen as nn
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_k3.config import DEFAULT_RULES
from kimi_k3.trees import path_str

# Every logical name the model uses, parameter axes first.
PARAM_AXES = ("vocab", "embed", "heads", "kv", "mlp", "kv_lora", "q_lora", "rank", "conv", "norm",
              "layers", "expert")
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
# A kernel's [B, T, heads, dim] operand, split by rows and heads only: each device's kernel
# call takes whole sequences (its work is independent across rows and heads, not tokens).
ROWS_HEADS = ("activation_batch", None, "activation_heads", None)

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


def rules_in_force() -> tuple:
    """The logical axis rules in force (flax's context), as a hashable tuple: a key for caches
    of traces that read them."""
    return tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                 for name, axes in core_spmd.get_logical_axis_rules())


def _rules_in_context() -> bool:
    return bool(core_spmd.get_logical_axis_rules()) and not jax.sharding.get_abstract_mesh().empty


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names; the identity without a mesh and rules."""
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
    if not _rules_in_context():
        return x
    return nn.with_logical_constraint(x, tuple(names))


def param(value: jax.Array, names: Sequence[str | None], kind: type = nnx.Param) -> nnx.Variable:
    """An ``nnx.Param`` (or another ``kind`` of ``nnx.Variable``) carrying logical axis names.

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
    return kind(value, out_sharding=names, eager_sharding=False)


# ---------------------------------------------------------------------------------------------
# Kernels: partitioned by hand
# ---------------------------------------------------------------------------------------------


def _is_names(x) -> bool:
    """One array's logical axis names: a tuple of names (str) and unsplit axes (None)."""
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def per_device(fn: Callable, args: Sequence, names: Sequence, out_names):
    """``fn(*args)``, run inside ``shard_map`` on each device's part of its arguments when the
    mesh in context has more than one device (the module docstring says why kernels need it).

    names: per argument, its logical axis names (one per dimension, None for an axis not split;
    ``()`` for a scalar); an argument that is None passes through as None. out_names: the names
    of ``fn``'s result, or a tuple of them for a tuple of results (a result that is None stays
    None). The rules in force turn every name into mesh axes, so the caller names only the axes
    along which ``fn`` is independent (rows, heads): each device computes its part alone, with
    no collective. Without a mesh and rules in context, on one device, or inside ``shard_map``
    already (axes in manual mode): ``fn(*args)``.
    """
    if len(names) != len(args):
        raise ValueError(f"per_device: {len(names)} names for {len(args)} arguments")
    if not _rules_in_context():
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.size == 1 or mesh.manual_axes:
        return fn(*args)
    rules = core_spmd.get_logical_axis_rules()
    in_specs = tuple(logical_to_spec(n, rules) for n in names)
    out_specs = jax.tree.map(lambda n: logical_to_spec(n, rules), out_names, is_leaf=_is_names)
    # check_vma=False: a Pallas call declares no per-device types for its outputs, which
    # shard_map's type check would require; every output is split like the inputs it comes from.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)


# ---------------------------------------------------------------------------------------------
# Expert parallelism: where a mixture of experts' manual dispatch meets the mesh
# ---------------------------------------------------------------------------------------------


def _mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """The mesh axes a mixture of experts' ``shard_map`` works over, from the rules in force.

    tokens      PartitionSpec of a [B, T, ...] token array: rows over the batch axes, positions
                over the length axes (each device routes its own tokens)
    experts     mesh axes (of more than one device) the routed experts are split over: the
                "expert" logical axis
    num_shards  devices along ``experts``
    dispatch    how tokens meet experts held elsewhere: "all_to_all" when the expert axes also
                split the tokens (the default rules: each device sends its tokens to the devices
                holding their experts and gets the outputs back), "psum" when they do not (every
                device along them holds the same tokens, runs its own experts on them, and the
                partial outputs are summed), "local" when one device holds every expert
    ffn         mesh axes the experts' hidden width is split over (the expert weights' last
                logical axis), on which no token axis lies: partial outputs, summed by psum
    """

    mesh: jax.sharding.AbstractMesh
    tokens: PartitionSpec
    experts: tuple[str, ...]
    num_shards: int
    dispatch: str
    ffn: tuple[str, ...]


def expert_layout(expert_weight_names: Sequence[str | None]) -> ExpertLayout | None:
    """The layout for expert weights named ``expert_weight_names`` ([expert, ..., hidden]) under
    the mesh and rules in context; None without them (one device: no ``shard_map``). Raises
    ValueError naming ``mesh.axis_rules`` when the expert axes split the tokens only in part."""
    if not _rules_in_context():
        return None
    rules = core_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    batch, length = nn.logical_to_mesh_axes(("activation_batch", "activation_length"), rules)
    token_axes = set(_mesh_axes(batch)) | set(_mesh_axes(length))
    spec = nn.logical_to_mesh_axes(tuple(expert_weight_names), rules)
    experts = tuple(a for a in _mesh_axes(spec[0]) if mesh.shape[a] > 1)
    ffn = tuple(a for a in _mesh_axes(spec[len(expert_weight_names) - 1])
                if a not in token_axes and a not in experts and mesh.shape[a] > 1)
    shared = [a for a in experts if a in token_axes]
    if not experts:
        dispatch = "local"
    elif len(shared) == len(experts):
        dispatch = "all_to_all"
    elif not shared:
        dispatch = "psum"
    else:
        raise ValueError(
            f"mesh.axis_rules: the experts are split over mesh axes {experts}, of which "
            f"{tuple(shared)} also split the tokens (activation_batch / activation_length) and "
            f"the others do not; make them all token axes or none")
    return ExpertLayout(mesh=mesh, tokens=PartitionSpec(batch, length), experts=experts,
                        num_shards=math.prod(mesh.shape[a] for a in experts), dispatch=dispatch,
                        ffn=ffn)


# ---------------------------------------------------------------------------------------------
# Context parallelism: where the sequence-mixing layers' manual communication meets the mesh
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """The mesh axes a sequence's tokens are split over, from the rules in force.

    axes        mesh axes (of more than one device) of the "activation_length" logical axis:
                shard i holds tokens i T/n .. (i+1) T/n - 1 (contiguous, in mesh order)
    num_shards  n, the devices along ``axes``
    batch       mesh axes of "activation_batch" (rows), for the shard_map specs
    heads       mesh axes of "activation_heads"
    rules       the logical axis rules in force (for the specs of the weights a layer passes in)
    """

    mesh: jax.sharding.AbstractMesh
    axes: tuple[str, ...]
    num_shards: int
    batch: str | tuple[str, ...] | None
    heads: str | tuple[str, ...] | None
    rules: tuple

    def splits(self, T: int, min_shard: int = 1) -> bool:
        """Whether T tokens split into ``num_shards`` equal shards of at least ``min_shard``
        tokens (a decoding step of one token does not: it runs unsplit)."""
        return T % self.num_shards == 0 and T // self.num_shards >= min_shard

    @property
    def tokens(self) -> PartitionSpec:
        """The spec of a [B, T] array: rows over ``batch``, tokens over ``axes``."""
        return PartitionSpec(self.batch, self.axes)


def context_layout() -> ContextLayout | None:
    """The context-parallel layout under the mesh and rules in context; None without them or
    when the tokens are not split (a context axis of one device): the layers then run exactly
    their one-device code."""
    if not _rules_in_context():
        return None
    rules = core_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    batch, length, heads = nn.logical_to_mesh_axes(
        ("activation_batch", "activation_length", "activation_heads"), rules)
    axes = tuple(a for a in _mesh_axes(length) if mesh.shape[a] > 1)
    if not axes:
        return None
    return ContextLayout(mesh=mesh, axes=axes, num_shards=math.prod(mesh.shape[a] for a in axes),
                         batch=batch, heads=heads, rules=tuple(rules))


# ---------------------------------------------------------------------------------------------
# Shardings of whole trees: parameters, optimizer state, a model
# ---------------------------------------------------------------------------------------------


def logical_to_spec(names: Sequence[str | None] | None, rules) -> PartitionSpec:
    """The PartitionSpec for one array's logical axis names under ``rules``: Flax's own engine
    (``flax.linen.logical_to_mesh_axes``), the one the model's activation constraints use, so
    parameters and activations can never disagree. Names without a rule stay unsharded."""
    if names is None:
        return PartitionSpec()
    return nn.logical_to_mesh_axes(tuple(names), rules)


def _axes_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    entry = (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[a] for a in entry)


def check_divisible(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh,
                    names: Sequence[str | None] | None = None) -> None:
    """Raise naming ``path`` if a sharded dimension does not divide by its mesh axes."""
    for d, entry in enumerate(spec):
        n = _axes_size(mesh, entry)
        if shape[d] % n:
            logical = f" (logical {names[d]!r})" if names else ""
            raise ValueError(
                f"{path}: dimension {d}{logical} of shape {tuple(shape)} has size {shape[d]}, "
                f"which does not divide by mesh axes {entry} of size {n}; change the model "
                f"size, the mesh (config.mesh) or mesh.axis_rules"
            )


def tree_shardings(abstract_tree, logical_tree, mesh: Mesh, rules, root: str = ""):
    """NamedShardings for every array of ``abstract_tree`` from its logical names, checking
    divisibility. ``logical_tree`` mirrors it with a tuple of names (or None) per array."""
    def one(path, x, names):
        spec = logical_to_spec(names, rules)
        check_divisible(f"{root}{path_str(path)}", x.shape, spec, mesh, names)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(
        one, abstract_tree, logical_tree, is_leaf=lambda x: x is None or isinstance(x, tuple)
    )


def shardings_like_params(tree, abstract_params, param_shardings, default: NamedSharding):
    """Shardings for a tree that holds copies of the parameters (optimizer moments, ...): a
    leaf whose key path ends with a parameter's path and has its shape gets that parameter's
    sharding; every other leaf (step counts, scalars) gets ``default``."""
    by_path = {}
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(abstract_params),
                            jax.tree.leaves(param_shardings), strict=True):
        by_path[tuple(path)] = (tuple(x.shape), s)
    depths = sorted({len(p) for p in by_path}, reverse=True)

    def one(path, x):
        path = tuple(path)
        for d in depths:
            hit = by_path.get(path[-d:]) if len(path) >= d else None
            if hit is not None and hit[0] == tuple(x.shape):
                return hit[1]
        return default

    return jax.tree_util.tree_map_with_path(one, tree)


def variable_axes(abstract_state) -> dict:
    """A nested dict mirroring an nnx State's arrays, each leaf the tuple of its logical axis
    names (from the ``out_sharding`` metadata ``param`` puts there; None for unnamed ones)."""
    flat = {}
    for path, var in nnx.to_flat_state(abstract_state):
        names = var.get_metadata().get("out_sharding")
        flat[tuple(path)] = tuple(names) if names else None
    tree: dict = {}
    for path, names in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = names
    return tree


def create_sharded(make_model: Callable[[], nnx.Module], mesh: Mesh, rules: Rules) -> nnx.Module:
    """Builds ``make_model()`` directly into its sharded layout (no replicated copy first).

    The shapes come from ``nnx.eval_shape``, the shardings from :func:`tree_shardings` (the
    trainer's, with its divisibility checks); the initialiser then runs under ``jax.jit`` with
    those ``out_shardings``.
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make_model))
    arrays = nnx.to_pure_dict(abstract_state)
    shardings = tree_shardings(arrays, variable_axes(abstract_state), mesh, rules)

    def init():
        return nnx.to_pure_dict(nnx.state(make_model()))

    with jax.set_mesh(mesh), axis_rules(rules):
        values = jax.jit(init, out_shardings=shardings)()
    nnx.replace_by_pure_dict(abstract_state, values)
    return nnx.merge(graphdef, abstract_state)
