"""``jax.lax.ragged_all_to_all``, and a reference of it built from collectives every backend runs.

The contract (``jax.lax.ragged_all_to_all``'s docstring): over an axis of P devices, each holds
``operand`` [A, ...] and ``output`` [M, ...]; the four int arrays have one length L = P s (s
slices per peer). Slice i of device d, rows ``operand[input_offsets[i] : + send_sizes[i]]``,
goes to device i // s, which writes it at its rows ``[o : + recv_sizes[j]]`` with

    o = output_offsets[i] of the sender          (offsets in the RECEIVER's buffer)
    j = d s + (i mod s)                          (the receiver's index of that slice)

and ``send_sizes[i]`` of d equals ``recv_sizes[j]`` of its receiver. The result is ``output``
with every received slice written over it; rows no slice covers keep ``output``'s values.

XLA:CPU cannot run the collective ("HLO opcode ragged-all-to-all is not supported by XLA:CPU
ThunkEmitter"), so on the CPU (:func:`ragged_all_to_all`'s one choice) the reference runs
instead: every device gathers every operand and the offsets, then picks its rows. It moves
P times the bytes; it is for tests and CPU runs, and differentiates like any gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import device


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name):
    """``jax.lax.ragged_all_to_all`` (module docstring), inside ``shard_map`` over
    ``axis_name``; on the CPU its reference, :func:`ragged_all_to_all_reference`."""
    # The one place the reference stands in: XLA:CPU has no ragged-all-to-all. The target
    # platform is the mesh's (a TPU topology traced on this machine gets the real collective).
    if device.target_platform() == "cpu":
        return ragged_all_to_all_reference(operand, output, input_offsets, send_sizes,
                                           output_offsets, recv_sizes, axis_name=axis_name)
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axis_name)


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
    """The collective from ``all_gather`` and a gather: for each of its M output rows a device
    finds the received slice covering it (the last one, should two overlap) and the sender's
    row it holds. ``send_sizes`` is implied by the receivers' ``recv_sizes`` (the contract);
    it is not read."""
    del send_sizes
    L = input_offsets.shape[0]
    P = jax.lax.axis_size(axis_name)
    s = L // P
    A, M = operand.shape[0], output.shape[0]
    me = jax.lax.axis_index(axis_name)
    operand_PxA = jax.lax.all_gather(operand, axis_name)  # [P, A, ...]
    in_off_PxL = jax.lax.all_gather(input_offsets, axis_name).astype(jnp.int32)
    out_off_PxL = jax.lax.all_gather(output_offsets, axis_name).astype(jnp.int32)
    # The slices this device receives, j = src s + t: sender src's slice me s + t.
    src_L = jnp.arange(L, dtype=jnp.int32) // s
    theirs_L = me * s + jnp.arange(L, dtype=jnp.int32) % s
    start_L = out_off_PxL[src_L, theirs_L]  # where each lands here
    first_L = in_off_PxL[src_L, theirs_L]  # where it starts in its sender's operand
    rows_M = jnp.arange(M, dtype=jnp.int32)
    covers_MxL = (rows_M[:, None] >= start_L) & (rows_M[:, None] < start_L + recv_sizes)
    # The last covering slice wins, as in the contract's loop over slices.
    last_M = L - 1 - jnp.argmax(covers_MxL[:, ::-1], axis=1)
    hit_M = jnp.any(covers_MxL, axis=1)
    row_M = jnp.clip(first_L[last_M] + rows_M - start_L[last_M], 0, A - 1)
    got = operand_PxA.reshape(P * A, *operand.shape[1:])[src_L[last_M] * A + row_M]
    hit = hit_M.reshape(M, *(1,) * (output.ndim - 1))
    return jnp.where(hit, got.astype(output.dtype), output)
