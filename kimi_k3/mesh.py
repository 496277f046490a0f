"""The device mesh, logical-to-mesh axis mapping, and multi-host start-up.

The mesh has three axes, sized by ``config.mesh``:

    data    pure data parallelism (replicated parameters)
    fsdp    data parallelism with parameters and optimizer state sharded (ZeRO-3 style)
    tensor  tensor (model) parallelism inside layers

One size may be -1: "all remaining devices". The batch is sharded over data x fsdp. Parameters
carry logical axis names (``embed``, ``heads``, ``mlp``, ``vocab``, ...); ``config.mesh.axis_rules``
— a sequence of (logical name, mesh axis | tuple of mesh axes | None) — maps them to mesh axes.
As in ``flax.linen.logical_axis_rules``, the first rule for a name whose mesh axes the array
does not use yet wins; a name without a rule stays unsharded.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


# ---------------------------------------------------------------------------------------------
# Multi-host start-up
# ---------------------------------------------------------------------------------------------


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None,
                           local_device_ids: Sequence[int] | None = None,
                           force: bool = False) -> bool:
    """Join the processes of a multi-host job with ``jax.distributed.initialize``.

    Runs when any argument is given, when ``force`` is set (TPU pod slices, SLURM and Open MPI
    jobs describe themselves: JAX reads the rest from the environment), or when the
    environment sets ``JAX_COORDINATOR_ADDRESS``. Returns whether it initialised.
    """
    env_addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    wanted = force or env_addr or coordinator_address or num_processes or process_id is not None
    if not wanted:
        return False
    kwargs = {}
    if coordinator_address or env_addr:
        kwargs["coordinator_address"] = coordinator_address or env_addr
    for name, value, env in (("num_processes", num_processes, "JAX_NUM_PROCESSES"),
                             ("process_id", process_id, "JAX_PROCESS_ID")):
        if value is None and os.environ.get(env):
            value = int(os.environ[env])
        if value is not None:
            kwargs[name] = int(value)
    if local_device_ids:
        kwargs["local_device_ids"] = list(local_device_ids)
    jax.distributed.initialize(**kwargs)
    print(f"jax.distributed: process {jax.process_index()} of {jax.process_count()}, "
          f"{jax.local_device_count()} local / {jax.device_count()} global devices",
          file=sys.stderr, flush=True)
    return True


# ---------------------------------------------------------------------------------------------
# The mesh
# ---------------------------------------------------------------------------------------------


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, ...]:
    """The (data, fsdp, tensor) sizes, with a -1 resolved against ``num_devices``."""
    sizes = [mesh_cfg[a] for a in MESH_AXES]
    for a, s in zip(MESH_AXES, sizes, strict=True):
        if not isinstance(s, int) or (s < 1 and s != -1):
            raise ValueError(f"mesh.{a}: {s!r} must be a positive integer or -1 (the rest)")
    rest = [a for a, s in zip(MESH_AXES, sizes, strict=True) if s == -1]
    if len(rest) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {rest}")
    known = math.prod(s for s in sizes if s != -1)
    if rest:
        if num_devices % known:
            raise ValueError(
                f"mesh: {num_devices} devices do not divide by the fixed axes "
                f"{dict(zip(MESH_AXES, sizes, strict=True))} (product {known})"
            )
        sizes[MESH_AXES.index(rest[0])] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"mesh: data x fsdp x tensor = {sizes} uses {math.prod(sizes)} devices, but "
            f"{num_devices} are present; make the product {num_devices} or set one axis to -1"
        )
    return tuple(sizes)


def make_mesh(mesh_cfg, devices: Sequence | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over all devices (or ``devices``), laid out by JAX so that
    the innermost axis (tensor) stays within a host / fast interconnect."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


# ---------------------------------------------------------------------------------------------
# Logical axis names -> mesh axes
# ---------------------------------------------------------------------------------------------


def normalize_rules(rules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Rules as ((logical, mesh_axis | (mesh_axis, ...) | None), ...), checked against the
    mesh's axis names."""
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(
                f"mesh.axis_rules[{i}]: {rule!r} must be (logical_name, mesh_axis | "
                f"(mesh_axis, ...) | None)"
            )
        name, target = rule
        if target is None:
            out.append((name, None))
            continue
        axes = (target,) if isinstance(target, str) else tuple(target)
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ValueError(
                f"mesh.axis_rules[{i}] ({name!r}): mesh axes {bad} are not among {MESH_AXES}"
            )
        out.append((name, axes[0] if len(axes) == 1 else axes))
    return tuple(out)


def logical_to_spec(names: Sequence[str | None] | None, rules) -> PartitionSpec:
    """The PartitionSpec for one array's logical axis names under ``rules``: Flax's own engine
    (``flax.linen.logical_to_mesh_axes``), the one the model's activation constraints use, so
    parameters and activations can never disagree. Names without a rule stay unsharded."""
    from flax import linen as nn

    if names is None:
        return PartitionSpec()
    return nn.logical_to_mesh_axes(tuple(names), normalize_rules(rules))


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
    from kimi_k3.optim import path_str

    def one(path, x, names):
        spec = logical_to_spec(names, rules)
        check_divisible(f"{root}{path_str(path)}", x.shape, spec, mesh, names)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(
        one, abstract_tree, logical_tree, is_leaf=lambda x: x is None or isinstance(x, tuple)
    )


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over data x fsdp, everything else replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_batch(global_batch: int, micro_steps: int, mesh: Mesh) -> None:
    """The global batch must split into ``micro_steps`` micro-batches, each divisible by
    data x fsdp (and so across hosts)."""
    n = _axes_size(mesh, BATCH_AXES)
    if global_batch % micro_steps:
        raise ValueError(
            f"data.global_batch_size: {global_batch} does not divide by "
            f"opt.grad_accum_steps={micro_steps}"
        )
    micro = global_batch // micro_steps
    if micro % n:
        raise ValueError(
            f"data.global_batch_size: {global_batch} / opt.grad_accum_steps={micro_steps} = "
            f"{micro} rows per micro-batch, which does not divide by data x fsdp = "
            f"{mesh.shape['data']} x {mesh.shape['fsdp']} = {n}"
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
