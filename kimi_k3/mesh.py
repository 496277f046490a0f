"""The device mesh, the batch layout over it, and multi-host start-up.

The mesh has five axes, sized by ``config.mesh`` (checked in kimi_k3/config.py):

    data    pure data parallelism (replicated parameters)
    fsdp    data parallelism with parameters and optimizer state sharded (ZeRO-3 style)
    expert  expert parallelism: a mixture of experts' routed experts are split over it, and
            tokens travel to their experts by all-to-all (layers/moe.py); for everything
            else it is one more data-parallel axis
    context context parallelism: each sequence's tokens are split over it (KDA passes states
            between the shards, MLA gathers the latents: kimi_k3/ops/kda_context.py,
            layers/mla.py); size 1 is exactly the code without it
    tensor  tensor (model) parallelism inside layers

One size may be -1: "all remaining devices". The batch's rows are sharded over
data x fsdp x expert, its tokens over context.
How the model's logical axis names map onto these axes is kimi_k3/sharding.py's job.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_k3.config import MESH_AXES, ConfigError, mesh_sizes

BATCH_AXES = ("data", "fsdp", "expert")
CONTEXT_AXIS = "context"


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
    """The (data, fsdp, expert, context, tensor) sizes of ``config.mesh`` (or a MeshSpec), with
    a -1 resolved against ``num_devices``."""
    sizes = list(mesh_sizes(mesh_cfg))
    context = sizes[MESH_AXES.index(CONTEXT_AXIS)]
    if context > 1 and num_devices % context:
        divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
        too = "is larger than" if context > num_devices else "does not divide"
        raise ConfigError(f"config.mesh.context: {context} {too} the {num_devices} devices present; "
                         f"allowed: a divisor of {num_devices} ({', '.join(map(str, divisors))})")
    rest = [a for a, s in zip(MESH_AXES, sizes, strict=True) if s == -1]
    known = math.prod(s for s in sizes if s != -1)
    if rest:
        if num_devices % known:
            raise ConfigError(
                f"config.mesh: {num_devices} devices do not divide by the fixed axes "
                f"{dict(zip(MESH_AXES, sizes, strict=True))} (product {known})"
            )
        sizes[MESH_AXES.index(rest[0])] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"config.mesh: data x fsdp x expert x context x tensor = {sizes} uses "
            f"{math.prod(sizes)} devices, but {num_devices} are present; make the product "
            f"{num_devices} or set one axis to -1"
        )
    return tuple(sizes)


def make_mesh(mesh_cfg, devices: Sequence | None = None) -> Mesh:
    """A (data, fsdp, expert, context, tensor) mesh over all devices (or ``devices``), laid
    out by JAX so that the innermost axes (tensor, then context, then expert) stay within a
    host / fast interconnect."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


# ---------------------------------------------------------------------------------------------
# Batch layout
# ---------------------------------------------------------------------------------------------


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over data x fsdp x expert, tokens (dim 1) over context when it has more than one
    device (so context = 1 gives exactly the layout without the axis), the rest replicated."""
    rest = [None] * (ndim - 1)
    if ndim > 1 and mesh.shape.get(CONTEXT_AXIS, 1) > 1:
        rest[0] = CONTEXT_AXIS
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *rest))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    """Devices the batch rows are split over: data x fsdp x expert."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch(global_batch: int, microbatch: int, mesh: Mesh) -> None:
    """The global batch must split into micro-batches of ``microbatch`` rows, each divisible by
    data x fsdp x expert (and so across hosts)."""
    n = data_parallel_size(mesh)
    if global_batch % microbatch:
        raise ConfigError(f"config.train.microbatch_size: {microbatch} does not divide "
                          f"config.data.global_batch_size={global_batch}")
    if microbatch % n:
        raise ConfigError(
            f"config.train.microbatch_size: {microbatch} rows per micro-batch (of "
            f"config.data.global_batch_size={global_batch}) do not divide by data x fsdp x expert = "
            f"{mesh.shape['data']} x {mesh.shape['fsdp']} x {mesh.shape['expert']} = {n}")
