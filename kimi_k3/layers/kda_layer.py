"""The KDA layer: Kimi Delta Attention with its short convolutions, gates and output gate.

With x [B, T, D], H query/key heads, HV = G*H value heads, head dims K (q, k) and V (v):

    q = L2Norm(SiLU(ShortConv_q(x W_q)))        [B, T, H, K]
    k = L2Norm(SiLU(ShortConv_k(x W_k)))        [B, T, H, K]
    v = SiLU(ShortConv_v(x W_v))                [B, T, HV, V]
    f = x W_f_down W_f_up                       [B, T, HV, K]   (rank K bottleneck)
    g = gate(f)                                 bounded: g_min * sigmoid(exp(A_log) (f + dt_bias))
                                                softplus: -exp(A_log) softplus(f + dt_bias)
                                                (kda.gate_in_kernel: inside the KDA op, g never
                                                 materialised)
    beta = sigmoid(x W_b)                       [B, T, HV]
    o = KDA(q, k, v, g, beta)                   per token: S <- Diag(exp g) S;
                                                S <- S + beta k (v - S^T k)^T;  o = S^T q / sqrt(K)
    out = W_o ( RMSNorm_head(o) * sigmoid(x W_g_down W_g_up) )     [B, T, D]

The recurrence carries order, so the layer needs no positional encoding. Packed documents
(``segment_ids``) restart the state and mask the convolutions at each new document. For prefill
in pieces and decoding, the layer carries a cache: the state S [B, HV, K, V] (float32) and the
last W-1 pre-convolution inputs of q, k and v.

Context parallelism (a "context" mesh axis splitting the tokens, ``sharding.context_layout``):
the recurrence passes states between the shards (``kimi_k3.ops.kda_context``) and each short
convolution receives the previous shard's last W-1 inputs; everything else is per token.
Without that axis (or with one device on it) the layer runs the one-device code unchanged,
the Pallas kernel on each device's rows and heads under a mesh (``sharding.per_device``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kimi_k3.config import KdaSpec
from kimi_k3.layers.capture import keep
from kimi_k3.layers.dense import Dense
from kimi_k3.layers.fused import shared_input, stacked
from kimi_k3.layers.norms import RMSNorm, l2_normalize
from kimi_k3.layers.short_conv import ShortConv
from kimi_k3.ops import init_dt_bias, kda, kda_gate
from kimi_k3.ops.kda_context import kda_context_parallel
from kimi_k3.ops.kda_recurrent import kda_step
from kimi_k3.sharding import BTHK, ROWS_HEADS, constrain, context_layout, param, per_device
from pallas_kernels import kda_decode
from pallas_kernels import short_conv as short_conv_kernel


class KDALayer(nnx.Module):
    """x [B, T, D] -> [B, T, D], optionally continuing from and returning a cache.

    The mixer interface (shared with GatedMLA): ``Mixer(d_model, spec, *, rngs, dtype,
    param_dtype, fp8)``, ``init_cache(batch_size, max_len)``, ``__call__(x, segment_ids, cache,
    pos) -> (out, cache)``. ``spec`` is checked and resolved already (kimi_k3/config.py).
    ``fp8``: q, k, v and the output projection multiply in FP8 (``layers/dense.py``); the
    low-rank decay-gate and output-gate projections and beta's stay in ``dtype``: they are
    narrow (rank K), so FP8 would save little there, and the decay gate compounds its error
    over the recurrence.
    """

    # Set by kimi_k3/internals.py on its copy of a model: the forward then keeps what the
    # internals report reads (kimi_k3/layers/capture.py says why a class attribute).
    capture_internals = False

    # The products a decoder holds as one (kimi_k3/layers/fused.py): the six that read x, and
    # the two low-rank ups (one kernel shape, [K, HV, K], as V = K).
    FUSED = {"x_in": ("q_proj", "k_proj", "v_proj", "b_proj", "f_down", "g_down"),
             "ups": ("f_up", "g_up")}
    FUSED_STACKED = ("ups",)

    def __init__(self, d_model: int, spec: KdaSpec, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, fp8: bool = False):
        H, HV, K = spec.num_heads, spec.num_v_heads, spec.head_dim
        V = K
        self.spec, self.dtype = spec, dtype
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        wide = dict(kw, fp8=fp8)  # the projections into and out of the heads
        self.q_proj = Dense(d_model, (H, K), names=("embed", "heads", "kv"), **wide)
        self.k_proj = Dense(d_model, (H, K), names=("embed", "heads", "kv"), **wide)
        self.v_proj = Dense(d_model, (HV, V), names=("embed", "heads", "kv"), **wide)
        conv_kw = dict(names=("heads", "kv"), rngs=rngs, param_dtype=param_dtype,
                       impl=spec.conv_impl)
        self.q_conv = ShortConv((H, K), spec.conv_width, **conv_kw)
        self.k_conv = ShortConv((H, K), spec.conv_width, **conv_kw)
        self.v_conv = ShortConv((HV, V), spec.conv_width, **conv_kw)
        # Decay gate: low rank (rank = head dim) into per-channel logits.
        self.f_down = Dense(d_model, K, names=("embed", "rank"), **kw)
        self.f_up = Dense(K, (HV, K), names=("rank", "heads", "kv"), **kw)
        # Bounded gate: A_log = 0, so the gate is g_min sigmoid(f + dt_bias) at the start;
        # softplus gate: A = U(1, 16) as in Kimi Linear.
        if spec.gate == "bounded":
            A_log = jnp.zeros((HV,), jnp.float32)
        else:
            A_log = jnp.log(jax.random.uniform(rngs.params(), (HV,), jnp.float32, 1.0, 16.0))
        self.A_log = param(A_log, ("heads",))
        self.dt_bias = param(init_dt_bias(rngs.params(), (HV, K)), ("heads", "kv"))
        self.b_proj = Dense(d_model, HV, names=("embed", "heads"), **kw)
        # Output: per-head RMSNorm times a low-rank sigmoid gate.
        self.o_norm = RMSNorm(V, name="kv", eps=spec.norm_eps, dtype=jnp.float32,
                             param_dtype=param_dtype)
        self.g_down = Dense(d_model, V, names=("embed", "rank"), **kw)
        self.g_up = Dense(V, (HV, V), names=("rank", "heads", "kv"), **kw)
        self.o_proj = Dense((HV, V), d_model, names=("heads", "kv", "embed"), **wide)


    def init_cache(self, batch_size: int, max_len: int) -> dict[str, jax.Array]:
        """Zero cache: state [B, HV, K, V] f32 and the conv tails [B, W-1, heads, dim]. Its
        size does not depend on ``max_len``: that is the point of KDA."""
        del max_len
        HV, K = self.spec.num_v_heads, self.spec.head_dim
        return {
            "state": jnp.zeros((batch_size, HV, K, K), jnp.float32),
            "conv_q": self.q_conv.init_tail(batch_size, self.dtype),
            "conv_k": self.k_conv.init_tail(batch_size, self.dtype),
            "conv_v": self.v_conv.init_tail(batch_size, self.dtype),
        }

    def _kda_whole(self, q_BxTxHxK, k_BxTxHxK, v_BxTxHVxV, g_BxTxHVxK, beta_BxTxHV,
                   state_BxHVxKxV, segment_ids_BxT, A_log_HV, dt_bias_HVxK, with_state: bool):
        """The KDA op on whole sequences: (o [B, T, HV, V], the final state or None). The
        Pallas kernel, which the compiler cannot partition, runs under a mesh on each device's
        rows and heads (``sharding.per_device``); the other forms are partitioned by it."""
        spec = self.spec

        def run(q, k, v, g, beta, S0, seg, A_log, dt_bias):
            gate = {} if A_log is None else {"A_log": A_log, "dt_bias": dt_bias}
            return kda(q, k, v, g, beta, **gate, initial_state=S0, output_final_state=with_state,
                       segment_ids=seg, chunk_size=spec.chunk_size, lower_bound=spec.lower_bound,
                       impl=spec.impl, tuning=spec.kernel_tuning,
                       # A non-finite value anywhere makes the loss non-finite, and the trainer
                       # then drops the whole step: keeping it inside its document buys nothing.
                       isolate_documents=False)

        args = (q_BxTxHxK, k_BxTxHxK, v_BxTxHVxV, g_BxTxHVxK, beta_BxTxHV, state_BxHVxKxV,
                segment_ids_BxT, A_log_HV, dt_bias_HVxK)
        if spec.impl != "pallas":
            return run(*args)
        rows, heads = "activation_batch", "activation_heads"
        state = (rows, heads, None, None)
        names = (ROWS_HEADS, ROWS_HEADS, ROWS_HEADS, ROWS_HEADS, (rows, None, heads), state,
                 (rows, None), (heads,), (heads, None))
        return per_device(run, args, names, (ROWS_HEADS, state))

    def _keep_internals(self, k_BxTxHxK, v_BxTxHVxV, f_BxTxHVxK, beta_BxTxHV, gate_BxTxHVxV):
        """What kimi_k3/internals.py reads of this layer: the recurrence's inputs k, v, the
        log-decay g [B, T, HV, K] (float32; computed here also when the op takes the gate's
        pre-activation), beta, and the output gate's activation [B, T, HV, V]."""
        g_BxTxHVxK = kda_gate(f_BxTxHVxK, self.A_log[...], self.dt_bias[...],
                              self.spec.lower_bound)
        for name, value in (("k", k_BxTxHxK), ("v", v_BxTxHVxV), ("log_decay", g_BxTxHVxK),
                            ("beta", beta_BxTxHV), ("out_gate", gate_BxTxHVxV)):
            keep(self, name, value)

    def __call__(
        self,
        x_BxTxD: jax.Array,
        segment_ids_BxT: jax.Array | None = None,
        cache: dict[str, jax.Array] | None = None,
        pos: jax.Array | int = 0,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """Returns (out [B, T, D], the cache after the last token or None when none was given).

        With a cache, the sequence continues the cached one (one document per row:
        ``segment_ids`` must then be None). ``pos`` is not needed: the state carries order.
        """
        del pos
        if cache is not None and segment_ids_BxT is not None:
            raise ValueError("KDALayer: segment_ids must be None when continuing from a cache")
        c = cache if cache is not None else {}
        # Named scopes label the parts in profiles (benchmarks/step_profile.py).
        q, k, v, f_BxTxHVxK, b_BxTxHV, o_gate_BxTxHVxV = self._project(x_BxTxD)
        with jax.named_scope("kda_conv"):
            # SiLU, and the L2 norm per head for q and k: inside the convolution kernels
            # (conv_impl "pallas"), after the convolution otherwise.
            q, tail_q = self.q_conv(q, segment_ids_BxT, c.get("conv_q"), activation="silu_l2")
            k, tail_k = self.k_conv(k, segment_ids_BxT, c.get("conv_k"), activation="silu_l2")
            v, tail_v = self.v_conv(v, segment_ids_BxT, c.get("conv_v"), activation="silu")
            q_BxTxHxK = constrain(q.astype(self.dtype), BTHK)
            k_BxTxHxK = constrain(k.astype(self.dtype), BTHK)
            v_BxTxHVxV = constrain(v, BTHK)
            # Kept by remat="dots_kernels" (config.SAVED_NAMES) rather than recomputed.
            q_BxTxHxK, k_BxTxHxK, v_BxTxHVxV = (
                checkpoint_name(x, "kda_qkv") for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHVxV))
        layout = context_layout()
        if layout is not None and not layout.splits(x_BxTxD.shape[1]):
            layout = None
        A_log_HV, dt_bias_HVxK = self.A_log[...], self.dt_bias[...]
        with jax.named_scope("kda_gate"):
            beta_BxTxHV = jax.nn.sigmoid(b_BxTxHV.astype(jnp.float32))
            # What the op takes as g: the log-decay, or the gate's pre-activation with the
            # gate's parameters (gate_in_kernel).
            if self.spec.gate_in_kernel:
                gate_BxTxHVxK, gate_params = f_BxTxHVxK, {"A_log": A_log_HV,
                                                          "dt_bias": dt_bias_HVxK}
            else:
                gate_BxTxHVxK = kda_gate(f_BxTxHVxK, A_log_HV, dt_bias_HVxK,
                                         self.spec.lower_bound)
                gate_params = {}
        # With gate_in_kernel the decay gate runs inside the op (in the Pallas kernel's
        # prologue, so g never reaches memory): profiles count it in kda_core.
        with jax.named_scope("kda_core"):
            if layout is not None:  # continuing from the cache's state, when there is one
                o_BxTxHVxV, state = kda_context_parallel(
                    q_BxTxHxK, k_BxTxHxK, v_BxTxHVxV, gate_BxTxHVxK, beta_BxTxHV,
                    **gate_params,
                    mesh=layout.mesh, context_axes=layout.axes, batch_axes=layout.batch,
                    head_axes=layout.heads, segment_ids=segment_ids_BxT,
                    initial_state=c.get("state"), output_final_state=cache is not None,
                    chunk_size=self.spec.chunk_size, lower_bound=self.spec.lower_bound,
                    impl=self.spec.impl, tuning=self.spec.kernel_tuning)
            else:
                o_BxTxHVxV, state = self._kda_whole(
                    q_BxTxHxK, k_BxTxHxK, v_BxTxHVxV, gate_BxTxHVxK, beta_BxTxHV, c.get("state"),
                    segment_ids_BxT, gate_params.get("A_log"), gate_params.get("dt_bias"),
                    with_state=cache is not None)
        with jax.named_scope("kda_out"):
            gate_BxTxHVxV = jax.nn.sigmoid(o_gate_BxTxHVxV.astype(jnp.float32))
            o_BxTxHVxV = (self.o_norm(o_BxTxHVxV) * gate_BxTxHVxV).astype(self.dtype)
            out_BxTxD = self.o_proj(constrain(o_BxTxHVxV, BTHK))
        if self.capture_internals:
            self._keep_internals(k_BxTxHxK, v_BxTxHVxV, f_BxTxHVxK, beta_BxTxHV, gate_BxTxHVxV)
        if cache is None:
            return out_BxTxD, None
        return out_BxTxD, {"state": state, "conv_q": tail_q, "conv_k": tail_k, "conv_v": tail_v}

    def _project(self, x_BxTxD: jax.Array):
        """The layer's projections of x, before their convolutions: q [B, T, H, K], k, v
        [B, T, HV, V], the decay gate's pre-activation f [B, T, HV, K] and beta's [B, T, HV]
        (low rank), the output gate's [B, T, HV, V] (low rank)."""
        with jax.named_scope("kda_proj"):
            y = shared_input(self, "x_in", x_BxTxD)
            f_BxTxHVxK, o_gate_BxTxHVxV = stacked(self, "ups", y["f_down"], y["g_down"])
            return y["q_proj"], y["k_proj"], y["v_proj"], f_BxTxHVxK, y["b_proj"], o_gate_BxTxHVxV

    def step(self, x_Bx1xD: jax.Array, cache: dict[str, jax.Array], pos: jax.Array,
             layer: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One decoding step: (out [B, 1, D], the cache after the token), the numbers of
        ``__call__`` with a cache for a single token, with the recurrence's one-token form
        (``ops.kda_recurrent.kda_step``: one pass reading the state, one writing it) in place
        of the sequence op. After the projections, ``spec.step_impl`` "pallas" runs the rest
        (convolutions, gates, the state update, the output norm and gate) as one kernel
        (``pallas_kernels.kda_decode``), "xla" as XLA's ops; the output projection follows.
        ``pos`` is not needed (the state carries order). ``layer``: the
        cache's arrays are stacks over a scanned model's layers [N, ...] and this layer's are
        number ``layer`` (static): read from the stack, written back into it in place.
        """
        del pos
        c = cache if layer is None else {name: a[layer] for name, a in cache.items()}
        q, k, v, f_Bx1xHVxK, b_Bx1xHV, o_gate_Bx1xHVxV = self._project(x_Bx1xD)
        if self.spec.step_impl == "pallas":
            out_Bx1xD, new = self._step_kernel(q, k, v, f_Bx1xHVxK, b_Bx1xHV, o_gate_Bx1xHVxV, c)
        else:
            out_Bx1xD, new = self._step_xla(q, k, v, f_Bx1xHVxK, b_Bx1xHV, o_gate_Bx1xHVxV, c)
        if layer is not None:
            new = {name: cache[name].at[layer].set(a.astype(cache[name].dtype))
                   for name, a in new.items()}
        return out_Bx1xD, new

    def _step_kernel(self, q, k, v, f_Bx1xHVxK, b_Bx1xHV, o_gate_Bx1xHVxV, c):
        """``step`` after the projections as one kernel (pallas_kernels/kda_decode.py)."""
        with jax.named_scope("kda_core"):
            out_BxHVxV, state = kda_decode.kda_decode_step(
                q[:, 0], k[:, 0], v[:, 0], (c["conv_q"], c["conv_k"], c["conv_v"]),
                (self.q_conv.weight[...], self.k_conv.weight[...], self.v_conv.weight[...]),
                f_Bx1xHVxK[:, 0], b_Bx1xHV[:, 0], o_gate_Bx1xHVxV[:, 0], self.A_log[...],
                self.dt_bias[...], c["state"], self.o_norm.scale[...],
                lower_bound=self.spec.lower_bound, norm_eps=self.o_norm.eps,
                l2_eps=short_conv_kernel.L2_EPS, out_dtype=self.dtype)
        with jax.named_scope("kda_out"):
            out_Bx1xD = self.o_proj(out_BxHVxV[:, None])
        tails = {name: jnp.concatenate([c[name].astype(x.dtype), x], axis=1)[:, 1:]
                 for name, x in (("conv_q", q), ("conv_k", k), ("conv_v", v))}
        return out_Bx1xD, {"state": state, **tails}

    def _step_xla(self, q, k, v, f_Bx1xHVxK, b_Bx1xHV, o_gate_Bx1xHVxV, c):
        """``step`` after the projections in XLA's ops."""
        K = self.spec.head_dim
        with jax.named_scope("kda_conv"):
            q, tail_q = _conv_step(self.q_conv, q, c["conv_q"], l2=True)
            k, tail_k = _conv_step(self.k_conv, k, c["conv_k"], l2=True)
            v, tail_v = _conv_step(self.v_conv, v, c["conv_v"], l2=False)
        with jax.named_scope("kda_core"):
            g_Bx1xHVxK = kda_gate(f_Bx1xHVxK, self.A_log[...], self.dt_bias[...],
                                  self.spec.lower_bound)
            beta_Bx1xHV = jax.nn.sigmoid(b_Bx1xHV.astype(jnp.float32))
            o_BxHVxV, state = kda_step(q[:, 0].astype(self.dtype), k[:, 0].astype(self.dtype),
                                       v[:, 0], g_Bx1xHVxK[:, 0], beta_Bx1xHV[:, 0], c["state"],
                                       scale=K ** -0.5)
            o_Bx1xHVxV = o_BxHVxV.astype(v.dtype)[:, None]
        with jax.named_scope("kda_out"):
            gate_Bx1xHVxV = jax.nn.sigmoid(o_gate_Bx1xHVxV.astype(jnp.float32))
            o_Bx1xHVxV = (self.o_norm(o_Bx1xHVxV) * gate_Bx1xHVxV).astype(self.dtype)
            out_Bx1xD = self.o_proj(o_Bx1xHVxV)
        return out_Bx1xD, {"state": state, "conv_q": tail_q, "conv_k": tail_k, "conv_v": tail_v}


def _conv_step(conv: ShortConv, x_Bx1xC: jax.Array, tail_BxWm1xC: jax.Array, l2: bool):
    """One token through a short convolution and its activation: (SiLU, then with ``l2`` the
    L2 norm over the head, of y = sum_w weight[w] x_ext[w] over x_ext = [tail ; x]) in x's dtype,
    and the new tail. The numbers of ``ShortConv.__call__`` for one token (the same float32
    sum in the same order, the same roundings), as one fusion: its barrier between the
    convolution and the activation, which keeps a whole sequence's kernels apart, would make
    three launches of a decoding step's few numbers."""
    W = conv.width
    x_ext = jnp.concatenate([tail_BxWm1xC.astype(x_Bx1xC.dtype), x_Bx1xC], axis=1)
    w = conv.weight[...].astype(jnp.float32)
    y = jnp.zeros(x_Bx1xC.shape, jnp.float32)
    for lag in range(W):  # tap W-1-lag multiplies x_{t-lag}
        y = y + x_ext[:, W - 1 - lag : W - lag].astype(jnp.float32) * w[W - 1 - lag]
    y = jax.nn.silu(y.astype(x_Bx1xC.dtype))
    if l2:
        y = l2_normalize(y, eps=short_conv_kernel.L2_EPS).astype(y.dtype)
    return y, x_ext[:, 1:]
