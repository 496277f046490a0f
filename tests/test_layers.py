"""Layers: each fast form against its definition, causality by gradient, caches, depth mixing."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_k3.config import REMAT_POLICIES, KdaSpec, MlaSpec
from kimi_k3.layers import GatedMLA, KDALayer, ShortConv, SwiGLU
from kimi_k3.layers import embed as embed_lib
from kimi_k3.layers import kda_layer as kda_layer_lib
from kimi_k3.layers.attention import (
    PACKED_RUNS_PER_ROW,
    _splash_attention,
    _triton_attention,
    attention,
    cache_attention,
    packed_layout,
    reference_attention,
)
from kimi_k3.layers.attn_res import DepthResidual
from kimi_k3.layers.dense import Dense, low_precision_einsum, precast, with_copies
from kimi_k3.layers.embed import chunked_nll
from kimi_k3.layers.norms import RMSNorm, _scaled_rms_norm
from kimi_k3.ops.reductions import column_sum
from pallas_kernels import depth_read as depth_read_kernel
from pallas_kernels import device
from pallas_kernels import kda as pk
from pallas_kernels import short_conv as short_conv_kernel
from pallas_kernels import swiglu as swiglu_kernel
from pallas_kernels.triton_report import as_if_on_h200
from tests.helpers import fake_device, fast_jit

D = 32


def rngs(seed=0):
    # rbg keys: the same initialisers, far less XLA compile time on CPU than threefry.
    return nnx.Rngs(jax.random.key(seed, impl="rbg"))


def normal(seed, shape, scale=1.0):
    # NumPy, not jax.random: test inputs then cost no XLA compiles.
    return jnp.asarray(scale * np.random.default_rng(seed).normal(size=shape), jnp.float32)


def packed_segments(B, T, seed=0):
    """[B, T] ids with a few documents per row, starting at random places."""
    starts = np.random.default_rng(seed).random((B, T)) < 0.25
    starts[:, 0] = False
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


# module(*args, **kwargs) under nnx.jit: one compile per shape instead of op-by-op dispatch.
apply = nnx.jit(lambda module, *args, **kwargs: module(*args, **kwargs))


def assert_causal_by_gradient(f, x_BxTxD, seg_BxT):
    """d f(x)[b, t] / d x[b', s] is zero unless b' = b, s <= t and s, t share a document;
    and the output does depend on earlier tokens of its own document.

    "Zero" allows 1e-5 of the largest dependence: the chunked KDA core's gate gradient crosses
    document boundaries at float32 rounding level (its in-chunk cumulative sum spans them; the
    terms cancel exactly in exact arithmetic). A real leak is of the order of the dependence.
    """
    B, T, _ = x_BxTxD.shape
    w = normal(99, jax.eval_shape(f, x_BxTxD).shape)
    jac = fast_jit(jax.jacrev(lambda x: jnp.sum(f(x) * w, -1)))(x_BxTxD)  # [B, T, B, T, D]
    dep = np.asarray(jnp.abs(jac).sum(-1))  # [B, T, B, T]
    seg = np.asarray(seg_BxT)
    b = np.arange(B)[:, None, None, None]
    b2 = np.arange(B)[None, None, :, None]
    t = np.arange(T)[None, :, None, None]
    s = np.arange(T)[None, None, None, :]
    same_doc = seg[:, :, None, None] == seg[None, None, :, :]
    allowed = (b == b2) & (s <= t) & same_doc
    assert dep[~allowed].max() <= 1e-5 * dep.max(), "depends on a later token or another document"
    strictly_earlier = allowed & (s < t)
    assert (dep[strictly_earlier] > 0).mean() > 0.9, "output ignores earlier tokens"


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B,T,S,H,KH,Dq,Dv,q_offset,block,segments",
    [
        (2, 21, 21, 4, 2, 8, 6, 0, 8, True),  # grouped heads, packed documents, partial blocks
        (2, 5, 20, 4, 1, 8, 4, 7, 4, False),  # multi-query decode-style: queries at positions 7..11
    ],
)
def test_blockwise_attention_equals_plain_softmax(B, T, S, H, KH, Dq, Dv, q_offset, block, segments):
    q, k, v = normal(1, (B, T, H, Dq)), normal(2, (B, S, KH, Dq)), normal(3, (B, S, KH, Dv))
    seg = packed_segments(B, T) if segments else None

    def run(impl):
        return lambda q, k, v: attention(q, k, v, segment_ids=seg, q_offset=q_offset, impl=impl,
                                         block_size=block)

    w = normal(4, (B, T, H, Dv))

    def output_and_grads(impl, q, k, v):
        loss = lambda *a: jnp.sum(run(impl)(*a) * w)
        return run(impl)(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    @fast_jit
    def outputs_and_grads(q, k, v):
        return [output_and_grads(impl, q, k, v) for impl in ("reference", "xla")]

    (o_ref, g_ref), (o_blk, g_blk) = outputs_and_grads(q, k, v)
    np.testing.assert_allclose(o_blk, o_ref, atol=2e-6)
    for a, b in zip(g_blk, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_packed_layout_lists_each_rows_documents():
    """cuDNN's packed layout from segment ids, against the runs counted in NumPy: rows with one
    document, with exactly M, with ids that come back (runs, not ids), -1 past the runs."""
    B, T, M = 5, 40, 6
    rng = np.random.default_rng()
    seg = np.cumsum(rng.random((B, T)) < 0.1, axis=1) + 1
    seg[1] = 3  # one document
    seg[2] = np.repeat(np.arange(M), -(-T // M))[:T] + 1  # exactly M
    seg[3, :] = np.where(np.arange(T) % 10 < 5, 1, 2)  # ids 1 2 1 2: four runs
    seg[4] = np.repeat(np.arange(2 * M), -(-T // (2 * M)))[:T]  # more runs than M
    lengths, offsets, runs = (np.asarray(x) for x in packed_layout(jnp.asarray(seg, jnp.int32), M))
    for b in range(B):
        starts = [0] + [t for t in range(1, T) if seg[b, t] != seg[b, t - 1]]
        assert runs[b] == len(starts)
        if len(starts) > M:
            continue  # the caller takes the mask
        ends = starts[1:] + [T]
        n = len(starts)
        np.testing.assert_array_equal(offsets[b], starts + [-1] * (M + 1 - n))
        np.testing.assert_array_equal(lengths[b], [e - a for a, e in zip(starts, ends, strict=True)]
                                      + [-1] * (M - n))
    assert lengths.shape == (B, M) and offsets.shape == (B, M + 1)


@pytest.mark.parametrize("docs", ["packed", "one_per_row"])
def test_cudnn_without_the_packed_entry_point_takes_the_mask(monkeypatch, docs):
    """Where JAX lacks the cuDNN entry point with packed offsets, packed documents go to cuDNN as
    a [B, 1, T, T] mask, and rows of one document each to its plain causal attention (jax.nn's
    entry point, faked here: CPU has no cuDNN; it answers 1 without a mask, 2 with the right
    mask, -1 with a wrong one)."""
    attn = sys.modules[attention.__module__]
    monkeypatch.setattr(attn, "cudnn_fused_attention", lambda: None)
    rows = [[1, 1, 2, 2, 2, 3, 3, 3], [4, 4, 4, 4, 5, 5, 5, 5]]
    seg = np.asarray(rows if docs == "packed" else [[3] * 8, [9] * 8], np.int32)
    same_doc = seg[:, :, None] == seg[:, None, :]

    def fake_dpa(q, k, v, mask=None, **kw):
        assert kw["is_causal"]
        if mask is None:
            return jnp.full(q.shape, 1, q.dtype)
        return jnp.full(q.shape, jnp.where(jnp.all(mask[:, 0] == same_doc), 2, -1), q.dtype)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake_dpa)
    q = normal(1, (2, 8, 2, 16))
    out = attn._cudnn_attention(q, q, q[..., :8], scale=0.25, segment_ids=jnp.asarray(seg))
    assert out.shape == (2, 8, 2, 8)
    np.testing.assert_array_equal(np.unique(np.asarray(out)), [1 if docs == "one_per_row" else 2])


@pytest.mark.parametrize("docs", ["one", "at_small_room", "past_small_room", "past_large_room",
                                  "ids_come_back"])
def test_cudnn_packed_layout_takes_the_smallest_room_that_fits(monkeypatch, docs):
    """A batch whose rows are each one document goes to cuDNN's plain causal attention; others
    to its packed layout with the smallest room of PACKED_RUNS_PER_ROW their fullest row fits
    (cuDNN's backward costs time per room), to the mask past the largest room or when ids come
    back. cuDNN is faked here: each call answers with its room (0: plain, -1: the mask)."""
    attn = sys.modules[attention.__module__]
    B, T, small, large = 3, 96, 4, 16
    monkeypatch.setattr(attn, "PACKED_RUNS_PER_ROW", (large, small))  # any order
    def fake_dpa(q, k, v, q_seqlen=None, q_offsets=None, mask=None, **kw):
        room = q_seqlen.shape[1] if q_offsets is not None else -1 if mask is not None else 0
        return jnp.full(q.shape, room, q.dtype)

    mask_types = types.SimpleNamespace(CAUSAL=0, NO_MASK=1, PADDING=2, PADDING_CAUSAL=3)
    fake = types.SimpleNamespace(MaskType=mask_types, dot_product_attention=fake_dpa)
    monkeypatch.setattr(attn, "cudnn_fused_attention", lambda: fake)
    rng = np.random.default_rng()
    docs_in_fullest_row = {"one": 1, "at_small_room": small, "past_small_room": small + 1,
                           "past_large_room": large + 1, "ids_come_back": 2}[docs]
    seg = np.ones((B, T), np.int32)
    fullest = rng.integers(B)
    starts = np.sort(rng.choice(np.arange(1, T), docs_in_fullest_row - 1, replace=False))
    seg[fullest] = np.searchsorted(starts, np.arange(T), side="right") + 1
    if docs == "ids_come_back":
        seg[fullest] = np.where(np.arange(T) < T // 2, 2, 1)
    if docs == "one":  # each row one document, with its own id
        seg = np.arange(B, dtype=np.int32)[:, None].repeat(T, 1) + 5
    want = {"one": 0, "at_small_room": small, "past_small_room": large,
            "past_large_room": -1, "ids_come_back": -1}[docs]
    q = normal(1, (B, T, 2, 16))
    out = jax.jit(lambda q, s: attn._cudnn_attention(q, q, q[..., :8], scale=0.25,
                                                     segment_ids=s))(q, jnp.asarray(seg))
    assert out.shape == (B, T, 2, 8)
    np.testing.assert_array_equal(np.unique(np.asarray(out)), [want])


@pytest.mark.parametrize("impl", ["xla", *(["cudnn"] if jax.default_backend() == "gpu" else [])])
@pytest.mark.parametrize("docs", ["few", "over_limit", "ids_come_back", "one_per_row"])
def test_attention_over_packed_documents_equals_float64(impl, docs):
    """Causal attention over packed documents in the shapes of MLA (head dims 192 / 128) against
    float64 NumPy, forward and gradients; on a GPU also cuDNN, whose packed layout takes the
    first case, whose mask takes the next two (a row with more documents than the largest
    room in PACKED_RUNS_PER_ROW; ids that come back, which runs would split) and whose plain
    causal attention takes rows of one document each."""
    B, T, H, D, Dv = 2, 256, 2, 192, 128
    dtype, tol = (jnp.bfloat16, 3e-2) if impl == "cudnn" else (jnp.float32, 1e-5)
    rng = np.random.default_rng()
    if docs == "few":
        seg = np.cumsum(rng.random((B, T)) < 0.02, axis=1) + 1
    elif docs == "over_limit":
        seg = np.cumsum(rng.random((B, T)) < 0.02, axis=1) + 1
        seg[1] = np.arange(T) // (T // (2 * max(PACKED_RUNS_PER_ROW))) + 1
    elif docs == "ids_come_back":
        seg = np.where((np.arange(T) // 40) % 2 == 0, 1, 2)[None].repeat(B, 0)
    else:
        seg = rng.integers(1, 100, size=(B, 1)).repeat(T, 1)
    q, k = (rng.normal(size=(B, T, H, D)) for _ in range(2))
    v, w = rng.normal(size=(B, T, H, Dv)), rng.normal(size=(B, T, H, Dv))
    seg_j = jnp.asarray(seg, jnp.int32)

    def loss(q, k, v):
        o = attention(q, k, v, scale=D ** -0.5, segment_ids=seg_j, impl=impl)
        return jnp.sum(o.astype(jnp.float32) * w), o

    with jax.default_matmul_precision("highest"):
        (_, o), grads = fast_jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            *(jnp.asarray(x, dtype) for x in (q, k, v)))
    # float64 reference on the inputs as the kernel saw them (rounded to its dtype).
    q64, k64, v64 = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (q, k, v))
    s = np.einsum("bthd,bshd->bhts", q64, k64) * D ** -0.5
    t = np.arange(T)
    allowed = (t[None, :, None] >= t[None, None, :]) & (seg[:, :, None] == seg[:, None, :])
    s = np.where(allowed[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o64 = np.einsum("bhts,bshv->bthv", p, v64)
    scale = np.abs(o64).max()
    np.testing.assert_allclose(np.asarray(o, np.float64), o64, atol=tol * scale)
    # Gradients: dv = P^T w; dP = w v^T; dS = P (dP - rowsum(P dP)); dq = dS k s; dk = dS^T q s.
    dv = np.einsum("bhts,bthv->bshv", p, w)
    dp = np.einsum("bthv,bshv->bhts", w, v64)
    ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
    dq = np.einsum("bhts,bshd->bthd", ds, k64) * D ** -0.5
    dk = np.einsum("bhts,bthd->bshd", ds, q64) * D ** -0.5
    for got, want in zip(grads, (dq, dk, dv), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), want,
                                   atol=tol * np.abs(want).max())


def test_splash_and_triton_kernels_in_interpret_mode_equal_plain_softmax():
    """The TPU (splash) and GPU (Triton) kernel paths, run by Pallas' interpreter on CPU."""
    B, T, H, Dq, Dv = 1, 128, 2, 24, 16
    q, k, v = normal(1, (B, T, H, Dq)), normal(2, (B, T, H, Dq)), normal(3, (B, T, H, Dv))
    seg = packed_segments(B, T, seed=3)
    ref = fast_jit(lambda q, k, v: reference_attention(
        q, k, v, scale=0.3, q_segment_ids=seg, kv_segment_ids=seg))(q, k, v)
    np.testing.assert_allclose(_splash_attention(q, k, v, scale=0.3, segment_ids=seg), ref,
                               atol=1e-5)
    np.testing.assert_allclose(
        _triton_attention(q, k, v, scale=0.3, segment_ids=seg, interpret=True), ref, atol=1e-5)


def test_attention_rejects_bad_arguments():
    q, k = normal(1, (1, 8, 2, 4)), normal(2, (1, 8, 2, 4))
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, k, impl="flash9")
    with pytest.raises(ValueError, match="k "):
        attention(q, normal(2, (1, 8, 3, 4)), normal(2, (1, 8, 3, 4)))
    with pytest.raises(ValueError, match="cudnn"):
        attention(q, k, k, segment_ids=jnp.zeros((1, 8), jnp.int32), impl="cudnn")
    from kimi_k3.dispatch import choose_cache_attention_impl
    with pytest.raises(ValueError, match="impl='cudnn' needs a GPU"):
        choose_cache_attention_impl("cudnn", dtype="bfloat16", T=128, backend="cpu")
    with pytest.raises(ValueError, match="multiple of 128 tokens; got T=100"):
        choose_cache_attention_impl("pallas", dtype="float32", T=100, backend="tpu")


# ----------------------------------------------------------------------------------------------
# KDA layer
# ----------------------------------------------------------------------------------------------


def kda_layer(gate="bounded", num_v_heads=4):
    spec = KdaSpec(num_heads=2, head_dim=8, num_v_heads=num_v_heads, conv_width=4, gate=gate,
                   lower_bound=-5.0 if gate == "bounded" else None, chunk_size=8, impl="xla")
    return KDALayer(D, spec, rngs=rngs(1))


def test_kda_layer_core_equals_recurrent_reference():
    """The chunked core inside the layer against the token-by-token recurrence, with grouped
    value heads (HV = 2 H), packed documents and the bounded gate."""
    layer = kda_layer("bounded")
    x = normal(5, (2, 19, D))
    seg = packed_segments(2, 19, seed=1)
    out_xla, _ = apply(layer, x, seg)
    layer.spec = dataclasses.replace(layer.spec, impl="recurrent")
    out_rec, _ = apply(layer, x, seg)
    np.testing.assert_allclose(out_xla, out_rec, atol=2e-5)
    assert layer.spec.lower_bound == -5.0


def test_kda_layer_passes_its_kernel_tuning(monkeypatch):
    """spec.kernel_tuning (a typed KernelTuning, the defaults unless the config overrides
    some) reaches the op's call as it is."""
    seen = []
    real = kda_layer_lib.kda
    monkeypatch.setattr(kda_layer_lib, "kda", lambda *a, **kw: seen.append(kw["tuning"])
                        or real(*a, **kw))
    layer = kda_layer()
    x = normal(6, (1, 9, D))
    apply(layer, x, None)
    layer.spec = dataclasses.replace(layer.spec, kernel_tuning=pk.KernelTuning(hopper=0, bk=16))
    apply(layer, x, None)
    assert seen == [pk.KernelTuning(), pk.KernelTuning(hopper=0, bk=16)]


def test_kda_layer_writes_the_convolutions_before_the_norms_read_them():
    """An optimisation barrier separates the short convolutions from the SiLU and q/k norms:
    without it XLA fused the convolutions into the norms' row reduction on the GPU, one slow
    kernel per layer of the unrolled 1B step. Each of q, k and v has its own (the XLA form of
    ShortConv's activation)."""
    layer = kda_layer("bounded")
    x = normal(6, (1, 11, D))
    graph, state = nnx.split(layer)
    jaxpr = jax.make_jaxpr(lambda state, x: nnx.merge(graph, state)(x, None)[0])(state, x)

    def barriers(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "optimization_barrier":
                yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from barriers(sub)

    found = list(barriers(jaxpr.jaxpr))
    assert len(found) == 3 and all(len(eqn.invars) == 1 for eqn in found), jaxpr


def test_kda_layer_gate_in_kernel_equals_gate_before_the_op():
    """kda.gate_in_kernel moves the decay gate into the op: the same outputs and gradients (the
    op's own tests cover both gate forms and the kernel; this is the layer's wiring)."""
    layer = kda_layer("bounded")
    layer.spec = dataclasses.replace(layer.spec, impl="recurrent")  # the fastest to compile
    x = normal(int(np.random.default_rng().integers(1 << 20)), (1, 11, D))
    seg = packed_segments(1, 11, seed=2)

    @nnx.jit
    def out_and_grads(layer):
        loss = lambda m: jnp.sum(jnp.sin(m(x, seg)[0]))
        return layer(x, seg)[0], nnx.grad(loss)(layer)

    want, g_want = out_and_grads(layer)
    layer.spec = dataclasses.replace(layer.spec, gate_in_kernel=True)
    got, g_got = out_and_grads(layer)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_got), nnx.to_flat_state(g_want),
                                 strict=True):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=1e-5, err_msg=str(path))


def test_kda_layer_is_causal_by_gradient_across_documents():
    """Chunked core, softplus (unbounded) gate."""
    layer = kda_layer("softplus")
    assert layer.spec.lower_bound is None
    A = np.exp(np.asarray(layer.A_log[...]))
    assert ((A >= 1) & (A <= 16)).all()
    x = normal(6, (2, 12, D))
    seg = packed_segments(2, 12, seed=2)
    assert_causal_by_gradient(lambda x: layer(x, seg)[0], x, seg)


def test_kda_layer_prefill_in_pieces_equals_one_pass():
    layer = kda_layer()
    x = normal(7, (2, 13, D))
    one, _ = apply(layer, x)
    cache = layer.init_cache(2, 13)
    outs = []
    for a, b in ((0, 6), (6, 7), (7, 13)):  # a piece shorter than the conv width too
        o, cache = apply(layer, x[:, a:b], cache=cache)
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), one, atol=2e-5)
    assert cache["state"].shape == (2, 4, 8, 8) and cache["state"].dtype == jnp.float32
    assert cache["conv_q"].shape == (2, 3, 2, 8)


def test_short_conv_matches_direct_convolution_and_masks_documents():
    conv = ShortConv((3,), 4, names=(None,), rngs=rngs(2))
    x = normal(8, (1, 9, 3))
    w = np.asarray(conv.weight[...])
    xn = np.asarray(x)[0]
    want = np.stack([sum(w[3 - lag] * xn[t - lag] for lag in range(4) if t - lag >= 0)
                     for t in range(9)])
    y, tail = conv(x)
    np.testing.assert_allclose(y[0], want, atol=1e-6)
    np.testing.assert_array_equal(tail, x[:, -3:])
    seg = jnp.array([[0, 0, 0, 0, 0, 1, 1, 1, 1]])
    y_seg, _ = conv(x, seg)
    y_doc2, _ = conv(x[:, 5:])
    np.testing.assert_allclose(y_seg[:, 5:], y_doc2, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_short_conv_gradients_equal_float64(impl):
    """The convolution's own backward pass (input, weight, tail) against float64 NumPy, with
    channels [H, K], packed documents and a tail: y_t = sum_lag [same doc] w[W-1-lag] x_{t-lag}.
    ``impl`` "pallas" runs pallas_kernels/short_conv.py's kernels (interpret mode here)."""
    B, T, H, K, W = 2, 41, 2, 3, 4
    rng = np.random.default_rng()
    conv = ShortConv((H, K), W, names=(None, None), rngs=rngs(int(rng.integers(1 << 20))),
                     impl=impl)
    w = np.asarray(conv.weight[...], np.float64)
    x, tail = rng.normal(size=(B, T, H, K)), rng.normal(size=(B, W - 1, H, K))
    dy = rng.normal(size=(B, T, H, K))
    seg = np.cumsum(rng.random((B, T)) < 0.3, axis=1)
    graphdef, state = nnx.split(conv)

    def loss(x, tail, wt):
        m = nnx.merge(graphdef, jax.tree.map(lambda _: wt, state))
        y, _ = m(x, jnp.asarray(seg, jnp.int32), tail)
        return jnp.sum(y * dy)

    got = fast_jit(jax.grad(loss, argnums=(0, 1, 2)))(
        *(jnp.asarray(a, jnp.float32) for a in (x, tail, w)))
    # NumPy on [B, T, H K] views (the tail belongs to each row's first document)
    flat = lambda a: a.reshape(*a.shape[:-2], H * K)
    _, (dx, _), (dtail, _), (dw, _) = _conv_float64(flat(x), flat(tail), flat(w), seg, flat(dy))
    for g, want in zip(got, (dx, dtail, dw), strict=True):
        np.testing.assert_allclose(flat(np.asarray(g)), want, atol=1e-5 * np.abs(want).max())


def _conv_float64(x, tail, w, seg, dy):
    """y, dx, dtail, dw of the causal depthwise convolution in float64 from the equations
    (x_ext = [tail, x]; tap W-1-lag reads x_ext row t + W-1-lag when it is in token t's
    document, the tail counting as the first token's), and bounds: sums of |terms|."""
    (B, T, C), W = x.shape, w.shape[0]
    x_ext = np.concatenate([tail, x], axis=1)
    seg_ext = np.concatenate([np.repeat(seg[:, :1], W - 1, axis=1), seg], axis=1)
    y, y_abs = np.zeros((B, T, C)), np.zeros((B, T, C))
    dx_ext, dx_abs = np.zeros_like(x_ext), np.zeros_like(x_ext)
    dw, dw_abs = np.zeros((W, C)), np.zeros((W, C))
    for lag in range(W):
        rows = np.arange(T) + W - 1 - lag
        same = (seg_ext[:, rows] == seg)[..., None]
        term = np.where(same, x_ext[:, rows] * w[W - 1 - lag], 0.0)
        y, y_abs = y + term, y_abs + np.abs(term)
        back = np.where(same, dy * w[W - 1 - lag], 0.0)
        for b in range(B):
            np.add.at(dx_ext[b], rows, back[b])
            np.add.at(dx_abs[b], rows, np.abs(back[b]))
        prod = np.where(same, x_ext[:, rows] * dy, 0.0)
        dw[W - 1 - lag], dw_abs[W - 1 - lag] = prod.sum((0, 1)), np.abs(prod).sum((0, 1))
    return ((y, y_abs), (dx_ext[:, W - 1:], dx_abs[:, W - 1:]),
            (dx_ext[:, :W - 1], dx_abs[:, :W - 1]), (dw, dw_abs))


@pytest.mark.parametrize("B,T,C,W,dtype", [
    (2, 300, 200, 4, jnp.bfloat16),  # rows and channels that are not whole tiles
    (1, 37, 16, 3, jnp.float32),     # a width whose weight-gradient rows are padded
    (3, 130, 128, 4, jnp.float32),
    (2, 2, 8, 4, jnp.bfloat16),      # fewer tokens than the tail: the tail reaches every token
    (2, 21, 24, 4, jnp.float32),     # fewer tokens than a program's 32 rows (a short prefill)
    (1, 33, 24, 4, jnp.float32),     # a second program whose W-1 rows ahead pass the end
])
@pytest.mark.parametrize("form", ["windows", "rows"])
def test_conv_kernels_equal_float64(B, T, C, W, dtype, form):
    """pallas_kernels.short_conv's forward and backward kernels (interpret mode here) and the
    tail's gradient against float64 NumPy: many short documents, a random tail, channels of
    very different magnitudes. y and dx (in x's dtype) within W roundings of the sum of their
    terms' magnitudes; the float32 weight and tail gradients within 1e-6 of theirs."""
    rng = np.random.default_rng()
    # The row form: 8 rows per program keeps interpret mode quick; the forward loops over
    # them 4 at a time, the backward unrolls all 8.
    tiles = {} if form == "windows" else dict(
        fwd=short_conv_kernel.ConvTiles(8, 64, 1, "rows", unroll=4),
        bwd=short_conv_kernel.ConvTiles(8, 64, 1, "rows"))
    _check_conv_kernels(np.cumsum(rng.random((B, T)) < 0.1, axis=1).astype(np.int32), C, W,
                        dtype, rng, **tiles)


def test_conv_kernels_with_documents_starting_at_tile_edges():
    """Documents that start at a program's first row, just before and just after it, and W-1
    rows before the next program (R = 32 rows per program): the windows of interior programs,
    read as contiguous slices, cross those starts and must mask them as the gathers do."""
    rng = np.random.default_rng()
    R, T = short_conv_kernel.DEFAULT_TILES.rows, 200
    starts = [[R - 1, R + 1, 2 * R, 3 * R - 3, 3 * R + 2, 5 * R], [2, R, 2 * R - 1, 4 * R + 3]]
    seg = np.stack([np.searchsorted(np.asarray(s), np.arange(T), side="right") for s in starts])
    _check_conv_kernels(seg.astype(np.int32), 48, 4, jnp.float32, rng)
    rows = short_conv_kernel.ConvTiles(R, 32, 1, "rows")  # the row form's first/last rows
    _check_conv_kernels(seg.astype(np.int32), 48, 4, jnp.float32, rng, fwd=rows, bwd=rows)


def _check_conv_kernels(seg, C: int, W: int, dtype, rng, fwd=None, bwd=None):
    """The kernels' y, dx, dw and the tail's gradient against float64 for segment ids
    seg [B, T]: inputs whose channels differ in magnitude by up to e^8 either way, a random
    tail; see test_conv_kernels_equal_float64."""
    B, T = seg.shape
    scale = np.exp(rng.uniform(-8, 8, size=(1, 1, C)))
    x = np.asarray(jnp.asarray(rng.normal(size=(B, T, C)) * scale, dtype), np.float64)
    tail = np.asarray(jnp.asarray(rng.normal(size=(B, W - 1, C)) * scale, dtype), np.float64)
    dy = np.asarray(jnp.asarray(rng.normal(size=(B, T, C)), dtype), np.float64)
    w = rng.normal(size=(W, C)).astype(np.float32).astype(np.float64)
    args = [jnp.asarray(a, dtype) for a in (x, tail)] + [jnp.asarray(w, jnp.float32),
                                                         jnp.asarray(seg)]
    y = short_conv_kernel.conv_forward(*args, **({"tiles": fwd} if fwd else {}))
    dx, dw = short_conv_kernel.conv_backward(*args, jnp.asarray(dy, dtype),
                                             **({"tiles": bwd} if bwd else {}))
    dtail = short_conv_kernel.tail_grad(args[2], args[3], jnp.asarray(dy, dtype))
    assert y.dtype == dx.dtype == dtype and dw.dtype == dtail.dtype == jnp.float32
    rounding = W * float(jnp.finfo(dtype).eps)  # W products and sums, or the output's rounding
    for name, got, (want, bound), rel in (("y", y, (ys := _conv_float64(x, tail, w, seg, dy))[0],
                                           rounding), ("dx", dx, ys[1], rounding),
                                          ("dtail", dtail, ys[2], 1e-6), ("dw", dw, ys[3], 1e-6)):
        err = np.abs(np.asarray(got, np.float64) - want)
        assert np.all(err <= rel * bound + 1e-30), (name, float(np.max(err / (bound + 1e-30))))


def _activation_float64(z, dy, activation: str, group: int):
    """(y, dL/dz) of the activation after the convolution, float64 from the equations:
    s = z sigmoid(z); "silu_l2": y = s / sqrt(sum_group s^2 + eps), else y = s."""
    sig = 1.0 / (1.0 + np.exp(-z))
    s, ds_dz = z * sig, sig * (1.0 + z * (1.0 - sig))
    if activation == "silu":
        return s, dy * ds_dz
    shape = (*z.shape[:-1], z.shape[-1] // group, group)
    s_g, dy_g = s.reshape(shape), dy.reshape(shape)
    r = 1.0 / np.sqrt(np.sum(s_g * s_g, axis=-1, keepdims=True) + 1e-6)
    y_g = s_g * r
    ds = r * (dy_g - y_g * np.sum(y_g * dy_g, axis=-1, keepdims=True))
    return y_g.reshape(z.shape), ds.reshape(z.shape) * ds_dz


@pytest.mark.parametrize("activation", ["silu", "silu_l2"])
@pytest.mark.parametrize("B,T,C,W,R,unroll", [(2, 70, 96, 4, 16, 4), (1, 2, 64, 4, 8, 0),
                                               (2, 37, 64, 3, 8, 0)])
def test_conv_kernels_with_the_activation_equal_float64(activation, B, T, C, W, R, unroll):
    """The row form with KDA's activation inside (interpret mode): y = SiLU(z) (v), or
    SiLU(z) / ||SiLU(z)|| per head of 32 channels (q, k), and dx, dw and the tail's gradient
    through it, against float64; z spans e^-4..e^4 across channels (saturated sigmoids) and
    documents are short."""
    rng = np.random.default_rng()
    group = 32
    scale = np.exp(rng.uniform(-4, 4, size=(1, 1, C)))
    x = rng.normal(size=(B, T, C)) * scale
    tail = rng.normal(size=(B, W - 1, C)) * scale
    dy, w = rng.normal(size=(B, T, C)), rng.normal(size=(W, C))
    seg = np.cumsum(rng.random((B, T)) < 0.1, axis=1).astype(np.int32)
    (z, _), *_ = _conv_float64(x, tail, w, seg, dy)
    y_want, dz = _activation_float64(z, dy, activation, group)
    _, (dx_want, _), (dtail_want, _), (dw_want, _) = _conv_float64(x, tail, w, seg, dz)
    f = jnp.float32
    tiles = short_conv_kernel.ConvTiles(R, 32, 1, "rows", unroll)  # R rows, a loop of unroll
    act = dict(activation=activation, group=group)
    args = (jnp.asarray(x, f), jnp.asarray(tail, f), jnp.asarray(w, f), jnp.asarray(seg))
    y = short_conv_kernel.conv_forward(*args, tiles=tiles, **act)
    dx, dw = short_conv_kernel.conv_backward(*args, jnp.asarray(dy, f), tiles=tiles, **act)
    dtail = short_conv_kernel.tail_grad(args[2], args[3], jnp.asarray(dy, f), x_BxTxC=args[0],
                                        tail_BxWm1xC=args[1], **act)
    for name, got, want in (("y", y, y_want), ("dx", dx, dx_want), ("dw", dw, dw_want),
                            ("dtail", dtail, dtail_want)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, err_msg=name,
                                   atol=2e-5 * np.abs(want).max(), rtol=1e-4)


@pytest.mark.parametrize("activation", ["silu", "silu_l2"])
def test_short_conv_with_the_activation_in_the_kernels_equals_xla(activation):
    """ShortConv(impl="pallas") with the activation inside its kernels against the convolution
    followed by XLA's activation: outputs and the gradients of x and the tail (the weight's is
    the kernel test's), with packed documents; a head dim that is not a power of two keeps
    XLA's activation."""
    rng = np.random.default_rng()
    B, T, W = 2, 21, 4
    for H, K in ((2, 16), (3, 6)):
        seed = int(rng.integers(1 << 20))
        convs = {impl: ShortConv((H, K), W, names=(None, None), rngs=rngs(seed), impl=impl)
                 for impl in ("xla", "pallas")}
        x, tail = normal(int(rng.integers(1 << 20)), (B, T, H, K)), normal(3, (B, W - 1, H, K))
        dy = normal(int(rng.integers(1 << 20)), (B, T, H, K))
        seg = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.2, axis=1), jnp.int32)
        outs = {}
        for impl, conv in convs.items():
            def loss(x, tail, conv=conv, seg=seg, dy=dy):
                y, _ = conv(x, seg, tail, activation=activation)
                return jnp.sum(y * dy), y
            # Jitted: eagerly, each op (and each interpreted kernel) compiles on its own.
            outs[impl] = fast_jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(x, tail)
        (g_xla, y_xla), (g_pal, y_pal) = outs["xla"], outs["pallas"]
        np.testing.assert_allclose(y_pal, y_xla, atol=2e-6)
        for a, b in zip(g_pal, g_xla, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5 * float(jnp.abs(b).max()))


def _bf16(a):
    """a rounded to bf16, as float64."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def test_dense_weight_gradient_is_a_float32_sum_never_rounded_to_bf16():
    """Dense with float32 parameters and bf16 compute (``low_precision_einsum``): y and dx in
    bf16 from bf16 operands, and dW = x^T dy summed in float32 and returned in float32, against
    float64 NumPy from bf16-exact operands. Rounding dW to bf16 (what autodiff of
    ``w.astype(bf16)`` does) misses dW's tolerance ~100-fold. Leading axes [3, 7] are summed;
    the kernel maps D -> (H, K); magnitudes span e^-3..e^3 across input channels."""
    rng = np.random.default_rng()
    D, H, K = 24, 3, 10
    x = _bf16(rng.normal(size=(3, 7, D)) * np.exp(rng.uniform(-3, 3, size=D)))
    w = rng.normal(size=(D, H, K)) / np.sqrt(D)  # float32 parameter, not bf16-exact
    dy = _bf16(rng.normal(size=(3, 7, H, K)))
    layer = Dense(D, (H, K), names=(None, None, None), rngs=rngs(int(rng.integers(1 << 20))),
                  dtype=jnp.bfloat16)
    layer.kernel[...] = jnp.asarray(w, jnp.float32)
    w_lo = _bf16(np.asarray(layer.kernel[...]))

    def f(x, kernel):
        return low_precision_einsum(1, 2, jnp.bfloat16, x, kernel)

    y, vjp = jax.vjp(f, jnp.asarray(x, jnp.float32), layer.kernel[...])
    dx, dw = vjp(jnp.asarray(dy, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and dx.dtype == dw.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(layer(jnp.asarray(x, jnp.float32)), np.float32),
                                  np.asarray(y, np.float32))
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for name, got, want, bound, tol in (
            ("y", y, np.einsum("btd,dhk->bthk", x, w_lo),
             np.einsum("btd,dhk->bthk", np.abs(x), np.abs(w_lo)), eps),
            ("dx", dx, np.einsum("bthk,dhk->btd", dy, w_lo),
             np.einsum("bthk,dhk->btd", np.abs(dy), np.abs(w_lo)), eps),
            ("dw", dw, np.einsum("btd,bthk->dhk", x, dy),
             np.einsum("btd,bthk->dhk", np.abs(x), np.abs(dy)), 1e-6)):
        err = np.abs(np.asarray(got, np.float64) - want)
        assert np.all(err <= tol * bound), (name, float(np.max(err / bound)))
    # The same gradient through the layer; a float32 layer takes the plain product.
    g = jax.grad(lambda k: jnp.sum(f(jnp.asarray(x, jnp.float32), k).astype(jnp.float32)
                                   * jnp.asarray(dy, jnp.float32)))(layer.kernel[...])
    np.testing.assert_array_equal(np.asarray(g), np.asarray(dw))
    layer32 = Dense(D, (H, K), names=(None, None, None), rngs=rngs(), dtype=jnp.float32)
    text = str(jax.make_jaxpr(lambda x: layer32(x))(jnp.asarray(x, jnp.float32)))
    assert "custom_vjp" not in text, text


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_head_weight_gradient_is_float32_and_precast_changes_nothing(tied):
    """The output head (tied: h E^T / sqrt(D); untied: h W) with float32 parameters and bf16
    compute: float32 logits, dh in bf16, and the weight's gradient summed and returned in
    float32, against float64 NumPy from bf16-exact operands (rounded to bf16 it misses ~100x).
    With the weights precast (``dense.precast``, as the training step passes them) a Dense and
    the head give the same outputs and the same float32 gradients bit for bit."""
    rng = np.random.default_rng()
    V, D = 40, 24
    h = _bf16(rng.normal(size=(2, 9, D)) * np.exp(rng.uniform(-3, 3, size=D)))
    g = _bf16(rng.normal(size=(2, 9, V)))  # the logits' cotangent, bf16-exact
    key = int(rng.integers(1 << 20))
    head = (embed_lib.Embed(V, D, rngs=rngs(key), dtype=jnp.bfloat16) if tied
            else embed_lib.OutputHead(D, V, rngs=rngs(key), dtype=jnp.bfloat16))
    proj = Dense(D, (3, 5), names=(None, None, None), rngs=rngs(key + 1), dtype=jnp.bfloat16)
    graph, params, rest = nnx.split(nnx.Dict(head=head, proj=proj), nnx.Param, ...)
    params = nnx.to_pure_dict(params)

    def loss(params, copies):
        if copies is not None:
            params = with_copies(params, copies)
        model = nnx.merge(graph, nnx.State(params), rest)
        logits = (model["head"].attend if tied else model["head"])(jnp.asarray(h, jnp.float32))
        y = model["proj"](jnp.asarray(h, jnp.float32))
        return (jnp.sum(logits * jnp.asarray(g, jnp.float32))
                + jnp.sum(y.astype(jnp.float32) ** 2)), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params, None)
    (_, logits_pc), grads_pc = jax.value_and_grad(loss, has_aux=True)(
        params, precast(params, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_pc))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_pc), strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    name = "embedding" if tied else "proj"
    w = params["head"][name] if tied else params["head"]["proj"]["kernel"]
    dw = grads["head"][name] if tied else grads["head"]["proj"]["kernel"]
    w_lo = _bf16(np.asarray(w))
    eq, scale = ("btd,vd->btv", D ** -0.5) if tied else ("btd,dv->btv", 1.0)
    want = np.einsum(eq, h, w_lo) * scale
    bound = np.einsum(eq, np.abs(h), np.abs(w_lo)) * scale
    assert logits.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(logits, np.float64) - want) <= 1e-6 * bound + 1e-30)
    # dW = h^T (g * scale), g * scale rounded to bf16 first as the backward pass does.
    g_lo = _bf16(g * scale)
    w_eq = "btd,btv->vd" if tied else "btd,btv->dv"
    want_dw = np.einsum(w_eq, h, g_lo)
    bound_dw = np.einsum(w_eq, np.abs(h), np.abs(g_lo))
    err = np.abs(np.asarray(dw, np.float64) - want_dw)
    assert np.all(err <= 1e-6 * bound_dw), float(np.max(err / bound_dw))
    assert np.max(np.abs(_bf16(want_dw) - want_dw) / bound_dw) > 10e-6  # bf16 would miss it


def test_dense_weight_gradient_keeps_the_remat_policies():
    """Under remat "dots_kernels" the custom-gradient product is still a saved matmul: the
    gradient of a checkpointed Dense runs 3 products (y, dx, dW), as autodiff's own does, and
    under full remat 4 (y again)."""
    layer = Dense(16, 8, names=(None, None), rngs=rngs(), dtype=jnp.bfloat16)
    graph, state = nnx.split(layer)
    x = normal(1, (2, 5, 16))

    def loss(state, x):
        return jnp.sum(jnp.sin(nnx.merge(graph, state)(jnp.tanh(x)).astype(jnp.float32)))

    for remat, dots in (("dots_kernels", 3), ("full", 4)):
        fn = jax.checkpoint(loss, policy=REMAT_POLICIES[remat])
        text = str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(state, x))
        assert text.count("dot_general") == dots, (remat, text)


def test_conv_kernels_lower_for_the_gpu_and_name_bad_shapes():
    """Both kernels lower to Triton from this CPU at the 1B step's shapes (a [4, 4096, 2048]
    bf16 tensor: what sizes and block shapes Triton refuses shows here, without a device); a
    tail or weight of the wrong shape is refused by name."""
    assert device.pallas_triton() is not None
    B, T, C, W = 4, 4096, 2048, 4
    x = jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16)
    tail = jax.ShapeDtypeStruct((B, W - 1, C), jnp.bfloat16)
    w, seg = jax.ShapeDtypeStruct((W, C), jnp.float32), jax.ShapeDtypeStruct((B, T), jnp.int32)
    # The windows form; the row form with KDA's q/k activation (heads of 128), as the 1B
    # layer calls it.
    act = {"tiles": short_conv_kernel.DEFAULT_ACT_TILES, "activation": "silu_l2", "group": 128}
    for tiles in ({}, act):
        fwd = jax.jit(functools.partial(short_conv_kernel.conv_forward, interpret=False, **tiles))
        bwd = jax.jit(functools.partial(short_conv_kernel.conv_backward, interpret=False,
                                        **tiles))
        for fn, args in ((fwd, (x, tail, w, seg)), (bwd, (x, tail, w, seg, x))):
            with as_if_on_h200():  # newer JAX: the card Triton kernels are for
                text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]
    with pytest.raises(ValueError, match=r"ConvTiles.form must be 'windows' or 'rows', got 'row'"):
        short_conv_kernel.ConvTiles(form="row")
    xs = jnp.zeros((1, 8, 4))
    with pytest.raises(ValueError, match=r"conv_forward: tail must have shape \(1, 3, 4\).*"
                                         r"got \(1, 2, 4\)"):
        short_conv_kernel.conv_forward(xs, jnp.zeros((1, 2, 4)), jnp.zeros((4, 4)),
                                       jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"conv_forward: width must be >= 2 .* got 1"):
        short_conv_kernel.conv_forward(xs, jnp.zeros((1, 0, 4)), jnp.zeros((1, 4)),
                                       jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"conv_backward: dy must have x's shape"):
        short_conv_kernel.conv_backward(xs, jnp.zeros((1, 3, 4)), jnp.zeros((4, 4)),
                                        jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 7, 4)))


# ----------------------------------------------------------------------------------------------
# the SwiGLU activation's backward kernel


def _swiglu_bwd_float64(h, dy):
    """(dh, a bound on each element's rounding scale) from the equations in float64:
    y = g sigmoid(g) u, dg = dy u (s + g s (1 - s)), du = dy g s."""
    g, u = h[:, 0], h[:, 1]
    s = 1.0 / (1.0 + np.exp(-g))
    dg = dy * u * (s + g * s * (1.0 - s))
    du = dy * g * s
    scale_g = np.abs(dy * u) * (s + np.abs(g) * s * (1.0 - s))
    return np.stack([dg, du], axis=1), np.stack([scale_g, np.abs(du)], axis=1)


@pytest.mark.parametrize("N,F,dtype", [
    (37, 48, jnp.float32),      # rows not whole tiles (padded), a column tile of 16
    (64, 768, jnp.bfloat16),    # column tiles of 256, three per half
    (16, 5632, jnp.bfloat16),   # configs/1b.py's width
])
def test_swiglu_backward_kernel_equals_float64(N, F, dtype):
    """pallas_kernels.swiglu's kernel (interpret mode here) against float64 NumPy: gate
    pre-activations from -60 to 60 (a saturated sigmoid both ways), up and dy of very different
    magnitudes per column; each element within a few roundings of its terms' magnitude."""
    rng = np.random.default_rng()
    g = rng.normal(size=(N, F)) * np.exp(rng.uniform(-3, 4, size=(1, F)))
    g[0, :4] = [-60.0, 60.0, 0.0, -1e-3][: min(4, F)]
    u = rng.normal(size=(N, F)) * np.exp(rng.uniform(-8, 8, size=(1, F)))
    h = np.asarray(jnp.asarray(np.stack([g, u], axis=1), dtype), np.float64)
    dy = np.asarray(jnp.asarray(rng.normal(size=(N, F)), dtype), np.float64)
    dh = swiglu_kernel.swiglu_backward(jnp.asarray(h, dtype), jnp.asarray(dy, dtype))
    assert dh.shape == (N, 2, F) and dh.dtype == dtype
    want, bound = _swiglu_bwd_float64(h, dy)
    err = np.abs(np.asarray(dh, np.float64) - want)
    rel = 4 * float(jnp.finfo(dtype).eps)
    assert np.all(err <= rel * bound + 1e-30), float(np.max(err / (bound + 1e-30)))
    # The forward the kernel differentiates is the layer's.
    y = swiglu_kernel.swiglu_reference(jnp.asarray(h, dtype))
    y64 = h[:, 0] / (1.0 + np.exp(-h[:, 0])) * h[:, 1]
    assert np.all(np.abs(np.asarray(y, np.float64) - y64) <= rel * np.abs(y64) + 1e-30)


def test_swiglu_kernel_lowers_for_the_gpu_and_names_bad_shapes():
    """The kernel lowers to Triton from this CPU at configs/1b.py's micro-batch (16K tokens,
    F = 5632, bf16); wrong shapes are refused by name; a width with no tile has none."""
    assert device.pallas_triton() is not None
    h = jax.ShapeDtypeStruct((4 * 4096, 2, 5632), jnp.bfloat16)
    dy = jax.ShapeDtypeStruct((4 * 4096, 5632), jnp.bfloat16)
    fn = jax.jit(lambda h, dy: swiglu_kernel.swiglu_backward(h, dy, interpret=False))
    with as_if_on_h200():  # newer JAX: the card Triton kernels are for
        text = fn.trace(h, dy).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]
    assert swiglu_kernel.columns_for(5632) == 256 and swiglu_kernel.columns_for(40) is None
    with pytest.raises(ValueError, match=r"h must have shape \[N, 2, F\], got \(4, 3, 16\)"):
        swiglu_kernel.swiglu_backward(jnp.zeros((4, 3, 16)), jnp.zeros((4, 16)))
    with pytest.raises(ValueError, match=r"dy must have shape \(4, 16\).*got \(4, 8\)"):
        swiglu_kernel.swiglu_backward(jnp.zeros((4, 2, 16)), jnp.zeros((4, 8)))
    with pytest.raises(ValueError, match=r"multiple of 16, got 40"):
        swiglu_kernel.swiglu_backward(jnp.zeros((4, 2, 40)), jnp.zeros((4, 40)))
    with pytest.raises(ValueError, match=r"impl must be 'xla' or 'pallas', got 'triton'"):
        SwiGLU(8, 16, rngs=rngs(), impl="triton")


@pytest.mark.parametrize("F", [48, 40])  # 40: no column tile, the layer keeps XLA's form
def test_swiglu_layer_kernel_gradients_equal_xla(F):
    """The layer with impl="pallas" (the kernel's backward, interpret mode) against "xla":
    the same output, and the same gradients of x and of both weights, in float32."""
    D, B, T = 24, 2, 9
    seed = int(np.random.default_rng().integers(1 << 30))
    layers = {impl: SwiGLU(D, F, rngs=rngs(seed), impl=impl) for impl in ("xla", "pallas")}
    x = normal(seed + 1, (B, T, D), scale=2.0)
    dy = normal(seed + 2, (B, T, D))
    out = {}
    for impl, layer in layers.items():
        graphdef, params = nnx.split(layer, nnx.Param)

        def loss(params, x, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, params)(x) * dy)

        out[impl] = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    (v_x, (gp_x, gx_x)), (v_p, (gp_p, gx_p)) = out["xla"], out["pallas"]
    np.testing.assert_allclose(v_p, v_x, rtol=1e-6)
    # Against each gradient's largest element: the weight gradients are sums over tokens that
    # can nearly cancel, so float32 roundings of the activation's derivative (the kernel takes
    # 1 - s as sigmoid(-g)) show at 1e-4 relative in an element far below the rest.
    for a, b in zip(jax.tree.leaves((gp_p, gx_p)), jax.tree.leaves((gp_x, gx_x)), strict=True):
        err = float(jnp.max(jnp.abs(a - b)))
        assert err <= 2e-5 * float(jnp.max(jnp.abs(b))), (err, float(jnp.max(jnp.abs(b))))
    # The kernel is in the gradient's program exactly when the width has a tile.
    graphdef, params = nnx.split(layers["pallas"], nnx.Param)
    grad = jax.grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) * dy), argnums=1)
    n_kernels = str(jax.make_jaxpr(grad)(params, x)).count("pallas_call")
    assert n_kernels == (1 if swiglu_kernel.columns_for(F) else 0)


# ----------------------------------------------------------------------------------------------
# norms and column sums
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("R,group", [(1, 64), (63, 64), (64, 64), (65, 64), (1000, 64), (37, 5)])
def test_column_sum_equals_float64(R, group):
    """Both stages (rows in groups, the last one padded; then the partial sums) against NumPy,
    with rows of very different magnitudes."""
    rng = np.random.default_rng()
    x = rng.normal(size=(R, 7)) * np.exp(rng.uniform(-20, 20, size=(R, 1)))
    got = jax.jit(lambda a: column_sum(a, group))(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, x.sum(0), rtol=0, atol=1e-6 * np.abs(x).sum(0).max())


def test_column_sum_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"\[rows, channels\].*\(2, 3, 4\)"):
        column_sum(jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="group must be >= 1, got 0"):
        column_sum(jnp.zeros((2, 3)), 0)


@pytest.mark.parametrize("shape", [(3, 37, 16), (2, 45, 3, 8)], ids=["width", "per_head"])
def test_rms_norm_and_its_gradients_equal_float64(shape):
    """RMSNorm's own backward pass against float64 NumPy: y = x r w, r = (mean x^2 + eps)^-1/2;
    dx = r (g - x r mean(g x r)) with g = dy w, dw = sum over tokens of dy x r."""
    rng = np.random.default_rng()
    x = rng.normal(size=shape) * np.exp(rng.uniform(-3, 3, size=(*shape[:-1], 1)))
    w = rng.normal(size=shape[-1:])
    dy = rng.normal(size=shape)
    norm = RMSNorm(shape[-1], eps=1e-6)
    graphdef, state = nnx.split(norm)

    def loss(x, wt):
        m = nnx.merge(graphdef, jax.tree.map(lambda _: wt, state))
        y = m(x)
        return jnp.sum(y * dy), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    r = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    g = dy * w
    want = (x * r * w, r * (g - x * r * np.mean(g * x * r, -1, keepdims=True)),
            (dy * x * r).reshape(-1, shape[-1]).sum(0))
    for got, ref in zip((y, dx, dw), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_cache_attention_without_the_float32_lse_entry_point_takes_xla_or_says_why(monkeypatch):
    from kimi_k3 import dispatch
    assert dispatch.choose_cache_attention_impl("auto", dtype="bfloat16", T=256,
                                                backend="gpu") == "cudnn"
    fake_device(monkeypatch, "gpu", cudnn_lse=False)  # a JAX without that entry point
    assert dispatch.choose_cache_attention_impl("auto", dtype="bfloat16", T=256,
                                                backend="gpu") == "xla"
    with pytest.raises(ValueError, match="log-sum-exp in float32, absent in JAX"):
        dispatch.choose_cache_attention_impl("cudnn", dtype="bfloat16", T=256, backend="gpu")


# ----------------------------------------------------------------------------------------------
# Gated MLA
# ----------------------------------------------------------------------------------------------


def mla_layer(q_lora_rank=0, impl="xla", block=8):
    spec = MlaSpec(num_heads=2, q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=8,
                   shared_head_dim=4, v_head_dim=6, output_gate=True, attn_impl=impl,
                   attn_block_size=block)
    return GatedMLA(D, spec, rngs=rngs(3))


def test_mla_blockwise_path_equals_plain_softmax():
    layer = mla_layer(q_lora_rank=10)
    x = normal(9, (2, 20, D))
    seg = packed_segments(2, 20, seed=4)
    blockwise, _ = apply(layer, x, seg)
    layer.spec = dataclasses.replace(layer.spec, attn_impl="reference")
    plain, _ = apply(layer, x, seg)
    np.testing.assert_allclose(blockwise, plain, atol=2e-5)


def test_mla_is_causal_by_gradient_across_documents():
    layer = mla_layer(block=4)
    x = normal(10, (2, 12, D))
    seg = packed_segments(2, 12, seed=5)
    assert_causal_by_gradient(lambda x: layer(x, seg)[0], x, seg)


def test_mla_latent_cache_in_pieces_equals_one_pass():
    """Absorbed attention over the latent cache == the expanded training path."""
    layer = mla_layer(q_lora_rank=10, block=4)
    x = normal(11, (2, 9, D))
    with jax.default_matmul_precision("highest"):  # GPU: float32 dots, not TF32
        one, _ = apply(layer, x)
        cache = layer.init_cache(2, 16)
        assert cache["latent_kv"].shape == (2, 16, 12 + 4)
        outs = []
        for a, b in ((0, 4), (4, 5), (5, 9)):
            o, cache = apply(layer, x[:, a:b], cache=cache, pos=jnp.int32(a))
            outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), one, atol=2e-5)


def test_mla_expanded_cache_reads_in_pieces_equal_one_pass():
    """Long pieces read the cache expanded, block by block (pos not a multiple of the piece,
    pieces not multiples of the attention block), then a short piece reads it absorbed."""
    layer = mla_layer(q_lora_rank=10, block=8)
    assert [layer.cache_form(T) for T in (2, 18, 20)] == ["absorbed", "expanded", "expanded"]
    x = normal(12, (2, 61, D))
    with jax.default_matmul_precision("highest"):  # GPU: float32 dots, not TF32
        one, _ = apply(layer, x)
        cache = layer.init_cache(2, 64)
        outs = []
        for a, b in ((0, 20), (20, 40), (40, 58), (58, 61)):
            o, cache = apply(layer, x[:, a:b], cache=cache, pos=jnp.int32(a))
            outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), one, atol=2e-5)


def numpy_attention_at(q, k, v, scale, q_offset):
    """float64 softmax attention of queries at positions q_offset + i over keys j <= q_offset + i;
    q [B, T, H, D], k [B, S, KH, D], v [B, S, KH, Dv]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, _ = q.shape
    S, KH = k.shape[1], k.shape[2]
    k, v = np.repeat(k, H // KH, axis=2), np.repeat(v, H // KH, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    visible = np.arange(S)[None, :] <= (q_offset + np.arange(T))[:, None]
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshv->bthv", p, v)


@pytest.mark.parametrize("impl,B,T,S,pos", [
    ("xla", 2, 18, 70, 41),  # three earlier blocks, the last one cut at pos
    ("xla", 1, 24, 50, 0),  # the piece alone
    ("reference", 2, 7, 40, 30),
    ("pallas", 1, 128, 384, 200),  # splash, interpreted: blocks [0, 128) and [128, 200)
    *([("cudnn", 2, 256, 1024, 300)] if jax.default_backend() == "gpu" else []),
])
def test_cache_attention_block_by_block_equals_float64(impl, B, T, S, pos):
    """cache_attention (blocks merged by log-sum-exp) against float64 NumPy; the cache holds a
    latent that ``expand`` turns into grouped keys and values, as MLA's does; entries past
    pos + T are garbage that must never be read. cuDNN (GPU only) runs in bf16."""
    H, KH, L = 4, 2, 6
    D, Dv, dtype, tol = (8, 5, jnp.float32, 2e-5) if impl != "cudnn" else (64, 32, jnp.bfloat16, 2e-2)
    rng = np.random.default_rng()
    cache = jnp.asarray(rng.normal(size=(B, S, L)), dtype)
    cache = cache.at[:, pos + T:].set(1e30)
    W_k, W_v = normal(1, (L, KH, D), 0.5).astype(dtype), normal(2, (L, KH, Dv), 0.5).astype(dtype)

    def expand(e):
        return jnp.einsum("bnl,lkd->bnkd", e, W_k), jnp.einsum("bnl,lkd->bnkd", e, W_v)

    q = jnp.asarray(rng.normal(size=(B, T, H, D)) * D ** -0.5, dtype)
    with jax.default_matmul_precision("highest"):  # GPU: float32 dots, not TF32
        out = fast_jit(lambda q, c, p: cache_attention(q, c, p, expand, scale=0.4, impl=impl))(
            q, cache, jnp.int32(pos))
        k, v = expand(cache[:, :pos + T])
    want = numpy_attention_at(q, k, v, 0.4, pos)
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------
# Attention Residuals
# ----------------------------------------------------------------------------------------------


def naive_depth_mix(ws, outs, embed, block, eps=1e-6):
    """Reference: explicit source lists; ws[l] is sublayer l's query, ws[-1] the final one."""
    def rmsn(v):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)

    def mix(w, sources):
        logits = np.stack([rmsn(v) @ w for v in sources])
        a = np.exp(logits - logits.max(0))
        a = a / a.sum(0)
        return sum(ai[..., None] * v for ai, v in zip(a, sources, strict=True))

    blocks, partial, count, inputs = [embed], np.zeros_like(embed), 0, []
    for l, out in enumerate(outs):
        inputs.append(mix(ws[l], blocks + ([partial] if count else [])))
        partial, count = partial + out, count + 1
        if count == block:
            blocks, partial, count = blocks + [partial], np.zeros_like(embed), 0
    inputs.append(mix(ws[-1], blocks + ([partial] if count else [])))
    return inputs


def run_depth(depth, ws, outs, embed, unrolled=False):
    """Sublayer inputs from DepthResidual, fed the given outputs (float32 throughout)."""

    @fast_jit
    def run(ws, outs, embed):
        state, inputs = depth.init(embed, unrolled=unrolled), []
        for w, out in zip(ws, outs, strict=False):
            inputs.append(depth.read(state, w))
            state = depth.write(state, out)
        return inputs + [depth.read(state, ws[-1])]

    f32 = lambda xs: [jnp.asarray(x, jnp.float32) for x in xs]
    return [np.asarray(x) for x in run(f32(ws), f32(outs), jnp.asarray(embed, jnp.float32))]


def test_attn_res_zero_queries_give_the_uniform_average_of_sources():
    L, shape = 5, (2, 3, 8)
    rng = np.random.default_rng(0)
    embed, outs = rng.normal(size=shape), [rng.normal(size=shape) for _ in range(L)]
    zeros = [np.zeros(8)] * (L + 1)
    got = run_depth(DepthResidual("full", L), zeros, outs, embed)
    for l in range(L + 1):
        np.testing.assert_allclose(got[l], np.mean([embed] + outs[:l], axis=0), atol=1e-5)
    # Block mode: uniform over b_0, the finished block sums and the partial sum.
    got = run_depth(DepthResidual("block", L, block_size=2), zeros, outs, embed)
    np.testing.assert_allclose(got[3], np.mean([embed, outs[0] + outs[1], outs[2]], 0), atol=1e-5)


@pytest.mark.parametrize("unrolled", [False, True], ids=["stacked", "source_list"])
@pytest.mark.parametrize("block", [1, 2, 3, 10])
def test_attn_res_matches_explicit_source_lists(block, unrolled):
    L, shape = 7, (2, 3, 8)
    rng = np.random.default_rng()
    embed, outs = rng.normal(size=shape), [rng.normal(size=shape) for _ in range(L)]
    ws = [rng.normal(size=8) for _ in range(L + 1)]
    want = naive_depth_mix(ws, outs, embed, block)
    got = run_depth(DepthResidual("block", L, block_size=block), ws, outs, embed, unrolled)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    if block == 1:  # one block per sublayer is the full variant
        full = run_depth(DepthResidual("full", L), ws, outs, embed, unrolled)
        for a, b in zip(full, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _depth_loss_grad(depth, cots, unrolled):
    """The gradient of sum_l <read_l, cots[l]> (every sublayer's read and the final one) with
    respect to (queries, sublayer outputs, embedding)."""
    def loss(ws, outs, embed):
        state, total = depth.init(embed, unrolled=unrolled), 0.0
        for l, cot in enumerate(cots):
            total = total + jnp.sum(depth.read(state, ws[l]) * cot)
            if l < len(outs):
                state = depth.write(state, outs[l])
        return total

    return jax.grad(loss, argnums=(0, 1, 2))


def _float32_depth_args(ws, outs, embed):
    f32 = lambda xs: [jnp.asarray(x, jnp.float32) for x in xs]
    return f32(ws), f32(outs), jnp.asarray(embed, jnp.float32)


@pytest.mark.parametrize("mode,block", [("block", 3), ("full", 1)])
def test_attn_res_source_list_gradients_equal_the_stacked_form(mode, block):
    """The unrolled (SourceList) form and the scanned (stacked) form are one function: equal
    gradients with respect to the queries, the sublayer outputs and the embedding. 2 x 40
    tokens: the pseudo-queries' column sums take both of their stages."""
    L, shape = 7, (2, 40, 16)
    rng = np.random.default_rng()
    embed, outs = rng.normal(size=shape), [rng.normal(size=shape) for _ in range(L)]
    ws = [0.5 * rng.normal(size=16) for _ in range(L + 1)]
    cots = [rng.normal(size=shape) for _ in range(L + 1)]
    depth = DepthResidual(mode, L, block_size=block)

    def grads(unrolled):
        args = _float32_depth_args(ws, outs, embed)
        return jax.tree.leaves(fast_jit(_depth_loss_grad(depth, cots, unrolled))(*args))

    got, want = grads(True), grads(False)
    # One scale for all: a query over a single source has a zero gradient (exactly, or 1e-7).
    scale = max(float(np.abs(w).max()) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("unrolled", [False, True], ids=["stacked", "source_list"])
def test_attn_res_gradients_equal_float64_finite_differences(unrolled):
    """Every read's backward (its cotangent held whole behind a barrier) against the float64
    NumPy reference: the directional derivative of sum_l <read_l, c_l> along random directions
    of the queries, the outputs and the embedding, by central differences of naive_depth_mix.
    The barrier is in the backward program of both forms (without it XLA merged the per-source
    gradients into one slow fusion on the GPU)."""
    L, shape, block = 5, (2, 6, 16), 2
    rng = np.random.default_rng()
    embed, outs = rng.normal(size=shape), [rng.normal(size=shape) * 3 for _ in range(L)]
    ws = [rng.normal(size=16) for _ in range(L + 1)]
    cots = [rng.normal(size=shape) for _ in range(L + 1)]
    depth = DepthResidual("block", L, block_size=block)

    args = _float32_depth_args(ws, outs, embed)
    grad_fn = _depth_loss_grad(depth, cots, unrolled)
    assert "optimization_barrier" in str(jax.make_jaxpr(grad_fn)(*args))
    g_ws, g_outs, g_embed = fast_jit(grad_fn)(*args)
    # Every input as one flat list: the queries, the outputs, the embedding.
    x, grads = [*ws, *outs, embed], [np.asarray(g, np.float64) for g in (*g_ws, *g_outs, g_embed)]

    def loss64(x):
        reads = naive_depth_mix(x[:L + 1], x[L + 1:-1], x[-1], block)
        return sum(float(np.sum(r * c)) for r, c in zip(reads, cots, strict=True))

    h = 1e-6
    for _ in range(3):
        dirs = [rng.normal(size=a.shape) for a in x]
        ends = [loss64([a + s * d for a, d in zip(x, dirs, strict=True)]) for s in (h, -h)]
        want = (ends[0] - ends[1]) / (2 * h)
        terms = [g * d for g, d in zip(grads, dirs, strict=True)]
        got = sum(float(np.sum(t)) for t in terms)
        scale = sum(float(np.sum(np.abs(t))) for t in terms)  # float32 rounding of each term
        assert abs(got - want) <= 1e-5 * scale, (got, want, scale)


def test_attn_res_none_is_the_plain_residual_stream():
    depth = DepthResidual("none", 3)
    x = normal(12, (1, 2, 4))
    state = depth.init(x)
    for i in range(3):
        state = depth.write(state, normal(20 + i, (1, 2, 4)))
    want = x + sum(normal(20 + i, (1, 2, 4)) for i in range(3))
    np.testing.assert_allclose(depth.read(state, None), want, atol=1e-6)


def test_attn_res_rejects_bad_settings():
    with pytest.raises(ValueError, match="attn_res"):
        DepthResidual("sideways", 4)
    with pytest.raises(ValueError, match="attn_res_block_size"):
        DepthResidual("block", 4, block_size=0)


def _count_prims(jaxpr, name: str) -> int:
    """Equations of primitive ``name`` in a jaxpr and every jaxpr nested in it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _count_prims(sub, name)
    return n


@pytest.mark.parametrize("keep_logits,max_unrolled", [(False, 16), (True, 16), (True, 2)])
def test_chunked_nll_and_its_gradients_equal_float64(keep_logits, max_unrolled, monkeypatch):
    """layers.embed.chunked_nll against logsumexp(h W) - (h W)[target] in float64, with its
    gradients dlogits = softmax - onehot (times the cotangent) carried to h and W; a chunk
    that does not divide T, logits of either sign and large. With ``keep_logits`` the backward
    reads the forward's logits: three head matmuls per chunk, the three chunks unrolled (no
    loop) unless there are more than ``MAX_UNROLLED_CHUNKS`` (then one mapped chunk of three);
    without, one mapped chunk of four matmuls."""
    monkeypatch.setattr(embed_lib, "MAX_UNROLLED_CHUNKS", max_unrolled)
    seed = int(np.random.default_rng().integers(2**31))
    B, T, D, V, C = 2, 13, 8, 37, 5
    r = np.random.default_rng(seed)
    h = r.normal(size=(B, T, D)) * 3.0
    W = r.normal(size=(D, V))
    t = r.integers(0, V, (B, T))
    ct = r.normal(size=(B, T))  # the NLLs' cotangent

    def loss(h, W):
        nll = chunked_nll(h, lambda x: jnp.einsum("bcd,dv->bcv", x, W), jnp.asarray(t), C,
                          keep_logits=keep_logits)
        return jnp.sum(nll * ct), nll

    args = (jnp.asarray(h, jnp.float32), jnp.asarray(W, jnp.float32))
    grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, nll), (dh, dW) = jax.jit(grad_fn)(*args)

    logits = h @ W
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    want = lse - np.take_along_axis(logits, t[..., None], -1)[..., 0]
    dlogits = (np.exp(logits - lse[..., None]) - np.eye(V)[t]) * ct[..., None]
    np.testing.assert_allclose(nll, want, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    np.testing.assert_allclose(dh, dlogits @ W.T, rtol=1e-4, atol=1e-4, err_msg=f"seed {seed}")
    np.testing.assert_allclose(dW, np.einsum("btd,btv->dv", h, dlogits), rtol=1e-4, atol=1e-4,
                               err_msg=f"seed {seed}")
    jaxpr = jax.make_jaxpr(grad_fn)(*args).jaxpr
    n_chunks = -(-T // C)
    unrolled = keep_logits and n_chunks <= max_unrolled
    assert _count_prims(jaxpr, "dot_general") == (
        3 * n_chunks if unrolled else 3 if keep_logits else 4)
    assert _count_prims(jaxpr, "scan") == (0 if unrolled else 2)  # the map and its transpose


class _ScaledNorm:
    """An RMSNorm with its scale given as an array (the read_norm tests differentiate it)."""

    def __init__(self, scale_D, dtype):
        self.scale, self.eps, self.dtype = scale_D, 1e-6, dtype

    def __call__(self, x):
        return _scaled_rms_norm(x, self.scale, self.eps, jnp.dtype(self.dtype))


def _read_norm_loss(depth, cots, dtype):
    """(sum_l <norm_l(read_l), cots[l]>, [norm_l(read_l) as float32]) over every sublayer's
    read and the final one, fed the given outputs: a function of (queries, norm scales,
    outputs, embedding)."""
    def loss(ws, scales, outs, embed):
        state, total, xs = depth.init(embed.astype(dtype), unrolled=True), 0.0, []
        for l, cot in enumerate(cots):
            xs.append(depth.read_norm(state, ws[l], _ScaledNorm(scales[l], dtype)).astype(
                jnp.float32))
            total = total + jnp.sum(xs[-1] * cot)
            if l < len(outs):
                state = depth.write(state, outs[l].astype(dtype))
        return total, xs

    return loss


@pytest.mark.parametrize("dtype,block,scale", [(jnp.float32, 3, 1.0), (jnp.float32, 1, 30.0),
                                               (jnp.bfloat16, 2, 1.0)])
def test_fused_read_norm_kernels_equal_the_xla_read_and_norm(dtype, block, scale):
    """DepthResidual.read_norm with impl "pallas" (pallas_kernels.depth_read, interpret mode)
    against the XLA read followed by the RMSNorm (the form the float64 tests above check):
    every read of a 6-sublayer stack, 2 x 13 tokens (not a multiple of the kernels' rows),
    values and the gradients of the queries, the norm scales, the outputs and the embedding.
    Large queries (scale 30) saturate the softmax over sources."""
    L, shape, D = 6, (2, 13, 32), 32
    rng = np.random.default_rng()
    embed, outs = rng.normal(size=shape), [rng.normal(size=shape) * 2 for _ in range(L)]
    ws = [scale * rng.normal(size=D) / np.sqrt(D) for _ in range(L + 1)]
    scales = [1 + 0.5 * rng.normal(size=D) for _ in range(L + 1)]
    cots = [rng.normal(size=shape) for _ in range(L + 1)]
    f32 = lambda xs: [jnp.asarray(x, jnp.float32) for x in xs]
    args = (f32(ws), f32(scales), f32(outs), jnp.asarray(embed, jnp.float32))

    def run(impl):
        depth = DepthResidual("block", L, block_size=block, impl=impl)
        value_and_grad = jax.value_and_grad(_read_norm_loss(depth, cots, dtype), (0, 1, 2, 3),
                                            has_aux=True)
        # Every read's output, not their weighted sum: a sum of terms of both signs can nearly
        # cancel, and then bf16 rounding is large against it (a flaky comparison).
        (_, reads), grads = fast_jit(value_and_grad)(*args)
        return [*reads, *jax.tree.leaves(grads)]

    got, want = run("pallas"), run("xla")
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * float(np.abs(w).max()))


def test_fused_read_norm_forward_equals_float64():
    """The forward kernel alone against NumPy in float64: y = RMSNorm(sum_i a_i s_i) g and the
    weights a = softmax((s_i . w) rho_i), with rho_i given; 1 to 5 sources."""
    rng = np.random.default_rng()
    M, D, eps = 21, 64, 1e-6
    for n in (1, 2, 5):
        s = [rng.normal(size=(M, D)) * rng.uniform(0.1, 10) for _ in range(n)]
        rho = [1 / np.sqrt(np.mean(x * x, -1) + eps) for x in s]
        w, g = rng.normal(size=D), rng.normal(size=D)
        y, a = depth_read_kernel.read_norm_forward(
            [jnp.asarray(x, jnp.float32) for x in s], [jnp.asarray(r, jnp.float32) for r in rho],
            jnp.asarray(w, jnp.float32), jnp.asarray(g, jnp.float32), eps=eps,
            out_dtype=jnp.float32, interpret=True)
        logits = np.stack([(x @ w) * r for x, r in zip(s, rho, strict=True)])
        want_a = np.exp(logits - logits.max(0))
        want_a /= want_a.sum(0)
        h = sum(ai[:, None] * x for ai, x in zip(want_a, s, strict=True))
        want_y = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps) * g
        np.testing.assert_allclose(np.stack(a), want_a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-4)


def test_fused_read_norm_backward_is_the_same_for_every_launch():
    """The backward kernel's results do not depend on its launch: one row per step and
    program, rows walked in several steps by several programs (the column sums dw and dscale
    summed over programs; 21 tokens padded to 24 or 32), and the default."""
    rng = np.random.default_rng()
    M, D, n = 21, 32, 3
    s = [jnp.asarray(rng.normal(size=(M, D)), jnp.float32) for _ in range(n)]
    rho = [jnp.asarray(rng.uniform(0.5, 2, size=M), jnp.float32) for _ in range(n)]
    w, g = (jnp.asarray(rng.normal(size=D), jnp.float32) for _ in range(2))
    dy = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    _, a = depth_read_kernel.read_norm_forward(s, rho, w, g, eps=1e-6, out_dtype=jnp.float32,
                                               interpret=True)
    runs = [jax.tree.leaves(depth_read_kernel.read_norm_backward(
        s, rho, w, g, a, dy, eps=1e-6, tiles=tiles, interpret=True))
        for tiles in (None, depth_read_kernel.ReadTiles(1, 4, 1),
                      depth_read_kernel.ReadTiles(2, 4, 4), depth_read_kernel.ReadTiles(4, 4, 2))]
    for other in runs[1:]:
        for x, y in zip(runs[0], other, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows must be a power of two"):
        depth_read_kernel.read_norm_backward(s, rho, w, g, a, dy, eps=1e-6,
                                             tiles=depth_read_kernel.ReadTiles(3, 4, 1))


def test_fused_read_norm_names_bad_inputs_and_falls_back_off_powers_of_two():
    """The kernels refuse a width that is not a power of two, mismatched sources and
    misshapen weights by name; DepthResidual.read_norm then takes the XLA read (the same
    values at D = 24)."""
    x = jnp.ones((5, 24), jnp.float32)
    r = jnp.ones((5,), jnp.float32)
    with pytest.raises(ValueError, match="D = 24 is not a power of two"):
        depth_read_kernel.read_norm_forward([x], [r], jnp.ones(24), jnp.ones(24), eps=1e-6,
                                            out_dtype=jnp.float32)
    x16 = jnp.ones((5, 16), jnp.float32)
    with pytest.raises(ValueError, match="source 1 is"):
        depth_read_kernel.read_norm_forward([x16, x16[:4]], [r, r], jnp.ones(16), jnp.ones(16),
                                            eps=1e-6, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="scale must have shape"):
        depth_read_kernel.read_norm_forward([x16], [r], jnp.ones(16), jnp.ones(8), eps=1e-6,
                                            out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="attn_res_impl must be"):
        DepthResidual("block", 4, block_size=2, impl="cuda")
    rng = np.random.default_rng()
    shape = (2, 5, 24)
    outs = [rng.normal(size=shape) for _ in range(3)]
    ws, scales = [rng.normal(size=24) for _ in range(4)], [rng.normal(size=24) for _ in range(4)]
    cots = [rng.normal(size=shape) for _ in range(4)]
    args = ([jnp.asarray(v, jnp.float32) for v in ws], [jnp.asarray(v, jnp.float32) for v in scales],
            [jnp.asarray(v, jnp.float32) for v in outs], jnp.asarray(rng.normal(size=shape)))
    got, want = (_read_norm_loss(DepthResidual("block", 3, block_size=2, impl=impl), cots,
                                 jnp.float32)(*args)[0] for impl in ("pallas", "xla"))
    np.testing.assert_allclose(got, want, rtol=1e-6)
