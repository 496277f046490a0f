"""Mixture of experts: Kimi Linear's sigmoid router with a load-balancing bias, dropless or with a
capacity, expert-parallel over the mesh's "expert" axis.

Router, per token x [D], E routed experts, correction bias b [E] (``route``):

    s = sigmoid(x W_r)                         [E]  scores: they weight the chosen experts
    c = s + b                                  [E]  choice scores: they choose them
    n_group > 1: the experts form n_group groups of E / n_group; each group is scored by the sum
                 of its two largest c; only the topk_group best groups stay eligible (the other
                 experts' c = -inf)
    chosen = top_k(c)                          k experts; among equal c the lowest index wins
    w_j = s[chosen_j];  renormalize: w_j <- w_j / (sum_j w_j + 1e-20);  w_j <- w_j * scale

    y = sum_j w_j SwiGLU_{chosen_j}(x) + SwiGLU_shared(x)

The router runs in float32 (``router_float32``; the matmul at float32 precision, for bfloat16
x as bfloat16 matmuls over a three-way split of W: ``kimi_k3.ops.split_product``), scores and
weights are float32 either way. Routed expert e is a SwiGLU of width F = expert_dim
(W_i [E, D, 2, F] fusing gate and up, W_o [E, F, D]); the shared expert, a SwiGLU of width
shared_dim (expert_dim x num_shared), sees every token.

LatentMoE (``latent_dim`` = l > 0; Elango et al. 2026, "LatentMoE: Toward Optimal Accuracy per
FLOP and Parameter in Mixture of Experts", arXiv:2601.18089, the form of Nemotron 3 Super): the
routed path is wrapped in two linear maps shared by every expert, W_down [D, l] and W_up [l, D];
the router still reads x, the experts run on the latent, their weighted sum is taken there:

    y = (sum_j w_j SwiGLU_{chosen_j}(x W_down)) W_up + SwiGLU_shared(x)

so routed expert e has W_i [E, l, 2, F], W_o [E, F, l]: l / D of the routed weights and of the
rows an expert-parallel exchange moves.

Balance without an auxiliary loss (DeepSeek-V3): b gets no gradient. Each forward pass records
load_e, the tokens sent to expert e; after every optimizer step the trainer moves
b_e += rate * sign(mean_e' load_e' - load_e) (:func:`update_bias`): the underloaded rise, the
overloaded sink. b is model state, not a parameter (``ExpertBias``): checkpointed, never seen by
the optimizer. Optionally a sequence-wise balance loss (``balance_loss_coef`` = alpha > 0), per
row of T tokens:

    f_e = E / (k T) sum_t [e chosen at t],   P_e = 1/T sum_t s_te / sum_e' s_te'
    L_bal = alpha sum_e f_e P_e              averaged over rows; the trainer adds it to the loss

Dispatch (per device: the tokens it holds). Dropless (``capacity_factor = 0``): every
token-expert assignment is kept; they are sorted by expert and multiplied by grouped matmuls
(``kimi_k3.ops.grouped_matmul``: ``jax.lax.ragged_dot``, or Hopper's Mosaic GPU kernels with
``expert_matmul="mosaic_gpu"``, "auto" on sm_90), or (``expert_matmul="dense"``, "auto" on
other GPUs) every token goes through every local expert with its routing weights, zero off its
top-k, as two einsums. With
a capacity factor c > 0, an expert takes at most
C = ceil(c n k / E) of a device's n tokens, in priority order (every token's first choice in
token order, then every second choice, ...); the rest are dropped (routed output zero; the
shared expert still sees them) and counted. The experts then run as one batched matmul over
fixed [E, C, D] buffers.

Expert parallelism: under a mesh (``kimi_k3/sharding.py``'s rules in context) the dispatch runs
inside ``shard_map``, each device on its own tokens. When the expert axis has P > 1 devices,
each holds E / P experts. With the default rules that axis also splits the tokens: an
``all_to_all`` takes each device's tokens to the devices holding their experts, the experts
run there, and a second ``all_to_all`` brings the outputs home. With capacity buffers each
device sends c n k rows, the expected traffic. Dropless, fixed shapes must cover the worst case
(every token choosing experts on one device). With ``ep_exchange="all_tokens"`` each device
sends every peer all n of its tokens, each once with its choices on that peer; the bytes of an
all-gather, however many experts a token chose there. With ``"ragged"``
(:func:`_dropless_ragged`) a token goes only to the devices holding its experts, once each, by
``ragged_all_to_all`` (``kimi_k3.ops.ragged_exchange``): the traffic as routed, into receive
buffers still of the worst case's P n rows. Under rules where the expert axis does not split
the tokens, its devices share them: each runs its own experts on them and the outputs are summed
by psum. Data and FSDP axes gather the expert weights at the ``shard_map``'s edge (their
gradients are reduce-scattered back); a tensor axis splits the experts' hidden width, whose
partial outputs are summed by psum.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from kimi_k3 import sharding
from kimi_k3.config import MoeSpec
from kimi_k3.dispatch import choose_expert_matmul
from kimi_k3.layers.dense import Dense, fp8_einsum
from kimi_k3.layers.mlp import SwiGLU
from kimi_k3.ops import routed_experts as routed_lib
from kimi_k3.ops.ragged_exchange import ragged_all_to_all
from kimi_k3.ops.routed_experts import routed_experts
from kimi_k3.ops.split_product import router_logits

# Logical axes of the routed experts' weights (kimi_k3/sharding.py maps them to mesh axes).
WI_NAMES = ("expert", "embed", None, "mlp")  # [E, D, (gate, up), F]
WO_NAMES = ("expert", "mlp", "embed")  # [E, F, D]
RENORM_EPS = 1e-20


class ExpertBias(nnx.Variable):
    """The routing correction bias b [E]: it chooses experts and never weights them. Not a
    parameter: no gradient, no optimizer; the trainer updates it from the measured load
    (:func:`update_bias`) and checkpoints it with the parameters."""


class GradientSum(nnx.Variable):
    """The running sum of earlier micro-batches' gradients of an expert matrix, like it: set by
    the trainer for one forward and backward pass (``train_lib.make_train_step``), empty ([0])
    otherwise. With it set, the gradient the layer returns for that matrix is the sum plus
    this micro-batch's (``routed_experts.routed_blocked``'s ``sums``)."""


class MoeStat(nnx.Variable):
    """A measurement of the last forward pass, written by the layer for the trainer to read:
    ``load`` [E] (tokens per expert), ``dropped`` (token-expert assignments over capacity),
    ``balance_loss`` (alpha L_bal, 0 when off)."""


# The model state that zeros stand for when a model is put together from its parameters
# (training, a checkpoint, an import): measurements a forward pass overwrites, and gradient
# sums that stay empty until the trainer sets them.
ZEROED_STATE = (MoeStat, GradientSum)


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


def route(x_BxTxD: jax.Array, router_DxE: jax.Array, bias_E: jax.Array, spec: MoeSpec,
          compute_dtype=jnp.float32):
    """(scores s [B, T, E] float32, chosen experts [B, T, k] int32, weights [B, T, k] float32).

    The choice uses s + b (with grouped routing when ``n_group > 1``); the weights come from s,
    renormalised and scaled as ``spec`` says. Ties in ``lax.top_k`` go to the lowest index.
    With ``router_float32`` the logits x W are float32 products (``split_product``'s
    ``router_logits``: on bfloat16 x, bfloat16 matmuls exact to float32 rounding).
    """
    if spec.router_float32:
        # W whole on every device before it is split, as the product needs it: left to the
        # partitioner, the split copies of the forward and backward passes are gathered apart.
        logits_BxTxE = router_logits(x_BxTxD, sharding.constrain(router_DxE, (None, None)))
    else:
        logits_BxTxE = jnp.einsum("btd,de->bte", x_BxTxD.astype(compute_dtype),
                                  router_DxE.astype(compute_dtype))
    s_BxTxE = jax.nn.sigmoid(logits_BxTxE.astype(jnp.float32))
    choice_BxTxE = jax.lax.stop_gradient(s_BxTxE + bias_E.astype(jnp.float32))
    E, G = spec.num_experts, spec.n_group
    if G > 1:
        B, T = x_BxTxD.shape[:2]
        grouped_BxTxGxS = choice_BxTxE.reshape(B, T, G, E // G)
        group_score_BxTxG = jax.lax.top_k(grouped_BxTxGxS, 2)[0].sum(-1)
        _, best_BxTxg = jax.lax.top_k(group_score_BxTxG, spec.topk_group)
        keep_BxTxG = jnp.any(best_BxTxg[..., None] == jnp.arange(G), axis=-2)
        keep_BxTxE = jnp.repeat(keep_BxTxG, E // G, axis=-1)
        choice_BxTxE = jnp.where(keep_BxTxE, choice_BxTxE, -jnp.inf)
    _, idx_BxTxK = jax.lax.top_k(choice_BxTxE, spec.top_k)
    w_BxTxK = jnp.take_along_axis(s_BxTxE, idx_BxTxK, axis=-1)
    if spec.renormalize:
        w_BxTxK = w_BxTxK / (w_BxTxK.sum(-1, keepdims=True) + RENORM_EPS)
    return s_BxTxE, idx_BxTxK.astype(jnp.int32), w_BxTxK * spec.routed_scaling_factor


def expert_load(idx_BxTxK: jax.Array, num_experts: int) -> jax.Array:
    """Tokens sent to each expert [E] float32 (a token counts once per expert it chose)."""
    return jnp.zeros((num_experts,), jnp.float32).at[idx_BxTxK.reshape(-1)].add(1.0)


def sequence_balance_loss(s_BxTxE: jax.Array, idx_BxTxK: jax.Array) -> jax.Array:
    """sum_e f_e P_e averaged over rows (DeepSeek-V3's sequence-wise balance loss, without its
    coefficient): f_e = E / (k T) x the row's assignments to e, P_e = the row's mean normalised
    score of e. Gradients reach the router through P_e only."""
    B, T, E = s_BxTxE.shape
    k = idx_BxTxK.shape[-1]
    rows_BxTk = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T * k))
    counts_BxE = jnp.zeros((B, E), jnp.float32).at[rows_BxTk, idx_BxTxK.reshape(B, T * k)].add(1.0)
    f_BxE = counts_BxE * (E / (k * T))
    p_BxE = jnp.mean(s_BxTxE / jnp.sum(s_BxTxE, -1, keepdims=True), axis=1)
    return jnp.mean(jnp.sum(f_BxE * p_BxE, -1))


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """b_e + rate * sign(mean_e' load_e' - load_e), over the last axis (stacked layers, [.., E],
    each balance their own experts)."""
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load).astype(bias.dtype)


# ---------------------------------------------------------------------------------------------
# Dispatch: per device, inside shard_map under a mesh
# ---------------------------------------------------------------------------------------------


def _product(eq: str, a, w, fp8: bool, out_dtype=None):
    """``einsum(eq, a, w)``: in FP8 (``dense.fp8_einsum``: e4m3 operands, e5m2 gradients, one
    scale per tensor, which under a mesh is per device: the dispatch runs in ``shard_map``), or
    in a's dtype with a ``out_dtype`` result."""
    if fp8:
        y = fp8_einsum(eq, a, w)
        return y if out_dtype is None else y.astype(out_dtype)
    return jnp.einsum(eq, a, w, preferred_element_type=out_dtype)


def _swiglu_batched(x_ExCxD, wi_ExDx2xF, wo_ExFxD, fp8: bool = False):
    """Expert SwiGLUs on fixed buffers: expert e on its C rows."""
    h_ExCx2xF = _product("ecd,edgf->ecgf", x_ExCxD, wi_ExDx2xF, fp8)
    h_ExCxF = jax.nn.silu(h_ExCx2xF[:, :, 0]) * h_ExCx2xF[:, :, 1]
    return _product("ecf,efd->ecd", h_ExCxF, wo_ExFxD, fp8)


def _dense_experts(x_NxD, idx_NxK, w_NxK, wi, wo, fp8: bool = False):
    """Every token through every local expert, each expert's hidden activations scaled by the
    token's routing weight for it (zero off its top-k; ids >= E_l belong to other devices):

        g[n, e] = sum_j w[n, j] [idx[n, j] = e],   y_n = sum_e (g[n, e] a_e(x_n)) W_o,e

    with a_e the expert's SwiGLU hidden activations. Equal to the grouped form; E_l / k times
    its expert FLOPs, but two plain einsums."""
    E_l = wi.shape[0]
    g_NxE = jnp.sum(jax.nn.one_hot(idx_NxK, E_l, dtype=jnp.float32) * w_NxK[..., None], axis=1)
    h_NxEx2xF = _product("nd,edgf->negf", x_NxD, wi, fp8)
    a_NxExF = jax.nn.silu(h_NxEx2xF[:, :, 0]) * h_NxEx2xF[:, :, 1]
    a_NxExF = (a_NxExF.astype(jnp.float32) * g_NxE[..., None]).astype(x_NxD.dtype)
    return _product("nef,efd->nd", a_NxExF, wo, fp8, jnp.float32)


def _first_choices(ids_RxK, w_RxK, Kl: int):
    """Each row's first ``Kl`` ids in ascending order (ids >= E_l, served elsewhere, sort last),
    with their weights: a token has at most E_l = Kl choices on one device."""
    if Kl == ids_RxK.shape[-1]:
        return ids_RxK, w_RxK
    first_RxKl = jnp.argsort(ids_RxK, axis=-1)[..., :Kl]
    return (jnp.take_along_axis(ids_RxK, first_RxKl, -1),
            jnp.take_along_axis(w_RxK, first_RxKl, -1))


def _local_experts(x_RxD, ids_RxK, w_RxK, wi, wo, matmul: str, remat: bool, grad_sums=None):
    """This device's experts on rows ``x`` with local ids (E_l: none here) and weights:
    y [R, D] float32 (``kimi_k3.ops.routed_experts``). ``grad_sums``: the blocked kernels'
    gradient sums (``GradientSum``)."""
    if matmul == "blocked":
        return routed_experts(x_RxD, ids_RxK, w_RxK, wi, wo, "blocked", remat=remat,
                              sums=grad_sums)
    return routed_experts(x_RxD, ids_RxK, w_RxK, wi, wo, "sorted",
                          "xla" if matmul == "ragged" else matmul)


def _dropless(x_NxD, idx_NxK, w_NxK, wi, wo, *, P: int, axes, matmul: str = "ragged",
              remat: bool = False, exchange: str = "all_tokens", grad_sums=None):
    """Every assignment kept. wi, wo hold this device's E_l experts; with P > 1 devices on the
    expert ``axes``, tokens travel by all-to-all (``exchange``: "all_tokens", or "ragged":
    :func:`_dropless_ragged`); with P = 1, ``idx`` holds local expert ids, or E_l for a choice
    this device does not serve. ``matmul``: "ragged" | "mosaic_gpu" | "blocked"
    (``kimi_k3.ops.routed_experts``). Returns the routed output [N, D] float32."""
    N, K = idx_NxK.shape
    E_l = wi.shape[0]
    if P > 1 and exchange == "ragged":
        return _dropless_ragged(x_NxD, idx_NxK, w_NxK, wi, wo, P=P, axes=axes, matmul=matmul,
                                remat=remat)
    if P > 1:
        # To each peer j: all N tokens, each with its choices on j as local expert ids; a choice
        # elsewhere becomes E_l, an id past the last expert, which sorts last and is skipped.
        on_peer_PxNxK = (idx_NxK // E_l)[None] == jnp.arange(P)[:, None, None]
        ids_PxNxK = jnp.where(on_peer_PxNxK, (idx_NxK % E_l)[None], E_l)
        send = lambda a: jax.lax.all_to_all(jnp.broadcast_to(a, (P, *a.shape[-2:])), axes, 0, 0)
        x_RxD = send(x_NxD).reshape(P * N, -1)  # R = P N rows, grouped by source device
        ids_RxK = send(ids_PxNxK).reshape(P * N, K)
        w_RxK = send(w_NxK).reshape(P * N, K)
    else:
        x_RxD, ids_RxK, w_RxK = x_NxD, idx_NxK, w_NxK
    ids_RxK, w_RxK = _first_choices(ids_RxK, w_RxK, min(K, E_l))
    out_RxD = _local_experts(x_RxD, ids_RxK, w_RxK, wi, wo, matmul, remat, grad_sums)
    if P > 1:
        back_PxNxD = jax.lax.all_to_all(out_RxD.astype(x_NxD.dtype).reshape(P, N, -1), axes, 0, 0)
        return back_PxNxD.astype(jnp.float32).sum(0)
    return out_RxD


def _dropless_ragged(x_NxD, idx_NxK, w_NxK, wi, wo, *, P: int, axes, matmul: str,
                     remat: bool):
    """``_dropless`` over P > 1 devices by ``ragged_all_to_all``: token n goes to peer j once
    if it chose any expert there, as a row with its choices on j (local ids, E_l for none, and
    their weights); j's experts return the row's weighted sum, and the token adds up its rows.

    This device's rows to j: S_j = #{n: some choice of n on j} (C[me, j] below); it sends
    sum_j S_j <= N min(K, P) rows, the traffic as routed. Its receive buffer must hold the
    worst case, every token of every peer: R = P N rows, as many as the "all_tokens" exchange
    receives, so memory and the experts' work are the same as there."""
    N, K = idx_NxK.shape
    E_l = wi.shape[0]
    Kl, S, R = min(K, E_l), N * min(K, P), P * N
    me = jax.lax.axis_index(axes)
    with jax.named_scope("moe_dispatch"):
        on_peer_PxNxK = (idx_NxK // E_l)[None] == jnp.arange(P)[:, None, None]
        ids_PxNxK = jnp.where(on_peer_PxNxK, (idx_NxK % E_l)[None], E_l)
        ids_PxNxKl, w_PxNxKl = _first_choices(
            ids_PxNxK, jnp.broadcast_to(w_NxK, (P, N, K)).astype(jnp.float32), Kl)
        sent_PN = jnp.any(on_peer_PxNxK, -1).reshape(P * N)
        # The send buffer: pairs (peer j, token n) in peer-major order, the pairs not sent left
        # out; pair_S: each row's pair, P N for the unused rows past the last.
        slot_PN = jnp.where(sent_PN, jnp.cumsum(sent_PN) - 1, S)
        pair_S = jnp.full((S,), P * N, jnp.int32).at[slot_PN].set(
            jnp.arange(P * N, dtype=jnp.int32), mode="drop")
        tok_S = jnp.where(pair_S < P * N, pair_S % N, N)
        x_SxD = jnp.take(x_NxD, tok_S, axis=0, mode="fill", fill_value=0)
        # Ids ride with the weights as float32 (exact below 2**24): one exchange for both.
        meta_PNx2Kl = jnp.concatenate([ids_PxNxKl.astype(jnp.float32), w_PxNxKl],
                                      -1).reshape(P * N, 2 * Kl)
        meta_Sx2Kl = jnp.take(meta_PNx2Kl, pair_S, axis=0, mode="fill", fill_value=0)
        # C[i, j]: the rows device i sends device j; every device needs every row of it.
        C_PxP = jax.lax.all_gather(jnp.sum(sent_PN.reshape(P, N), -1, dtype=jnp.int32), axes)
        excl = lambda a, axis: jnp.cumsum(a, axis) - a
        send_sizes, recv_sizes = C_PxP[me], C_PxP[:, me]
        send_off = excl(C_PxP[me], 0)  # where my rows to each j start in my send buffer
        recv_off = excl(C_PxP[:, me], 0)  # where each i's rows start in my receive buffer
        land_off = excl(C_PxP, 0)[me]  # where my rows start in each j's receive buffer
        home_off = excl(C_PxP, 1)[:, me]  # where each i's rows to me started in its buffer
        x_RxD = ragged_all_to_all(x_SxD, jnp.zeros((R, x_NxD.shape[1]), x_NxD.dtype), send_off,
                                  send_sizes, land_off, recv_sizes, axis_name=axes)
        # Rows past the received ones keep the buffer's id E_l: no expert, skipped.
        empty_Rx2Kl = jnp.concatenate([jnp.full((R, Kl), E_l, jnp.float32),
                                       jnp.zeros((R, Kl), jnp.float32)], -1)
        meta_Rx2Kl = ragged_all_to_all(meta_Sx2Kl, empty_Rx2Kl, send_off, send_sizes, land_off,
                                       recv_sizes, axis_name=axes)
        ids_RxKl = jax.lax.stop_gradient(meta_Rx2Kl[:, :Kl]).astype(jnp.int32)
    y_RxD = _local_experts(x_RxD, ids_RxKl, meta_Rx2Kl[:, Kl:], wi, wo, matmul, remat)
    with jax.named_scope("moe_combine"):
        y_SxD = ragged_all_to_all(y_RxD.astype(x_NxD.dtype),
                                  jnp.zeros((S, x_NxD.shape[1]), x_NxD.dtype), recv_off,
                                  recv_sizes, home_off, send_sizes, axis_name=axes)
        return jnp.zeros((N, x_NxD.shape[1]), jnp.float32).at[tok_S].add(
            y_SxD.astype(jnp.float32), mode="drop")


def _with_capacity(x_NxD, idx_NxK, w_NxK, wi, wo, *, P: int, axes, capacity: int,
                   fp8: bool = False):
    """At most ``capacity`` assignments per expert (first choices first, in token order), the rest
    dropped. Experts and ids as in ``_dropless`` (with P = 1, E_l marks a choice served
    elsewhere). Returns (routed output [N, D] float32, dropped choices per token [N])."""
    N, K = idx_NxK.shape
    E_l = wi.shape[0]
    E, M, C = E_l * P, N * K, capacity
    e_M = idx_NxK.T.reshape(-1)  # priority order: assignment a = slot * N + token
    perm_M = jnp.argsort(e_M, stable=True)
    counts = jnp.zeros((E + 1,), jnp.int32).at[e_M].add(1)  # the last: served elsewhere
    starts = jnp.cumsum(counts) - counts
    pos_M = (jnp.arange(M) - starts[e_M[perm_M]])[routed_lib.inverse(perm_M)]  # place in its expert
    mine_M = e_M < E
    keep_M = mine_M & (pos_M < C)
    # Slot (e, c) of the buffers holds expert e's c-th assignment, if it has one.
    src_ExC = jnp.minimum(starts[:E, None] + jnp.arange(C), M - 1)
    filled_ExC = jnp.arange(C) < counts[:E, None]
    buf_ExCxD = jnp.where(filled_ExC[..., None], x_NxD[perm_M[src_ExC] % N], 0)
    if P > 1:
        buf_PxElxCxD = jax.lax.all_to_all(buf_ExCxD.reshape(P, E_l, C, -1), axes, 0, 0)
        buf = buf_PxElxCxD.transpose(1, 0, 2, 3).reshape(E_l, P * C, -1)
        y = _swiglu_batched(buf, wi, wo, fp8).reshape(E_l, P, C, -1).transpose(1, 0, 2, 3)
        y_ExCxD = jax.lax.all_to_all(y, axes, 0, 0).reshape(E, C, -1)
    else:
        y_ExCxD = _swiglu_batched(buf_ExCxD, wi, wo, fp8)
    y_MxD = jnp.where(keep_M[:, None],
                      y_ExCxD[jnp.minimum(e_M, E - 1), jnp.minimum(pos_M, C - 1)], 0)
    out_NxD = jnp.einsum("nk,knd->nd", w_NxK, y_MxD.reshape(K, N, -1).astype(jnp.float32))
    dropped_N = jnp.sum((mine_M & ~keep_M).reshape(K, N), axis=0).astype(jnp.float32)
    return out_NxD, dropped_N


def _routed(x_BxTxD, idx_BxTxK, w_BxTxK, wi, wo, grad_sums=None, *, spec: MoeSpec, P: int, axes,
            dispatch: str, ffn_axes, matmul: str, typed: bool = True, fp8: bool = False):
    """The routed experts on one device's tokens: (output [B, T, D] in x's dtype, dropped
    choices per token [B, T] float32). ``dispatch``: as ``sharding.ExpertLayout`` says;
    ``matmul``: ``choose_expert_matmul``'s choice; ``typed``: inside a ``shard_map`` that
    checks which axes values vary over; ``fp8``: the capacity buffers' and the "dense" form's
    products in FP8 (the config allows no other form with it); ``grad_sums``: the experts'
    ``GradientSum`` pair, for the blocked kernels to add their weight gradients into."""
    B, T, D = x_BxTxD.shape
    x_NxD = x_BxTxD.reshape(B * T, D)
    idx_NxK, w_NxK = idx_BxTxK.reshape(B * T, -1), w_BxTxK.reshape(B * T, -1)
    sums = tuple(ffn_axes)  # axes whose devices hold partial outputs of the same tokens
    if dispatch == "psum":  # every device along the expert axes holds these tokens
        E_l = wi.shape[0]
        mine_NxK = idx_NxK // E_l == jax.lax.axis_index(axes)
        idx_NxK = jnp.where(mine_NxK, idx_NxK % E_l, E_l)
        # Each device's experts see the same tokens and weights: marked as varying over the
        # expert axes, so that their gradients are summed over them (gathers by a varying
        # index do not say so themselves).
        # Without the check, shard_map's transpose sums the gradients of values it was given
        # whole anyway.
        if typed:
            x_NxD, w_NxK = (jax.lax.pcast(a, axes, to="varying") for a in (x_NxD, w_NxK))
        sums, P = (*axes, *sums), 1
    if spec.capacity_factor > 0:
        capacity = max(1, math.ceil(spec.capacity_factor * B * T * idx_NxK.shape[1]
                                    / spec.num_experts))
        out_NxD, dropped_N = _with_capacity(
            x_NxD, idx_NxK, w_NxK, wi.astype(x_BxTxD.dtype), wo.astype(x_BxTxD.dtype), P=P,
            axes=axes, capacity=capacity, fp8=fp8)
    else:
        if matmul == "dense":
            out_NxD = _dense_experts(x_NxD, idx_NxK, w_NxK, wi.astype(x_BxTxD.dtype),
                                     wo.astype(x_BxTxD.dtype), fp8)
        else:
            out_NxD = _dropless(x_NxD, idx_NxK, w_NxK, wi, wo, P=P, axes=axes, matmul=matmul,
                                remat=spec.remat_experts, exchange=spec.ep_exchange,
                                grad_sums=grad_sums)
        dropped_N = jnp.zeros((B * T,), jnp.float32)
    if sums:
        out_NxD = jax.lax.psum(out_NxD, sums)
    if dispatch == "psum":
        dropped_N = jax.lax.psum(dropped_N, axes)
    return out_NxD.reshape(B, T, D).astype(x_BxTxD.dtype), dropped_N.reshape(B, T)


@jax.custom_vjp
def _plus_sum(w, total):
    """w, whose gradient comes back as ``total`` + its own (``GradientSum`` outside the
    kernels)."""
    return w


_plus_sum.defvjp(lambda w, total: (w, total), lambda total, g: (total.astype(g.dtype) + g, None))


def _place_sums(wi, wo, sums, in_kernels: bool):
    """(wi, wo, sums for the kernels): the experts' ``GradientSum``s go into the blocked
    kernels' weight gradients where ``in_kernels``, else onto the weights' own gradients."""
    if sums is None or in_kernels:
        return wi, wo, sums
    return _plus_sum(wi, jax.lax.stop_gradient(sums[0])), _plus_sum(
        wo, jax.lax.stop_gradient(sums[1])), None


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


class Experts(nnx.Module):
    """E routed SwiGLU experts: wi [E, D, 2, F] (gate, up), wo [E, F, D]; fan-in init."""

    def __init__(self, d_model: int, num_experts: int, expert_dim: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        E, D, F = num_experts, d_model, expert_dim
        wi = jax.random.normal(rngs.params(), (E, D, 2, F), jnp.float32) / math.sqrt(D)
        wo = jax.random.normal(rngs.params(), (E, F, D), jnp.float32) / math.sqrt(F)
        self.wi = sharding.param(wi.astype(param_dtype), WI_NAMES)
        self.wo = sharding.param(wo.astype(param_dtype), WO_NAMES)
        self.wi_sum = GradientSum(jnp.zeros((0,), param_dtype))
        self.wo_sum = GradientSum(jnp.zeros((0,), param_dtype))

    def sums(self):
        """(wi's, wo's) ``GradientSum`` when the trainer has set them, else None."""
        wi_sum, wo_sum = self.wi_sum[...], self.wo_sum[...]
        return None if wi_sum.size == 0 else (wi_sum, wo_sum)


class MoE(nnx.Module):
    """x [B, T, D] -> [B, T, D]: routed experts plus the shared expert (module docstring).

    Called like the dense SwiGLU it replaces. Writes its measurements (``load``, ``dropped``,
    ``balance_loss``: ``MoeStat``) on every call; reads ``bias`` (``ExpertBias``). ``fp8``: the
    experts' and the shared expert's products in FP8, the router's in float32 as ever.
    """

    def __init__(self, d_model: int, spec: MoeSpec, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, fp8: bool = False):
        self.spec, self.dtype, self.fp8 = spec, dtype, fp8
        E = spec.num_experts
        self.router = Dense(d_model, E, names=("embed", None), rngs=rngs, dtype=jnp.float32,
                            param_dtype=param_dtype)
        self.bias = sharding.param(jnp.zeros((E,), jnp.float32), (None,), kind=ExpertBias)
        # LatentMoE's projections around the routed path (None: the experts read x itself).
        L = spec.latent_dim or d_model
        self.latent_down = (Dense(d_model, L, names=("embed", None), rngs=rngs, dtype=dtype,
                                  param_dtype=param_dtype, fp8=fp8) if spec.latent_dim else None)
        self.latent_up = (Dense(L, d_model, names=(None, "embed"), rngs=rngs, dtype=dtype,
                                param_dtype=param_dtype, fp8=fp8) if spec.latent_dim else None)
        self.experts = Experts(L, E, spec.expert_dim, rngs=rngs, param_dtype=param_dtype)
        self.shared = (SwiGLU(d_model, spec.shared_dim, rngs=rngs, dtype=dtype,
                              param_dtype=param_dtype, fp8=fp8) if spec.num_shared else None)
        self.load = sharding.param(jnp.zeros((E,), jnp.float32), (None,), kind=MoeStat)
        # Scalars carry no axis names (flax's scan cannot take an axis off an empty tuple).
        self.dropped = MoeStat(jnp.zeros((), jnp.float32))
        self.balance_loss = MoeStat(jnp.zeros((), jnp.float32))

    @jax.named_scope("moe")
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        spec = self.spec
        x_BxTxD = x_BxTxD.astype(self.dtype)
        with jax.named_scope("moe_router"):
            s_BxTxE, idx_BxTxK, w_BxTxK = route(x_BxTxD, self.router.kernel[...],
                                                self.bias[...], spec, self.dtype)
        wi, wo = self.experts.wi[...], self.experts.wo[...]
        sums = self.experts.sums()
        # The routed experts' input in their width De: D, or LatentMoE's l.
        xe_BxTxDe = x_BxTxD
        if self.latent_down is not None:
            with jax.named_scope("moe_latent"):
                xe_BxTxDe = self.latent_down(x_BxTxD)
        layout = sharding.expert_layout(WI_NAMES)
        De, F = wi.shape[1], wi.shape[-1]
        if layout is None:  # no mesh in context: one device holds every expert
            matmul = "capacity" if spec.capacity_factor > 0 else choose_expert_matmul(
                spec.expert_matmul, tokens_move=False, dims=(De, F), dtype=xe_BxTxDe.dtype)
            wi, wo, sums = _place_sums(wi, wo, sums, matmul == "blocked")
            ye_BxTxDe, dropped_BxT = _routed(xe_BxTxDe, idx_BxTxK, w_BxTxK, wi, wo, sums,
                                             spec=spec, P=1, axes=(), dispatch="local",
                                             ffn_axes=(), matmul=matmul, fp8=self.fp8)
        else:
            tok, ex = layout.tokens, (layout.experts or None)
            ffn = layout.ffn or None
            P = layout.num_shards if layout.dispatch == "all_to_all" else 1
            F_l = F // math.prod(layout.mesh.shape[a] for a in layout.ffn)
            matmul = "capacity" if spec.capacity_factor > 0 else choose_expert_matmul(
                spec.expert_matmul, tokens_move=P > 1, dims=(De, F_l), dtype=xe_BxTxDe.dtype)
            # Pallas-Triton outputs carry no per-device types: the blocked kernels run without
            # shard_map's check of them (as sharding.per_device's kernels do).
            typed = matmul != "blocked"
            fn = functools.partial(_routed, spec=spec, P=P, axes=layout.experts,
                                   dispatch=layout.dispatch, ffn_axes=layout.ffn, matmul=matmul,
                                   typed=typed, fp8=self.fp8)
            tokens_3d = PartitionSpec(*tok, None)
            # In the kernels only on one device: shard_map sums a weight's gradients over the
            # devices that share it, and would sum the running sum with them.
            wi, wo, sums = _place_sums(wi, wo, sums, matmul == "blocked"
                                       and math.prod(layout.mesh.shape.values()) == 1)
            weight_specs = (PartitionSpec(ex, None, None, ffn), PartitionSpec(ex, ffn, None))
            args = (xe_BxTxDe, idx_BxTxK, w_BxTxK, wi, wo) + (() if sums is None else (sums,))
            specs = (tokens_3d, tokens_3d, tokens_3d, *weight_specs) + (
                () if sums is None else (weight_specs,))
            ye_BxTxDe, dropped_BxT = jax.shard_map(
                fn, mesh=layout.mesh, check_vma=typed, in_specs=specs,
                out_specs=(tokens_3d, tok))(*args)
        y_BxTxD = ye_BxTxDe
        if self.latent_up is not None:
            with jax.named_scope("moe_latent"):
                y_BxTxD = self.latent_up(ye_BxTxDe)
        if self.shared is not None:
            with jax.named_scope("moe_shared"):
                y_BxTxD = y_BxTxD + self.shared(x_BxTxD)
        self.load[...] = expert_load(idx_BxTxK, spec.num_experts)
        self.dropped[...] = jnp.sum(dropped_BxT)
        if spec.balance_loss_coef > 0:
            self.balance_loss[...] = spec.balance_loss_coef * sequence_balance_loss(
                s_BxTxE, idx_BxTxK)
        return y_BxTxD
