"""A KDA layer's decoding step after its projections, one Pallas (Triton) program per row and
value head (GPU; interpret mode elsewhere), for ``KDALayer.step`` with
``model.kda.step_impl = "pallas"``.

Per row b and value head h (its query/key head h // G), with x_ext = [tail ; x] the W inputs of
a short convolution (the W-1 cached ones and the token's) and w its taps:

    q = L2Norm(SiLU(sum_i w_q[i] x_ext,q[i]))    [K]      k likewise;  v = SiLU(conv_v)  [V]
    g = gate(f; A_log, dt_bias)                  [K]      beta = sigmoid(b)
    A = Diag(exp g) S,   u = beta (v - A^T k),   S' = A + k u^T,   o = S'^T q / sqrt(K)
    out = RMSNorm(o) w_norm * sigmoid(o_gate)    [V]

rounded where the XLA form (``KDALayer.step``) rounds: each convolution's sum and activation
to the input dtype, o to v's dtype before its norm, out to ``out_dtype``. XLA runs these as
some ten small kernels a layer, each a launch of a few microseconds at batch 1; here they are
one, which reads the state S [K, V] (float32) once and writes it once, in place (the state's
buffer is the output's). The convolutions' new tails (x_ext less its oldest row) are the
caller's.

K and V must be powers of two (``unsupported``); interpret mode takes any.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import device

f32 = jnp.float32


def unsupported(K: int, V: int) -> str | None:
    """None when the compiled kernel takes head dims K and V, else why not (one line)."""
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            return f"head dim {name} = {n} is not a power of two >= 16 (the kernel's vectors)"
    return None


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def kda_decode_step(q_BxHxK, k_BxHxK, v_BxHVxV, tails, conv_weights, f_BxHVxK, b_BxHV,
                    o_gate_BxHVxV, A_log_HV, dt_bias_HVxK, state_BxHVxKxV, norm_w_V, *,
                    lower_bound: float | None, norm_eps: float, l2_eps: float, out_dtype,
                    interpret: bool | None = None):
    """(out [B, HV, V] in ``out_dtype``, the new state [B, HV, K, V] float32) for one token.

    q, k [B, H, K] and v [B, HV, V]: the projections before their convolutions; ``tails``:
    their cached inputs (tq, tk [B, W-1, H, K], tv [B, W-1, HV, V]); ``conv_weights``: the taps
    (wq, wk [W, H, K], wv [W, HV, V]); f [B, HV, K]: the decay gate's logits; b [B, HV]: beta's;
    o_gate [B, HV, V]: the output gate's; A_log [HV], dt_bias [HV, K]; the state; the output
    norm's scale [V]. ``lower_bound``: the bounded gate's g_min, None for the softplus gate.
    """
    B, H, K = q_BxHxK.shape
    HV, V = v_BxHVxV.shape[1:]
    G = HV // H
    W = conv_weights[0].shape[0]
    tq, tk, tv = tails
    wq, wk, wv = conv_weights
    scale = K ** -0.5
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    if not interpret and (why := unsupported(K, V)):
        raise ValueError(f"kda_decode_step: {why}")
    # eight warps: the state, its faded copy and the new one are [K, V] float32 each
    params = None if interpret else device.triton_compiler_params(8, 1)

    def kernel(q_ref, k_ref, v_ref, tq_ref, tk_ref, tv_ref, wq_ref, wk_ref, wv_ref, f_ref, b_ref,
               og_ref, alog_ref, dtb_ref, nw_ref, s_ref, out_ref, s_out_ref):
        b, h = pl.program_id(0), pl.program_id(1)
        hq = h // G

        def conv(x_ref, t_ref, w_ref, head, l2: bool):
            dt = x_ref.dtype
            # tap W-1 multiplies the token, tap W-1-lag the input lag steps back: the XLA form's
            # order of the float32 sum
            y = x_ref[b, head, :].astype(f32) * w_ref[W - 1, head, :].astype(f32)
            for lag in range(1, W):
                x = t_ref[b, W - 1 - lag, head, :].astype(dt).astype(f32)
                y = y + x * w_ref[W - 1 - lag, head, :].astype(f32)
            y = y.astype(dt).astype(f32)
            y = (y * _sigmoid(y).astype(dt).astype(f32)).astype(dt).astype(f32)  # SiLU in dt
            if l2:
                y = (y * lax.rsqrt(jnp.sum(y * y) + l2_eps)).astype(dt).astype(f32)
            return y

        q = conv(q_ref, tq_ref, wq_ref, hq, True) * scale
        k = conv(k_ref, tk_ref, wk_ref, hq, True)
        v = conv(v_ref, tv_ref, wv_ref, h, False)
        fx = f_ref[b, h, :].astype(f32) + dtb_ref[h, :].astype(f32)
        A = jnp.exp(alog_ref[h].astype(f32))
        g = -A * _softplus(fx) if lower_bound is None else lower_bound * _sigmoid(A * fx)
        beta = _sigmoid(b_ref[b, h].astype(f32))
        faded = jnp.exp(g)[:, None] * s_ref[...]  # [K, V]
        pred = jnp.sum(faded * k[:, None], axis=0)  # A^T k  [V]
        read = jnp.sum(faded * q[:, None], axis=0)  # A^T q  [V]
        u = beta * (v - pred)
        s_out_ref[...] = faded + k[:, None] * u[None, :]
        o = (read + jnp.sum(k * q) * u).astype(v_ref.dtype).astype(f32)
        y = o * lax.rsqrt(jnp.sum(o * o) / V + norm_eps) * nw_ref[...].astype(f32)
        out_ref[...] = (y * _sigmoid(og_ref[b, h, :].astype(f32))).astype(out_ref.dtype)

    whole = pl.BlockSpec()
    state_spec = pl.BlockSpec((None, None, K, V), lambda b, h: (b, h, 0, 0))
    args = (q_BxHxK, k_BxHxK, v_BxHVxV, tq, tk, tv, wq, wk, wv, f_BxHVxK, b_BxHV, o_gate_BxHVxV,
            A_log_HV, dt_bias_HVxK.reshape(HV, K), norm_w_V, state_BxHVxKxV.astype(f32))
    out, state = pl.pallas_call(
        kernel,
        grid=(B, HV),
        in_specs=[whole] * 15 + [state_spec],
        out_specs=[pl.BlockSpec((None, None, V), lambda b, h: (b, h, 0)), state_spec],
        out_shape=[jax.ShapeDtypeStruct((B, HV, V), out_dtype),
                   jax.ShapeDtypeStruct((B, HV, K, V), f32)],
        input_output_aliases={15: 1},
        interpret=interpret,
        compiler_params=params,
        name="kda_decode_step",
    )(*args)
    return out, state
