"""The MoE router's float32 product on bfloat16 matmuls (kimi_k3/ops/split_product.py) against
float64 NumPy: the three-way split, the logits and both gradients on extreme inputs (weights
from 1e-30 to 1e30, inputs and cotangents over many binades) within float32 rounding, where a
single bfloat16 product fails the same bounds; ``route`` on bfloat16 x against the float32
product and on float32 x bit-identical to it; the router's gradient under jit; and under a
(fsdp, context) mesh of 4 CPU devices (subprocess), moving no more than the float32 product."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kimi_k3.config import MoeSpec
from kimi_k3.layers.moe import route
from kimi_k3.ops.split_product import router_logits, split3
from tests.helpers import REPO, env

F32, BF16 = jnp.float32, jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST
N, D, E = 37, 129, 11
B, T = 3, 13
ULP = 2.0 ** -24
# Errors in units of 2^-24 sum|a||b|: float32 sums of up to D exact products, in whatever
# order the backend takes them, stay within a few such units (a sequential sum within D - 1).
C = 16


def draw(rng):
    """x [N, D] bfloat16, W [D, E] and cotangent g [N, E] float32, magnitudes over many binades:
    x over 2^+-8, W log-uniform over 1e-30..1e30 (both extremes present), g over 2^+-16."""
    x = rng.normal(size=(N, D)) * 2.0 ** rng.integers(-8, 9, size=(N, D))
    w = rng.choice([-1.0, 1.0], size=(D, E)) * 10.0 ** rng.uniform(-30, 30, size=(D, E))
    w.flat[rng.choice(w.size, 4, replace=False)] = [1e30, -1e30, 1e-30, -1e-30]
    g = rng.normal(size=(N, E)) * 2.0 ** rng.integers(-16, 17, size=(N, E))
    return jnp.asarray(x, BF16), jnp.asarray(w, F32), jnp.asarray(g, F32)


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def ulps(got, want, scale) -> float:
    """The largest |got - want| in units of 2^-24 ``scale`` (sum |a||b| of each entry)."""
    return float(np.max(np.abs(f64(got) - want) / (ULP * scale)))


def within_rounded(got_bf16, want, delta) -> bool:
    """Whether each bfloat16 entry of ``got`` is the rounding of some value within ``delta`` of
    ``want``: rounding is monotone, so it lies between the roundings of want -+ delta."""
    lo, hi = (f64(np.asarray(want + s * delta).astype(BF16)) for s in (-1, 1))
    got = f64(got_bf16)
    return bool(np.all((lo <= got) & (got <= hi)))


def test_split3_is_exact_over_the_float32_range(rng):
    """hi + mid + lo = a exactly for random float32 bit patterns with 2^-103 <= |a| < 2^126
    (the documented range), |mid| <= 2^-8 |a| (1 + 2^-8), |lo| <= 2^-16 |a|; and on the test's
    weights."""
    bits = (rng.integers(0, 2, 4096) << 31 | rng.integers(24, 253, 4096) << 23
            | rng.integers(0, 2 ** 23, 4096)).astype(np.uint32)
    for a in (bits.view(np.float32), np.asarray(draw(rng)[1]).ravel()):
        hi, mid, lo = (f64(p) for p in jax.jit(split3)(jnp.asarray(a)))
        a = f64(a)
        np.testing.assert_array_equal(hi + mid + lo, a)
        assert np.all(np.abs(mid) <= 2.0 ** -8 * (1 + 2.0 ** -8) * np.abs(a))
        assert np.all(np.abs(lo) <= 2.0 ** -16 * np.abs(a))


def test_logits_are_the_float32_product_and_one_bf16_product_is_not(rng):
    x, w, _ = draw(rng)
    want, scale = f64(x) @ f64(w), np.abs(f64(x)) @ np.abs(f64(w))
    y = jax.jit(router_logits)(x, w)
    assert y.dtype == F32 and y.shape == (N, E)
    assert ulps(y, want, scale) <= C
    naive = jnp.dot(x, w.astype(BF16), preferred_element_type=F32)
    assert ulps(naive, want, scale) > 100 * C


def test_gradients_are_the_float32_products_and_bf16_ones_are_not(rng):
    """dW = x^T g within float32 rounding; dx = g W^T, bfloat16 like the float32 product's
    cotangent of x, is the rounding of a value within float32 rounding of the exact one (for
    several g: one bfloat16 rounding hides most float32-sized errors)."""
    x, w, _ = draw(rng)
    vjp = lambda f: jax.jit(lambda x, w, g: jax.vjp(f, x, w)[1](g))
    split_vjp, old_vjp = vjp(router_logits), vjp(
        lambda x, w: jnp.einsum("nd,de->ne", x.astype(F32), w, precision=HIGHEST))
    x64, w64 = f64(x), f64(w)
    for _ in range(8):
        g = draw(rng)[2]
        dx, dw = split_vjp(x, w, g)
        old_dx, old_dw = old_vjp(x, w, g)
        assert (dx.dtype, dw.dtype) == (old_dx.dtype, old_dw.dtype) == (BF16, F32)
        g64 = f64(g)
        dw_want, dw_scale = x64.T @ g64, np.abs(x64).T @ np.abs(g64)
        dx_want, dx_delta = g64 @ w64.T, C * ULP * (np.abs(g64) @ np.abs(w64).T)
        assert ulps(dw, dw_want, dw_scale) <= C
        assert within_rounded(dx, dx_want, dx_delta)
    g16, w16 = g.astype(BF16), w.astype(BF16)
    assert ulps(jnp.dot(x.T, g16, preferred_element_type=F32), dw_want, dw_scale) > 100 * C
    assert not within_rounded(jnp.dot(g16, w16.T), dx_want, dx_delta)


def moe_spec(**overrides) -> MoeSpec:
    base = MoeSpec(num_experts=E, top_k=3, expert_dim=8, num_shared=0, shared_dim=0,
                   renormalize=True, routed_scaling_factor=2.446, n_group=1, topk_group=1,
                   first_k_dense=0, router_float32=True, bias_update_rate=1e-3,
                   balance_loss_coef=0.0, capacity_factor=0.0, expert_matmul="ragged")
    return dataclasses.replace(base, **overrides)


def route_inputs(rng, k: int, shape=(B, T, D)):
    """x [B, T, D] (``shape``) bfloat16, W, bias, with every token's k + 1 best choice scores (in float64)
    at least 1e-4 apart, so that float32 rounding cannot change the choice or its order."""
    while True:
        x = jnp.asarray(rng.normal(size=shape), BF16)
        w = jnp.asarray(rng.normal(size=(shape[-1], E)) / np.sqrt(shape[-1]), F32)
        b = jnp.asarray(rng.normal(size=E) * 0.05, F32)
        c = 1 / (1 + np.exp(-(f64(x) @ f64(w)))) + f64(b)
        top = -np.sort(-c, axis=-1)[..., :k + 1]
        if np.min(-np.diff(top, axis=-1)) > 1e-4:
            return x, w, b


def test_route_on_bf16_x_chooses_and_weighs_as_the_float32_product(rng):
    spec = moe_spec()
    x, w, b = route_inputs(rng, spec.top_k)
    s, idx, wts = jax.jit(route, static_argnums=3)(x, w, b, spec)
    s_ref, idx_ref, wts_ref = jax.jit(route, static_argnums=3)(x.astype(F32), w, b, spec)
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_allclose(s, s_ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(wts, wts_ref, rtol=1e-6, atol=0)


def test_route_on_float32_x_is_the_highest_precision_einsum_bit_for_bit(rng):
    """A float32 model's router is unchanged, and so is the compute-dtype router."""
    x = jnp.asarray(rng.normal(size=(B, T, D)), F32)
    w = jnp.asarray(rng.normal(size=(D, E)) / np.sqrt(D), F32)
    b = jnp.zeros(E, F32)
    old = jnp.einsum("btd,de->bte", x, w, precision=HIGHEST)
    np.testing.assert_array_equal(router_logits(x, w), old)
    np.testing.assert_array_equal(jax.jit(router_logits)(x, w),
                                  jax.jit(lambda x, w: jnp.einsum("btd,de->bte", x, w,
                                                                  precision=HIGHEST))(x, w))
    np.testing.assert_array_equal(route(x, w, b, moe_spec())[0], jax.nn.sigmoid(old))
    low = route(x.astype(BF16), w, b, moe_spec(router_float32=False), BF16)[0]
    np.testing.assert_array_equal(low, jax.nn.sigmoid(
        jnp.einsum("btd,de->bte", x.astype(BF16), w.astype(BF16)).astype(F32)))


def test_router_gradient_through_route_under_jit(rng):
    """grad of sum(weights R) with respect to the router (and x) under jit, bfloat16 x: the
    float32 product's gradient to float32 rounding (x's: to its bfloat16 rounding)."""
    spec = moe_spec()
    x, w, b = route_inputs(rng, spec.top_k)
    r = jnp.asarray(rng.normal(size=(B, T, spec.top_k)), F32)
    loss = lambda w, x: jnp.sum(route(x, w, b, spec)[2] * r)
    dw, dx = jax.jit(jax.grad(loss, (0, 1)))(w, x)
    dw_ref, dx_ref = jax.jit(jax.grad(loss, (0, 1)))(w, x.astype(F32))
    assert dw.dtype == F32 and dx.dtype == BF16
    assert float(jnp.abs(dw).max()) > 0
    np.testing.assert_allclose(dw, dw_ref, rtol=0, atol=1e-5 * float(jnp.abs(dw_ref).max()))
    np.testing.assert_allclose(f64(dx), f64(dx_ref), rtol=2.0 ** -7,
                               atol=1e-5 * float(jnp.abs(dx_ref).max()))


MESH_CHECK = r"""
import json, sys
import jax, jax.numpy as jnp, ml_collections, numpy as np
from jax.sharding import NamedSharding
from kimi_k3 import mesh as mesh_lib, sharding
from kimi_k3.config import DEFAULT_RULES
from tests.test_router_product import moe_spec, route, route_inputs
spec = moe_spec()
# Sharded axes even, the rest odd: B over fsdp, T over context, D (W's rows) over fsdp.
x, w, b = route_inputs(np.random.default_rng(int(sys.argv[1])), spec.top_k, (4, 14, 130))
r = jnp.asarray(np.random.default_rng(0).normal(size=x.shape[:2] + (spec.top_k,)), jnp.float32)
grad = jax.grad(lambda w, x: jnp.sum(route(x, w, b, spec)[2] * r), (0, 1))
one = jax.jit(grad)(w, x)
mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=2, expert=1, context=2,
                                                         tensor=1)))
rules = sharding.make_rules(mesh, DEFAULT_RULES)
put = lambda a, names: jax.device_put(a, NamedSharding(mesh, sharding.logical_to_spec(names, rules)))
ws, xs = put(w, ("embed", None)), put(x, sharding.BTD)
out = {}
with jax.set_mesh(mesh), sharding.axis_rules(rules):
    for name, xx in (("split", xs), ("float32", xs.astype(jnp.float32))):
        f = jax.jit(grad)
        text = f.lower(ws, xx).compile().as_text()
        out[name] = {op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in
                     ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                      "collective-permute")}
        if name == "split":
            dw, dx = f(ws, xx)
            out["dx_sharded_like_x"] = dx.sharding.is_equivalent_to(xs.sharding, x.ndim)
            out["dw_err"] = float(jnp.abs(dw - one[0]).max() / jnp.abs(one[0]).max())
            out["dx_err"] = float(jnp.abs(dx.astype(jnp.float32) - one[1].astype(jnp.float32)).max()
                                  / jnp.abs(one[1].astype(jnp.float32)).max())
print("RESULT " + json.dumps(out))
"""


def test_sharded_over_batch_and_length_moves_what_the_float32_product_moves(jax_cache, rng):
    """Under a (fsdp 2, context 2) mesh with the default rules (x [B, T, D] over both, W over
    fsdp), the jitted gradient of route's weights: the same collectives as the float32
    product's (no activation gathered), x's gradient sharded like x, the one-device values."""
    p = subprocess.run([sys.executable, "-c", MESH_CHECK, str(int(rng.integers(2 ** 31)))],
                       cwd=REPO, env=env(jax_cache, devices=4), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert r["split"] == r["float32"], r
    assert r["split"]["all-to-all"] == r["split"]["collective-permute"] == 0, r
    assert r["dx_sharded_like_x"], r
    assert r["dw_err"] < 1e-5 and r["dx_err"] < 1e-2, r
