"""KDA with the sequence split over devices (context parallelism), by state passing.

The sequence of T tokens is cut into n contiguous shards of T/n tokens, shard i on device i of
the context axis. Within a shard, per row and value head, KDA is affine in the state the shard
starts from: with the state S [K, V] and one token's map M_t = (I - beta_t k_t k_t^T) Diag(exp g_t)
(the zero matrix at a token that starts a new document),

    S_t = A_t S_start + B_t,            A_t = M_t ... M_1  [K, K],   B_t = the state from zero
    o_t = S_t^T (scale q_t) = o0_t + S_start^T u_t,        u_t = A_t^T (scale q_t)   [K]

where o0 is the shard's output from a zero state. So each shard needs only its own (A, B) at its
last token (its transition S_end = A S_start + B) and the transitions of the shards before it:

  1. local: ONE call of the existing op (``kimi_k3.ops.kda``: recurrent, chunked XLA or the
     Pallas kernel) on the shard's tokens with the values widened by K zero columns and the
     initial state [0 | I]  ([K, V + K]). The state columns evolve independently, so the first
     V columns give B and o0, the last K give A (the identity carried through the tokens) and
     u (its read-out). This is the "output correction" form: no second pass over the tokens;
     the extra cost is K more value columns in the op (the parts that depend on K alone:
     the decays, the triangular solve and the scores, are shared). Document resets inside the
     shard need no special case: the op zeroes all V + K columns at a reset, so A (and u past
     the reset) become zero, which is exactly "a document boundary cuts the transition".
  2. exchange: one all-gather of (A, B) [n, B, HV, K, K + V] and of each shard's first and last
     segment ids over the context axis.
  3. compose (on every device, the same tiny loop over n shards): S_start_0 = the initial state,
     S_start_{j+1} = keep_{j+1} (A_j S_start_j + B_j), keep_{j+1} = (shard j+1's first token is
     in the document of shard j's last token): a document that starts exactly at a shard
     boundary starts from zero. The state after shard n-1 is the final state.
  4. finish: o_t = o0_t + S_start^T u_t, a [T/n, K] x [K, V] product per head.

Backward: the adjoint of the above, which JAX derives from the same code: the composition
loop runs backward (dS_start_{j+1} gives dA_j = dS S_start_j^T, dB_j = dS and dS_start_j =
A_j^T dS: the state cotangent flows from later shards to earlier ones), the all-gather's
transpose (a reduce-scatter) hands each shard the cotangents of its own (A, B), and the local
op's own backward turns them (the cotangent of its final state) and do into dq, dk, dv, dg,
dbeta. Every shard's gradient is tested against the float64 recurrence
(tests/context_parallel_check.py).

Communication per call: (K + V) K floats per row and value head, gathered from n devices;
the composition costs n K^2 V multiply-adds per row and head on every device.

Precision: A, B, the composition and the correction are float32; u comes out of the op in v's
dtype (bf16 in a bf16 model), rounded like the outputs themselves. The causal load is even
(every shard does the same work), unlike attention's.

Shapes as in ``kimi_k3.ops.kda``: q, k [B, T, H, K], v [B, T, HV, V], g [B, T, HV, K],
beta [B, T, HV], state [B, HV, K, V] float32, segment_ids [B, T] int. With ``A_log`` [HV] and
``dt_bias`` [HV, K] the gate runs inside each shard's op, as in ``kda`` (g is then the gate's
pre-activation f); the two are replicated over the context axes, so their gradients are
summed over the shards (shard_map's transpose of an input the axis does not split).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from kimi_k3.dispatch import choose_kda_impl
from kimi_k3.ops.kda import kda

_HI = lax.Precision.HIGHEST


def vary_like(x: jax.Array, *refs: jax.Array) -> jax.Array:
    """``x`` marked as varying over every mesh axis any of ``refs`` varies over (shard_map's
    type system), so a value all devices hold alike (a constant, a replicated input) can be a
    loop carry that meets per-device values. ``lax.pcast`` where it exists, else the older
    ``lax.pvary``; nothing to do without the type check (``check_vma=False``)."""
    def vma(a) -> frozenset | None:
        aval = jax.typeof(a)
        manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10 spells it this way
        if manual is not None:
            return frozenset(manual.varying)
        return frozenset(aval.vma) if hasattr(aval, "vma") else None

    if vma(x) is None:  # a JAX that spells it neither way: take the types from the refs
        for r in refs:  # select(False, ...) keeps x's value; its type joins r's
            x = jnp.where(False, jnp.ravel(r)[0].astype(x.dtype), x)
        return x
    missing = tuple(sorted(set().union(*map(vma, refs)) - vma(x)))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)


def kda_shard(q_BxTxHxK, k_BxTxHxK, v_BxTxHVxV, g_BxTxHVxK, beta_BxTxHV, state_BxHVxKxV,
              seg_BxT, *, axis, num_shards: int, **kda_kwargs):
    """The per-device body (inside ``shard_map`` over ``axis``): this shard's T tokens.

    ``state``: the state before the whole sequence (the same on every device of ``axis``);
    ``seg``: this shard's segment ids. ``kda_kwargs`` go to ``kimi_k3.ops.kda`` (scale,
    chunk_size, lower_bound, impl, tuning). Returns (o [B, T, HV, V] in v's dtype, the state
    after the whole sequence [B, HV, K, V] float32, alike on every device).
    """
    B, T, H, K = q_BxTxHxK.shape
    HV, V = v_BxTxHVxV.shape[2:]
    f32 = jnp.float32
    # 1. One run of the op from [0 | I] with K zero value columns appended.
    v_ext = jnp.concatenate([v_BxTxHVxV, jnp.zeros((B, T, HV, K), v_BxTxHVxV.dtype)], -1)
    eye_BxHVxKxK = jnp.broadcast_to(jnp.eye(K, dtype=f32), (B, HV, K, K))
    # A constant, but per device as far as shard_map's types go (the op's loops carry it).
    S0_ext = vary_like(jnp.concatenate([jnp.zeros((B, HV, K, V), f32), eye_BxHVxKxK], -1),
                       q_BxTxHxK, k_BxTxHxK, v_BxTxHVxV, g_BxTxHVxK, beta_BxTxHV, seg_BxT)
    o_ext, S_ext = kda(q_BxTxHxK, k_BxTxHxK, v_ext, g_BxTxHVxK, beta_BxTxHV,
                       initial_state=S0_ext, output_final_state=True, segment_ids=seg_BxT,
                       isolate_documents=False, **kda_kwargs)
    o0_BxTxHVxV, u_BxTxHVxK = o_ext[..., :V], o_ext[..., V:]
    # 2. Exchange the transitions S_end = A S_start + B, packed as [A | B].
    AB_NxBxHVxKxKV = lax.all_gather(S_ext[..., V:].astype(f32), axis, tiled=False)
    AB_NxBxHVxKxKV = jnp.concatenate(
        [AB_NxBxHVxKxKV, lax.all_gather(S_ext[..., :V], axis, tiled=False)], -1)
    first_NxB = lax.all_gather(seg_BxT[:, 0], axis, tiled=False)
    last_NxB = lax.all_gather(seg_BxT[:, -1], axis, tiled=False)
    # keep[j] for the state entering shard j + 1 (the final state is always kept).
    keep_NxB = jnp.concatenate([first_NxB[1:] == last_NxB[:-1],
                                jnp.ones((1, B), bool)], 0)

    # 3. Compose the prefix: every device runs the same short loop over the n shards.
    def step(S_BxHVxKxV, xs):
        AB, keep_B = xs
        S_next = jnp.einsum("bhkj,bhjv->bhkv", AB[..., :K], S_BxHVxKxV, precision=_HI) + AB[..., K:]
        return jnp.where(keep_B[:, None, None, None], S_next, 0.0), S_BxHVxKxV

    S_init = vary_like(state_BxHVxKxV.astype(f32), AB_NxBxHVxKxKV, keep_NxB)
    S_final, S_starts_NxBxHVxKxV = lax.scan(step, S_init, (AB_NxBxHVxKxKV, keep_NxB),
                                            length=num_shards)
    S_start_BxHVxKxV = S_starts_NxBxHVxKxV[lax.axis_index(axis)]
    # 4. Correct the outputs for the true starting state: o_t += S_start^T u_t.
    o = o0_BxTxHVxV.astype(f32) + jnp.einsum("bthk,bhkv->bthv", u_BxTxHVxK.astype(f32),
                                             S_start_BxHVxKxV, precision=_HI)
    return o.astype(v_BxTxHVxV.dtype), S_final


def kda_context_parallel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    mesh,
    context_axes,
    batch_axes=None,
    head_axes=None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    lower_bound: float | None = None,
    impl: str = "auto",
    tuning=None,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``kimi_k3.ops.kda`` with the token axis split over ``context_axes`` of ``mesh`` (a Mesh
    or the AbstractMesh in context), by state passing (module docstring). Same arguments and
    results as ``kda``; rows may be split over ``batch_axes`` and heads over ``head_axes``
    (mesh axis names, a tuple of them, or None).

    T must divide by the number of devices along ``context_axes``; the op pads each shard to
    its chunk size, but shards whole in chunks (T divisible by n x chunk_size, which
    ``kimi_k3.config`` asks of a training config) waste nothing. Non-finite values are not
    isolated per document here (``isolate_documents=False``): the trainer drops such a step.
    """
    axes = (context_axes,) if isinstance(context_axes, str) else tuple(context_axes)
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if T % n:
        raise ValueError(f"kda_context_parallel: the sequence length T={T} must divide by the "
                         f"context axes {axes} of size {n}")
    if scale is None:
        scale = K ** -0.5
    if initial_state is None:
        initial_state = jnp.zeros((B, HV, K, V), jnp.float32)
    if segment_ids is None:
        segment_ids = jnp.zeros((B, T), jnp.int32)
    ctx = axes if len(axes) > 1 else axes[0]
    tok = PartitionSpec(batch_axes, ctx, head_axes, None)
    body = functools.partial(
        kda_shard, axis=axes, num_shards=n, scale=scale, chunk_size=chunk_size,
        lower_bound=lower_bound, impl=impl, tuning=tuning)

    # The gate's parameters (when the op applies the gate): split by heads like v, whole on
    # every device of the context axes.
    if (A_log is None) != (dt_bias is None):
        raise ValueError("kda_context_parallel: pass both A_log and dt_bias (the gate in the op) "
                         "or neither")
    gate = () if A_log is None else (A_log, dt_bias.reshape(HV, K))
    gate_specs = (PartitionSpec(head_axes), PartitionSpec(head_axes, None)) if gate else ()

    def run(q, k, v, g, beta, S0, seg, *gate):
        gate_kw = dict(zip(("A_log", "dt_bias"), gate, strict=False))
        o, S_final = body(q, k, v, g, beta, S0, seg, **gate_kw)
        return o, S_final[None]  # one copy per device: the last one is read below

    # The Pallas calls declare no per-device types for their outputs, which shard_map's type
    # check (check_vma) requires; without it the transposes are the same collectives, and the
    # tests hold the Pallas case to the same references.
    check_vma = choose_kda_impl(impl) != "pallas"
    o, S_final = jax.shard_map(
        run, mesh=mesh, check_vma=check_vma,
        in_specs=(tok, tok, tok, tok, PartitionSpec(batch_axes, ctx, head_axes),
                  PartitionSpec(batch_axes, head_axes, None, None),
                  PartitionSpec(batch_axes, ctx), *gate_specs),
        out_specs=(tok, PartitionSpec(ctx, batch_axes, head_axes, None, None)),
    )(q, k, v, g, beta, initial_state.astype(jnp.float32), segment_ids.astype(jnp.int32), *gate)
    return o, (S_final[-1] if output_final_state else None)
