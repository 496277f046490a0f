"""Attention Residuals: each sublayer reads a softmax mixture over depth instead of a plain sum.

Sources: v_0 = the token embedding, v_i = the output of sublayer i (every attention/KDA mixer and
every MLP is one sublayer). The input of sublayer l, per token:

    h_l = sum_i a_{i->l} v_i,      a_{i->l} = softmax_i( w_l . RMSNorm(v_i) )

w_l [D] is a learned pseudo-query per sublayer, initialised to zero, so training starts from the
uniform average of the sources. No 1/sqrt(D); the keys are RMS-normalised, the values are raw.
The final readout (before the last norm and the output head) is one more such mixture.

The key norm has no learned scale: a scale g would only fold into the pseudo-query
(w . (g * k) = (w * g) . k). So the reciprocal RMS of each source is computed once, when the
source is stored, and every read costs one dot product per source.

Modes:
    "none"   standard pre-norm residual stream: h_l = v_0 + sum_{i<l} v_i.
    "block"  sublayers are grouped into blocks of S (``block_size``, counted in sublayers). Kept
             are b_0 = embedding, the sum of each finished block's outputs, and the partial sum
             of the current block. A block's first sublayer attends over [b_0 ... b_{n-1}]; later
             ones also over the partial sum. Memory and work per token: O(N D) for N blocks.
    "full"   every sublayer output is its own source: "block" with S = 1, and computed as such.

Two forms of the state, one equation:

* Scanned stacks (``init(..., unrolled=False)``): a dict of arrays with a fixed structure, so it
  can be the carry of a scan over layers: ``sources`` [N, B, T, D] (slot 0 = b_0, then one slot
  per block, the current block's slot holding its partial sum), ``inv_rms`` [N, B, T], ``n``
  (the current block's slot) and ``count`` (sublayers already in it). A read mixes slots
  0 .. n-1, and slot n when count > 0; it walks all N slots, since n is only known at run time.
  Under the scan over layers, backpropagation keeps this carry once per scan step, so training
  memory grows by about (steps x N) copies of [B, T, D]: modest for "block", large for "full"
  in deep stacks.
* Unrolled stacks (``init(..., unrolled=True)``): a :class:`SourceList`, every finished source
  its own array and the block structure known while tracing. A read touches only the sources
  that exist, a write adds to the partial sum and never copies the others, and a source
  shared by many reads is stored once. This is the form that makes a training step fast
  (no [N, B, T, D] stack rewritten per sublayer, no stacked residuals); the price is a program
  that grows with depth (``model.scan_layers = False``).

In both forms a read's output and mixing weights are named (``attn_res_read``,
``attn_res_weights``) so that ``remat="dots_kernels"`` keeps them instead of reading every
source again in the backward pass.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kimi_k3.config import ATTN_RES_MODES
from kimi_k3.layers.norms import RMSNorm
from kimi_k3.sharding import BTD, constrain, param
from pallas_kernels import depth_read as depth_read_kernel
from pallas_kernels import device

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
_SRC = (None, *BTD)


class DepthQuery(nnx.Module):
    """A pseudo-query w [D], initialised to zero."""

    def __init__(self, d_model: int, *, param_dtype=jnp.float32):
        self.w = param(jnp.zeros((d_model,), param_dtype), ("norm",))


@jax.custom_vjp
def _whole_cotangent(h_BxTxD: jax.Array) -> jax.Array:
    """The identity, whose backward materialises the incoming cotangent dh before it is used.

    dh of a read is the sum of what its reader sends back (a norm with a learned scale, then the
    sublayer's projections). Left free, XLA recomputed that sum inside every source's gradient
    and merged it with the first stage of the norm scale's column sum into one reduction fusion
    of some ninety operands, slower than the sum and the reads apart. A barrier on dh keeps the
    two apart (benchmarks/step_profile.py shows the kernels). The forward is untouched.
    """
    return h_BxTxD


def _whole_cotangent_fwd(h_BxTxD):
    return h_BxTxD, None


def _whole_cotangent_bwd(_, dh_BxTxD):
    return (jax.lax.optimization_barrier(dh_BxTxD),)


_whole_cotangent.defvjp(_whole_cotangent_fwd, _whole_cotangent_bwd)


def _read_output(h_BxTxD: jax.Array, dtype) -> jax.Array:
    """A read's float32 mixture as the sublayer input, in both state forms: in the sources'
    dtype, named for the remat policy, its cotangent held whole."""
    h_BxTxD = checkpoint_name(constrain(h_BxTxD.astype(dtype), BTD), "attn_res_read")
    return _whole_cotangent(h_BxTxD)


def _inv_rms(x_BxTxD: jax.Array, eps: float) -> jax.Array:
    x = x_BxTxD.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)


def _fusable(x_BxTxD: jax.Array, n: int) -> bool:
    """Whether the fused read + norm kernels take these sources: D a power of two, Pallas-
    Triton present, and no mesh splitting the tokens (the kernels see whole arrays)."""
    if depth_read_kernel.unsupported(x_BxTxD.shape[-1], n) or device.pallas_triton() is None:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_read_norm(sources, inv_rms, w_D, scale_D, norm_eps: float, dtype):
    """RMSNorm(read) [B, T, D] in ``dtype``: sources n x [B, T, D], their reciprocal RMS n x
    [B, T] float32 (computed outside, where their gradient goes on to the sources), the
    pseudo-query w [D] and the norm's scale [D]; one kernel pass each way
    (``pallas_kernels.depth_read``)."""
    return _fused_fwd_once(sources, inv_rms, w_D, scale_D, norm_eps, dtype)[0]


def _tokens(a: jax.Array) -> jax.Array:
    return a.reshape(-1, *a.shape[2:])


def _fused_fwd(sources, inv_rms, w_D, scale_D, norm_eps, dtype):
    B, T, D = sources[0].shape
    y, weights = depth_read_kernel.read_norm_forward(
        [_tokens(s) for s in sources], [_tokens(r) for r in inv_rms], w_D, scale_D,
        eps=norm_eps, out_dtype=dtype)
    return y.reshape(B, T, D), (sources, inv_rms, w_D, scale_D, weights)


# Jitted for the undifferentiated calls (device.jit_per_choices): the reads of one program with
# the same number of sources lower the kernel once.
_fused_fwd_once = device.jit_per_choices(_fused_fwd, static_argnums=(4, 5))


def _fused_bwd(norm_eps, dtype, res, dy_BxTxD):
    del dtype
    sources, inv_rms, w_D, scale_D, weights = res
    B, T, D = sources[0].shape
    ds, drho, dw, dscale = depth_read_kernel.read_norm_backward(
        [_tokens(s) for s in sources], [_tokens(r) for r in inv_rms], w_D, scale_D, weights,
        _tokens(dy_BxTxD), eps=norm_eps)
    return (tuple(d.reshape(B, T, D) for d in ds),
            tuple(d.reshape(B, T).astype(r.dtype) for d, r in zip(drho, inv_rms, strict=True)),
            dw.astype(w_D.dtype), dscale.astype(scale_D.dtype))


_fused_read_norm.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("blocks", "block_inv_rms", "partial"), meta_fields=("count",))
@dataclasses.dataclass(frozen=True)
class SourceList:
    """The depth state of an unrolled stack (modes "block" and "full").

    blocks: the finished sources, each [B, T, D]: b_0 = the embedding, then one per full block.
    block_inv_rms: each finished source's reciprocal RMS [B, T] (float32), computed once when
      the source is finished: every later read uses it, and its gradient is one term per
      source rather than one per read.
    partial: the current block's partial sum [B, T, D] (None while the block is empty).
    count: sublayers in the current block; a Python int, static under jit and remat.
    """

    blocks: tuple[jax.Array, ...]
    block_inv_rms: tuple[jax.Array, ...]
    partial: jax.Array | None
    count: int

    @property
    def sources(self) -> tuple[jax.Array, ...]:
        return self.blocks + ((self.partial,) if self.count else ())


@dataclasses.dataclass(frozen=True)
class DepthResidual:
    """The residual stream of the whole stack, in one of the modes above.

    num_sublayers: sublayers in the stack (2 per layer); fixes the number of source slots.
    """

    mode: str
    num_sublayers: int
    block_size: int = 1
    eps: float = 1e-6
    impl: str = "xla"  # "xla" | "pallas": how ``read_norm`` runs a read of the unrolled form

    def __post_init__(self):
        if self.mode not in ATTN_RES_MODES:
            raise ValueError(f"attn_res must be one of {ATTN_RES_MODES}, got {self.mode!r}")
        if self.block_size < 1:
            raise ValueError(f"attn_res_block_size must be >= 1, got {self.block_size}")
        if self.impl not in ("xla", "pallas"):
            raise ValueError(f"attn_res_impl must be 'xla' or 'pallas', got {self.impl!r}")

    @property
    def block(self) -> int:
        return 1 if self.mode == "full" else self.block_size

    @property
    def num_slots(self) -> int:
        """b_0 plus one slot per block, the last one possibly partial."""
        return 1 + -(-self.num_sublayers // self.block)

    @jax.named_scope("attn_res")
    def init(self, embed_BxTxD: jax.Array, *, unrolled: bool = False):
        """The state before the first sublayer: the embedding is the only source. ``unrolled``:
        the :class:`SourceList` form, for stacks whose layers are not scanned."""
        if self.mode == "none":
            return {"x": embed_BxTxD}
        if unrolled:
            embed_BxTxD = constrain(embed_BxTxD, BTD)
            return SourceList(blocks=(embed_BxTxD,), block_inv_rms=(_inv_rms(embed_BxTxD, self.eps),),
                              partial=None, count=0)
        N = self.num_slots
        sources = jnp.zeros((N, *embed_BxTxD.shape), embed_BxTxD.dtype).at[0].set(embed_BxTxD)
        inv_rms = jnp.zeros((N, *embed_BxTxD.shape[:2]), jnp.float32)
        inv_rms = inv_rms.at[0].set(_inv_rms(embed_BxTxD, self.eps))
        return {
            "sources": constrain(sources, _SRC),
            "inv_rms": inv_rms,
            "n": jnp.ones((), jnp.int32),
            "count": jnp.zeros((), jnp.int32),
        }

    @jax.named_scope("attn_res")
    def read(self, state: dict[str, jax.Array], w_D: jax.Array | None) -> jax.Array:
        """The input of the next sublayer (or the final readout), [B, T, D].

        w_D: the reading sublayer's pseudo-query (``DepthQuery.w``); None in mode "none".
        """
        if self.mode == "none":
            return state["x"]
        if isinstance(state, SourceList):
            return self._read_list(state.sources, self._list_inv_rms(state), w_D)
        sources = state["sources"]
        a_NxBxT, _ = self._slot_softmax(state, w_D)
        # A sum over the few sources, not a matmul: XLA fuses the float32 conversion into the
        # reduction, so the sources are read once in their own dtype, never copied to float32.
        a_NxBxT = checkpoint_name(a_NxBxT, "attn_res_weights")
        h = jnp.sum(a_NxBxT[..., None] * sources.astype(jnp.float32), axis=0)
        return _read_output(h, sources.dtype)

    def weights(self, state, w_D: jax.Array) -> jax.Array:
        """The mixing weights a ``read(state, w_D)`` uses, [num_slots, B, T] float32: slot 0 the
        embedding, slot i block i (finished or partial, as in the scanned form); a slot with no
        source yet weighs 0. Both state forms; for kimi_k3/internals.py, never on the way of a
        training step. Modes "block" and "full" only."""
        if isinstance(state, SourceList):
            sources = state.sources
            logits_NxBxT = self._list_logits(sources, self._list_inv_rms(state), w_D)
            a_NxBxT = jax.nn.softmax(logits_NxBxT, axis=0)
            return jnp.pad(a_NxBxT, ((0, self.num_slots - len(sources)), (0, 0), (0, 0)))
        a_NxBxT, valid = self._slot_softmax(state, w_D)
        return jnp.where(valid[:, None, None], a_NxBxT, 0.0)

    @staticmethod
    def _slot_softmax(state: dict[str, jax.Array], w_D: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The scanned form's mixing weights [N, B, T] float32 over its slots and which slots
        hold a source [N] (slots 0 .. n-1, and slot n once its block has a sublayer); a slot
        with none gets a logit of ``_NEG``, so about 0 weight."""
        sources = state["sources"]
        slot = jnp.arange(sources.shape[0])
        valid = (slot < state["n"]) | ((slot == state["n"]) & (state["count"] > 0))
        logits_NxBxT = jnp.einsum("nbtd,d->nbt", sources, w_D.astype(sources.dtype),
                                  preferred_element_type=jnp.float32) * state["inv_rms"]
        return jax.nn.softmax(jnp.where(valid[:, None, None], logits_NxBxT, _NEG), axis=0), valid

    def read_norm(self, state, w_D: jax.Array | None, norm: RMSNorm) -> jax.Array:
        """``norm(read(state, w_D))``, the input of the next sublayer after its RMSNorm.

        With ``impl="pallas"`` a read of the unrolled form (a :class:`SourceList`) and its norm
        run as one kernel pass, forward and backward (``pallas_kernels.depth_read``), when the
        width is a power of two and the tokens are not split over devices; otherwise, and for
        the scanned form, the read and the norm as XLA fuses them. The same equation either way.
        """
        if (self.impl == "pallas" and isinstance(state, SourceList) and w_D is not None
                and _fusable(state.blocks[0], len(state.sources))):
            with jax.named_scope("attn_res"):
                return _fused_read_norm(state.sources, self._list_inv_rms(state), w_D,
                                        norm.scale[...], norm.eps, jnp.dtype(norm.dtype))
        return norm(self.read(state, w_D))

    def _list_inv_rms(self, state: SourceList) -> tuple[jax.Array, ...]:
        """Each source's reciprocal RMS [B, T]: the finished blocks' as stored, the partial
        sum's computed now (it changes with every write)."""
        if not state.count:
            return state.block_inv_rms
        return state.block_inv_rms + (_inv_rms(state.partial, self.eps),)

    def _read_list(self, sources: tuple[jax.Array, ...], inv_rms: tuple[jax.Array, ...],
                   w_D: jax.Array) -> jax.Array:
        """The read over sources that all exist: n = len(sources) arrays [B, T, D] and their
        reciprocal RMS [B, T]."""
        return self._mix(sources, self._list_logits(sources, inv_rms, w_D))

    @staticmethod
    def _list_logits(sources: tuple[jax.Array, ...], inv_rms: tuple[jax.Array, ...],
                     w_D: jax.Array) -> jax.Array:
        """w . RMSNorm(source) per source, [n, B, T] float32."""
        # Each logit is a matmul with w in the compute dtype (as every weight is cast for its
        # matmul), so the pseudo-query's gradient is a matmul too: as float32 sums over the
        # tokens, XLA fused it with the sources' gradients into slow column reductions
        # (benchmarks/attn_res_bench.py times the forms).
        return jnp.stack([
            jnp.einsum("btd,d->bt", s, w_D.astype(s.dtype), preferred_element_type=jnp.float32)
            * r for s, r in zip(sources, inv_rms, strict=True)])

    @staticmethod
    def _mix(sources: tuple[jax.Array, ...], logits_NxBxT: jax.Array) -> jax.Array:
        """sum_i softmax_i(logits) sources_i, [B, T, D] in the sources' dtype."""
        a_NxBxT = checkpoint_name(jax.nn.softmax(logits_NxBxT, axis=0), "attn_res_weights")
        h = a_NxBxT[0][..., None] * sources[0].astype(jnp.float32)
        for i in range(1, len(sources)):
            h = h + a_NxBxT[i][..., None] * sources[i].astype(jnp.float32)
        return _read_output(h, sources[0].dtype)

    @jax.named_scope("attn_res")
    def write(self, state: dict[str, jax.Array], out_BxTxD: jax.Array) -> dict[str, jax.Array]:
        """Adds a sublayer's output to the current block; a full block stays as a source."""
        if self.mode == "none":
            return {"x": constrain(state["x"] + out_BxTxD.astype(state["x"].dtype), BTD)}
        if isinstance(state, SourceList):
            dtype = state.blocks[0].dtype
            partial = out_BxTxD.astype(dtype)
            if state.count:
                partial = state.partial + partial
            partial = constrain(partial, BTD)
            if state.count + 1 == self.block:  # the block is full: it becomes a source
                return SourceList(blocks=state.blocks + (partial,),
                                  block_inv_rms=state.block_inv_rms + (_inv_rms(partial, self.eps),),
                                  partial=None, count=0)
            return dataclasses.replace(state, partial=partial, count=state.count + 1)
        sources, n = state["sources"], state["n"]
        block = jax.lax.dynamic_index_in_dim(sources, n, 0, keepdims=False)
        block = block + out_BxTxD.astype(block.dtype)
        count = state["count"] + 1
        full = count == self.block
        return {
            "sources": constrain(jax.lax.dynamic_update_index_in_dim(sources, block, n, 0), _SRC),
            "inv_rms": jax.lax.dynamic_update_index_in_dim(
                state["inv_rms"], _inv_rms(block, self.eps), n, 0),
            "n": n + full.astype(jnp.int32),
            "count": jnp.where(full, 0, count),
        }
