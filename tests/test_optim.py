"""The optimiser: schedules, the weight-decay mask on the real model's parameters, one AdamW
step by hand, Muon's orthogonalised updates, and config errors that name the field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import optim, sharding
from kimi_k3.config import add_training_defaults
from kimi_k3.trees import path_str


def opt_config(**kw) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict()
    add_training_defaults(c)
    c.opt.update(kw)
    return c.opt


@pytest.fixture(scope="module")
def tiny_params():
    """The tiny config's parameters (shapes only) and their logical axis names."""
    from kimi_k3.model import HybridLM
    from tests.helpers import load_config

    cfg = load_config("tiny.py")
    abstract = nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(0)))
    _, params_state, _ = nnx.split(abstract, nnx.Param, ...)
    return nnx.to_pure_dict(params_state), sharding.variable_axes(params_state)


def flat(tree, is_leaf=None):
    return {path_str(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def test_warmup_then_cosine_wsd_and_constant():
    c = opt_config(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    cos = optim.lr_schedule(c, total_steps=110)
    np.testing.assert_allclose([cos(0), cos(4), cos(9)], [0.1, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose([cos(60), cos(110), cos(500)], [0.55, 0.1, 0.1], rtol=1e-5)
    c.schedule = "wsd"
    wsd = optim.lr_schedule(c, total_steps=110)  # decay over the last 22 steps
    np.testing.assert_allclose([wsd(50), wsd(88), wsd(99), wsd(110)], [1.0, 1.0, 0.55, 0.1],
                               rtol=1e-5)
    c.schedule = "constant"
    np.testing.assert_allclose(optim.lr_schedule(c, 110)(100), 1.0)


def test_weight_decay_skips_norms_gates_and_depth_queries(tiny_params):
    params, names = tiny_params
    mask = flat(optim.decay_mask(params, opt_config().no_decay, names))
    off = {k for k, v in mask.items() if not v}
    on = {k for k, v in mask.items() if v}
    for k in off:
        assert any(s in k for s in ("norm", "A_log", "dt_bias", "query")), k
    for k in on:
        assert k.endswith(("kernel", "embedding", "weight")), k
    # Every kind that must be off is present in the model, and off.
    for s in ("mixer_norm/scale", "final_norm/scale", "A_log", "dt_bias", "mixer_query/w",
              "mlp_query/w", "final_query/w", "kv_norm/scale", "o_norm/scale"):
        hits = [k for k in mask if s in k]
        assert hits and not any(mask[k] for k in hits), s
    assert mask["embed/embedding"] and any("q_proj/kernel" in k for k in on)


def test_one_adamw_step_by_hand():
    params = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "norm": {"scale": jnp.array([1.0, 2.0])}}
    grads = {"w": jnp.array([[3.0, 0.0], [0.0, 4.0]]), "norm": {"scale": jnp.array([1.0, 1.0])}}
    c = opt_config(lr=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5, grad_clip=2.0,
                   b1=0.9, b2=0.95, eps=1e-8)
    tx, _ = optim.make_optimizer(c, 100, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    # Clip to global norm 2: the norm is sqrt(9 + 16 + 2) = sqrt(27).
    g = jax.tree.map(lambda x: x * 2.0 / np.sqrt(27.0), grads)
    adam = jax.tree.map(lambda x: x / (jnp.abs(x) + 1e-8), g)  # first step: m/sqrt(v) = sign
    want = {"w": -0.1 * (adam["w"] + 0.5 * params["w"]),  # decayed
            "norm": {"scale": -0.1 * adam["norm"]["scale"]}}  # a norm: no decay
    for k, v in flat(want).items():
        np.testing.assert_allclose(flat(updates)[k], v, rtol=1e-5, atol=1e-7)


def test_muon_orthogonalises_matrices_and_keeps_adamw_elsewhere(tiny_params):
    params, names = tiny_params
    c = opt_config(name="muon", lr=1.0, warmup_steps=0, schedule="constant", weight_decay=0.0,
                   grad_clip=0.0)
    dims = flat(optim.muon_dimension_numbers(params, names, c),
                is_leaf=lambda x: x is None or optim._is_dimnum(x))
    assert dims["embed/embedding"] is None  # vocabulary axis: AdamW
    assert dims["groups/layers/0/mixer/q_conv/weight"] is None  # convolution taps: AdamW
    assert dims["groups/layers/0/mixer/A_log"] is None and dims["final_norm/scale"] is None
    assert tuple(dims["groups/layers/0/mixer/o_proj/kernel"]) == ((1, 2), (3,))  # [L, H, K, D]
    assert tuple(dims["tail/0/mixer/k_up/kernel"]) == ((0,), (1, 2))  # [R, H, K]

    # One step on the embedding and the last layer's MLP (fewer shapes to compile).
    params = {"embed": params["embed"], "mlp": params["tail"][0]["mlp"]}
    names = {"embed": names["embed"], "mlp": names["tail"][0]["mlp"]}
    rng = np.random.default_rng(0)
    real = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    tx, _ = optim.make_optimizer(c, 10, real, names)
    updates = flat(jax.jit(tx.update)(grads, tx.init(real), real)[0])
    u = -np.asarray(updates["mlp/wo/kernel"])  # [F=384, D=128], a Muon matrix
    s = np.linalg.svd(u, compute_uv=False) / (0.2 * np.sqrt(384))
    assert 0.5 < s.min() and s.max() < 1.3  # Newton-Schulz: singular values near 1
    g = np.asarray(grads["embed"]["embedding"])  # AdamW, first step: -lr * g / (|g| + eps)
    np.testing.assert_allclose(updates["embed/embedding"], -g / (np.abs(g) + 1e-8), rtol=1e-4)


@pytest.mark.parametrize("field,value,match", [
    ("name", "sgd", "opt.name: 'sgd' is not one of"),
    ("schedule", "linear", "opt.schedule: 'linear' is not one of"),
    ("min_lr_ratio", 2.0, "opt.min_lr_ratio: 2.0 must be in"),
    ("lr", -1.0, "opt.lr: -1.0 must be >= 0"),
])
def test_bad_opt_fields_are_named(field, value, match):
    c = opt_config(**{field: value})
    with pytest.raises(ValueError, match=match):
        optim.make_optimizer(c, 10, {"w": jnp.zeros((2, 2))})
