"""The mixture of experts: the layer against its float64 NumPy definition (outputs and gradients,
grouped routing, ties), dropless and capacity dispatch, the load-balancing bias, the balance
loss, the config checks, the Kimi Linear 48B shapes, and (in a subprocess with 8 CPU devices)
expert parallelism and training through the trainer."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import mesh as mesh_lib
from kimi_k3 import metrics as metrics_lib
from kimi_k3 import train_lib
from kimi_k3.config import MoeSpec, default_model_config, model_spec, run_spec
from kimi_k3.layers.moe import MoE, expert_load, route, update_bias
from kimi_k3.model import count_params, flops_per_token
from tests import moe_numpy
from tests.helpers import SUBPROCESS_XLA_FLAGS, load_config

REPO = Path(__file__).resolve().parents[1]
B, T, D, E, F = 2, 12, 16, 8, 12


def moe_spec(**overrides) -> MoeSpec:
    base = MoeSpec(num_experts=E, top_k=3, expert_dim=F, num_shared=1, shared_dim=F,
                   renormalize=True, routed_scaling_factor=2.446, n_group=1, topk_group=1,
                   first_k_dense=0, router_float32=True, bias_update_rate=1e-3,
                   balance_loss_coef=0.0, capacity_factor=0.0, expert_matmul="ragged")
    return dataclasses.replace(base, **overrides)


def make_layer(spec: MoeSpec, p: dict) -> MoE:
    """A MoE layer holding the NumPy weights ``p`` (moe_numpy's names), the rest of its state
    zero; built from its shapes (nothing to compile)."""
    layer = nnx.eval_shape(lambda: MoE(D, spec, rngs=nnx.Rngs(0)))
    state = nnx.state(layer)
    values = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), nnx.to_pure_dict(state))
    values["router"]["kernel"], values["bias"] = p["Wr"], p["b"]
    values["experts"].update(wi=p["wi"], wo=p["wo"])
    if spec.num_shared:
        values["shared"] = {"wi": {"kernel": p["shared_wi"]}, "wo": {"kernel": p["shared_wo"]}}
    if spec.latent_dim:
        values["latent_down"], values["latent_up"] = {"kernel": p["Wd"]}, {"kernel": p["Wl"]}
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), values))
    nnx.update(layer, state)
    return layer


def draw(rng, spec: MoeSpec, bias=None):
    """Weights, input and output cotangent in float32 (as the layer sees them), redrawn until
    every token's k-th and (k+1)-th choice (and group) are apart by 1e-3, so float32 and
    float64 choose the same experts."""
    De = spec.latent_dim or D  # the routed experts' width
    for _ in range(100):
        f32 = lambda shape, scale: rng.normal(size=shape, scale=scale).astype(np.float32)
        p = {"Wr": f32((D, E), D ** -0.5), "wi": f32((E, De, 2, F), De ** -0.5),
             "wo": f32((E, F, De), F ** -0.5),
             "b": (f32((E,), 0.1) if bias is None else np.asarray(bias, np.float32))}
        if spec.latent_dim:
            p["Wd"], p["Wl"] = f32((D, De), D ** -0.5), f32((De, D), De ** -0.5)
        if spec.num_shared:
            p["shared_wi"], p["shared_wo"] = f32((D, 2, F), D ** -0.5), f32((F, D), F ** -0.5)
        x, R = f32((B * T, D), 1.0), f32((B * T, D), 1.0)
        if bias is not None or _margin(x, p, spec) > 1e-3:
            return p, x, R
    raise AssertionError("no well-separated draw")


def _margin(x, p, spec):
    s = moe_numpy.sigmoid(x.astype(np.float64) @ p["Wr"].astype(np.float64))
    c = np.sort(s + p["b"], axis=-1)[:, ::-1]
    gap = (c[:, spec.top_k - 1] - c[:, spec.top_k]).min()
    if spec.n_group > 1:
        g = (s + p["b"]).reshape(len(x), spec.n_group, -1)
        score = np.sort(np.sort(g, -1)[..., -2:].sum(-1), -1)[:, ::-1]
        gap = min(gap, (score[:, spec.topk_group - 1] - score[:, spec.topk_group]).min())
    return gap


def reference(spec: MoeSpec, p, x, R, keep=None):
    return moe_numpy.moe(x, p, R, k=spec.top_k, n_group=spec.n_group, topk_group=spec.topk_group,
                         renormalize=spec.renormalize, scale=spec.routed_scaling_factor, keep=keep)


def layer_outputs_and_grads(layer: MoE, x, R):
    """(y [N, D], weight grads by moe_numpy's names, grad of x, the layer after the call)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def run(params, rest, x):
        def loss(params, x):
            model = nnx.merge(graphdef, params, rest, copy=True)
            y = model(x.reshape(B, T, D)).reshape(B * T, D)
            return jnp.sum(y * R), (y, nnx.state(model))
        (_, (y, state)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return y, grads, state

    with jax.default_matmul_precision("highest"):  # float32 products, not TF32 on a GPU
        y, (gp, gx), state = run(params, rest, jnp.asarray(x))
    nnx.update(layer, state)
    g = nnx.to_pure_dict(gp)
    named = {"Wr": g["router"]["kernel"], "wi": g["experts"]["wi"], "wo": g["experts"]["wo"]}
    if layer.shared is not None:
        named["shared_wi"], named["shared_wo"] = g["shared"]["wi"]["kernel"], g["shared"]["wo"]["kernel"]
    if layer.latent_down is not None:
        named["Wd"], named["Wl"] = g["latent_down"]["kernel"], g["latent_up"]["kernel"]
    return np.asarray(y), {k: np.asarray(v) for k, v in named.items()}, np.asarray(gx), layer


def assert_close(got, want, what, rtol=2e-5):
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max() / scale
    assert err < rtol, f"{what}: relative error {err:.2e}"


# ---------------------------------------------------------------------------------------------
# The layer against its definition
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["kimi_linear", "grouped_unnormalised", "capacity_no_drops",
                                  "dense_experts", "latent", "latent_capacity"])
def test_layer_matches_the_float64_definition(rng, case):
    spec = {
        "kimi_linear": moe_spec(),  # sigmoid, renormalised, x 2.446, one shared expert
        "dense_experts": moe_spec(expert_matmul="dense", n_group=2, topk_group=1),
        "grouped_unnormalised": moe_spec(n_group=4, topk_group=2, renormalize=False,
                                         routed_scaling_factor=1.5, num_shared=0, shared_dim=0),
        "capacity_no_drops": moe_spec(capacity_factor=E / 3),  # C = N: nothing can drop
        "latent": moe_spec(latent_dim=D // 2 + 1),  # LatentMoE, l not dividing D
        "latent_capacity": moe_spec(latent_dim=5, capacity_factor=E / 3, num_shared=0,
                                    shared_dim=0),
    }[case]
    p, x, R = draw(rng, spec)
    y_ref, g_ref, gx_ref, chosen = reference(spec, p, x, R)
    y, g, gx, layer = layer_outputs_and_grads(make_layer(spec, p), x, R)
    assert_close(y, y_ref, "output")
    assert_close(gx, gx_ref, "grad x")
    for name in g:
        assert_close(g[name], g_ref[name], f"grad {name}")
    np.testing.assert_array_equal(np.asarray(layer.load[...]),
                                  np.bincount(chosen.ravel(), minlength=E))
    assert float(layer.dropped[...]) == 0


def test_ties_are_broken_like_lax_top_k_lowest_index_first():
    """A zero router makes every score 0.5: the choice is the bias alone, full of ties. Groups
    of two score 1.25, 1.25, 2.0, 1.5; topk_group = 3 keeps groups 2, 3 and (tie) 0, not 1; of
    their experts 4, 5, 6 (1.0), 1 (0.75), then 0 (0.5, tied with 7)."""
    b = np.array([0, .25, .25, 0, .5, .5, .5, 0], np.float32)
    x = np.random.default_rng(0).normal(size=(B * T, D)).astype(np.float32)
    zero = np.zeros((D, E), np.float32)
    for spec, want in [(moe_spec(top_k=5, n_group=4, topk_group=3), [4, 5, 6, 1, 0]),
                       (moe_spec(top_k=2), [4, 5])]:
        _, idx, _ = route(jnp.asarray(x).reshape(B, T, D), jnp.asarray(zero), jnp.asarray(b), spec)
        _, chosen, _, _ = moe_numpy.route(x, zero, b, k=spec.top_k, n_group=spec.n_group,
                                          topk_group=spec.topk_group)
        np.testing.assert_array_equal(np.asarray(idx).reshape(B * T, -1), chosen)
        assert (chosen == want).all()


def test_dropless_sends_every_token_to_exactly_top_k_experts_even_when_skewed(rng):
    """A bias of 10 on experts 0 and 1 sends every token there (and to one more): nothing is
    dropped, the output is the definition's, the load counts N k assignments."""
    spec = moe_spec()
    bias = np.zeros(E, np.float32)
    bias[:2] = 10.0
    p, x, R = draw(rng, spec, bias=bias)
    y_ref, _, _, chosen = reference(spec, p, x, R)
    y, _, _, layer = layer_outputs_and_grads(make_layer(spec, p), x, R)
    load = np.asarray(layer.load[...])
    assert load[0] == load[1] == B * T and load.sum() == B * T * spec.top_k
    assert all(len(set(row)) == spec.top_k for row in chosen)
    assert float(layer.dropped[...]) == 0
    assert_close(y, y_ref, "output")


def test_capacity_factor_drops_and_counts(rng):
    """capacity_factor 1: C = ceil(N k / E) = 9 per expert; experts 0 and 1 get all 24 tokens,
    so 15 assignments of each are dropped (later tokens first), and the routed output of a
    dropped assignment is zero."""
    spec = moe_spec(capacity_factor=1.0)
    bias = np.zeros(E, np.float32)
    bias[:2] = 10.0
    p, x, R = draw(rng, spec, bias=bias)
    C = math.ceil(B * T * spec.top_k / E)
    _, chosen, _, _ = moe_numpy.route(x, p["Wr"], p["b"], k=spec.top_k)
    keep = moe_numpy.capacity_keep(chosen, E, C)
    y_ref, g_ref, gx_ref, _ = reference(spec, p, x, R, keep=keep)
    y, g, gx, layer = layer_outputs_and_grads(make_layer(spec, p), x, R)
    assert float(layer.dropped[...]) == (~keep).sum() >= 2 * (B * T - C)
    assert_close(y, y_ref, "output")
    assert_close(gx, gx_ref, "grad x")
    assert_close(g["wi"], g_ref["wi"], "grad wi")


def test_bias_update_moves_the_load_toward_balance():
    """Tokens whose router strongly prefers expert 0: b_e += rate sign(mean - load_e), step after
    step, lowers expert 0's bias and spreads the load."""
    spec = moe_spec(top_k=2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 64, D)) + 1.0, jnp.float32)
    W = rng.normal(size=(D, E), scale=0.3)
    W[:, 0] += 0.5  # x has mean 1 on every channel: expert 0 scores ~ sigmoid(8)
    W = jnp.asarray(W, jnp.float32)

    def imbalance(bias):
        load = expert_load(route(x, W, bias, spec)[1], E)
        return load.max() / load.mean(), load

    @jax.jit
    def balance(bias):
        step = lambda _, b: update_bias(b, imbalance(b)[1], 0.01)
        return jax.lax.fori_loop(0, 300, step, bias)

    start = jnp.zeros(E)
    before, after_bias = float(imbalance(start)[0]), balance(start)
    after = float(imbalance(after_bias)[0])
    assert before > 3.5 and after < 1.5, (before, after)
    assert float(after_bias[0]) == pytest.approx(float(after_bias.min()))
    # the rule itself, exactly: raise the underloaded, lower the overloaded, leave the mean
    np.testing.assert_allclose(update_bias(jnp.zeros(3), jnp.array([1.0, 2.0, 6.0]), 0.5),
                               [0.5, 0.5, -0.5])
    np.testing.assert_allclose(update_bias(jnp.zeros(2), jnp.array([2.0, 2.0]), 0.5), [0, 0])


def test_sequence_balance_loss_is_the_definition_and_reaches_the_router(rng):
    spec = moe_spec(balance_loss_coef=0.1)
    p, x, R = draw(rng, spec)
    layer = make_layer(spec, p)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def balance(params):
        model = nnx.merge(graphdef, params, rest, copy=True)
        model(jnp.asarray(x).reshape(B, T, D))
        return model.balance_loss[...]

    value, grads = jax.jit(jax.value_and_grad(balance))(params)
    s, chosen, _, _ = moe_numpy.route(x, p["Wr"], p["b"], k=spec.top_k)
    want = 0.1 * moe_numpy.sequence_balance_loss(s, chosen, rows=B)
    assert float(value) == pytest.approx(want, rel=1e-5)
    assert float(jnp.abs(grads["router"]["kernel"]).max()) > 0


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def moe_config(**moe):
    c = default_model_config()
    c.moe.num_experts, c.moe.top_k = 8, 2
    c.moe.update(moe)
    return c


@pytest.mark.parametrize("field,value,others,match", [
    ("top_k", 9, {}, r"moe\.top_k: 9 must be in \[1, num_experts=8\]"),
    ("n_group", 3, {}, r"moe\.n_group: 3 must divide num_experts=8"),
    ("topk_group", 3, {"n_group": 2}, r"moe\.topk_group: 3 must be in \[1, n_group=2\]"),
    ("top_k", 5, {"n_group": 2, "topk_group": 1}, r"moe\.top_k: 5 exceeds the experts"),
    ("first_k_dense", 4, {}, r"moe\.first_k_dense: 4 must be < num_layers=4"),
    ("capacity_factor", -1.0, {}, r"moe\.capacity_factor: -1.0 must be >= 0"),
    ("routed_scaling_factor", 0.0, {}, r"moe\.routed_scaling_factor"),
    ("num_experts", -8, {}, r"moe\.num_experts"),
    ("bias_update_rate", -0.1, {}, r"moe\.bias_update_rate: -0.1 must be >= 0"),
    ("expert_matmul", "grouped", {}, r"moe\.expert_matmul: 'grouped'"),
    ("latent_dim", -4, {}, r"moe\.latent_dim: -4 must be 0 \(off\) or an integer in \[1, "
                           r"d_model=\d+\)"),
    ("latent_dim", 1 << 20, {}, r"moe\.latent_dim: 1048576 must be 0 \(off\) or an integer in "
                                r"\[1, d_model=\d+\)"),
    ("ep_exchange", "gather", {}, r"moe\.ep_exchange: 'gather' is not one of \('all_tokens', "
                                  r"'ragged'\)"),
    ("ep_exchange", "ragged", {"capacity_factor": 1.5}, r"moe\.ep_exchange: 'ragged' is for "
                                                        r"dropless experts only; capacity_factor="
                                                        r"1.5 .*allowed: 'all_tokens'"),
])
def test_a_bad_moe_config_names_the_field(field, value, others, match):
    c = moe_config(**others)
    c.moe[field] = value
    with pytest.raises(ValueError, match=r"config\.model\." + match):
        model_spec(c)


def test_experts_not_dividing_the_expert_axis_name_both_fields():
    config = load_config("moe_tiny.py")
    config.mesh.expert = 3
    with pytest.raises(ValueError, match=r"mesh\.expert: 3 does not divide "
                                         r"config\.model\.moe\.num_experts=8"):
        run_spec(config)


def test_num_experts_zero_is_the_dense_model_unchanged():
    dense = model_spec(default_model_config())
    assert dense.moe is None and dense.scan_prefix == ""
    c = moe_config(first_k_dense=1)
    spec = model_spec(c)
    # the dense first layer is unrolled ahead of the scan: "K" + "K" x 2 + "M"
    assert (spec.scan_prefix, spec.scan_unit, spec.scan_repeats, spec.scan_tail) == (
        "K", "K", 2, "M")


def test_kimi_linear_48b_has_its_published_size():
    """48B total, ~3B active, counted with nnx.eval_shape (nothing allocated)."""
    m = load_config("kimi_linear_48b.py").model
    spec = model_spec(m)
    assert [i + 1 for i, c in enumerate(spec.pattern) if c == "M"] == [4, 8, 12, 16, 20, 24, 27]
    assert spec.scan_prefix == "K" and spec.moe.num_experts == 256 and spec.moe.top_k == 8
    total, active = count_params(spec), count_params(spec, active=True)
    assert 47e9 < total < 50e9, total
    assert 2.8e9 < active < 3.6e9, active
    # the routed experts a token leaves out, exactly
    assert total - active == 26 * (256 - 8) * 3 * 2304 * 1024
    # MFU counts what a token multiplies: about 6 FLOPs per active weight (not per weight)
    assert 6 * (active - 163840 * 2304) < flops_per_token(spec, 4096) < 8 * active


def test_latent_moe_counts_what_it_holds_and_what_a_token_multiplies():
    """LatentMoE's parameters from the layer's own shapes (nothing allocated): the routed
    experts a token leaves out are E - k experts of 3 l F, and the FLOPs per token move with
    the weights a token multiplies (router, down, the k experts, up, shared expert)."""
    plain, latent = moe_config(first_k_dense=1), moe_config(first_k_dense=1, latent_dim=40)
    sp, sl = model_spec(plain), model_spec(latent)
    d, e = sl.d_model, sl.moe
    n_moe = sl.num_layers - 1

    def layer_params(spec):
        layer = nnx.eval_shape(lambda: MoE(spec.d_model, spec.moe, rngs=nnx.Rngs(0)))
        return sum(math.prod(a.shape) for a in jax.tree.leaves(nnx.state(layer, nnx.Param)))

    unused = (e.num_experts - e.top_k) * 3 * 40 * e.expert_dim
    assert count_params(sl) - count_params(sl, active=True) == n_moe * unused
    assert count_params(sl) - count_params(sp) == n_moe * (layer_params(sl) - layer_params(sp))
    active_plain = layer_params(sp) - (e.num_experts - e.top_k) * 3 * d * e.expert_dim
    active_latent = layer_params(sl) - unused
    assert active_latent - active_plain == 2 * d * 40 + 3 * e.top_k * e.expert_dim * (40 - d)
    assert flops_per_token(sl, 64) - flops_per_token(sp, 64) == pytest.approx(
        6 * n_moe * (active_latent - active_plain))


# ---------------------------------------------------------------------------------------------
# The trainer's view
# ---------------------------------------------------------------------------------------------


def test_moe_metrics_reach_metrics_jsonl_per_layer(tmp_path):
    moe_layers = ((("groups", "layers", 0, "mlp"), (2, 3)), (("tail", 0, "mlp"), (4,)))
    m = {"moe_load_max_mean": np.array([1.5, 2.0, 1.25]), "moe_bias_norm": np.array([.1, .2, .3]),
         "moe_dropped": np.int32(7), "moe_balance_loss": np.float32(0.0)}
    rec = train_lib.moe_report(m, moe_layers)
    assert rec["moe_load_max_mean/layer3"] == 2.0 and rec["moe_bias_norm/layer4"] == 0.3
    assert rec["moe_load_max_mean"] == 2.0 and rec["moe_dropped"] == 7
    shown = []
    w = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False, console=shown.append)
    w.write(1, {"loss": 1.0, **rec})
    w.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["moe_bias_norm/layer2"] == pytest.approx(0.1)
    assert "layer2" not in shown[0] and "moe_load_max_mean=2.0000" in shown[0]


def test_expert_parallel_on_8_devices_equals_one_device_and_trains(jax_cache, tmp_path, rng):
    """tests/moe_parallel_check.py: the layer on meshes with expert 8, (fsdp 2, expert 2,
    tensor 2) and an expert axis that does not split the tokens, against one device (outputs,
    gradients, dropless, capacity, the dense expert form, the blocked kernels and LatentMoE);
    the "ragged" exchange against one device and the "all_tokens" exchange (fresh inputs);
    the whole model through train_lib: loss falling on one device (2 micro-batches), the same
    steps on 8 devices; the routing biases move and round-trip through a checkpoint."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8",
               XLA_FLAGS=SUBPROCESS_XLA_FLAGS, PYTHONPATH=str(REPO),
               JAX_COMPILATION_CACHE_DIR=jax_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    p = subprocess.run([sys.executable, "-m", "tests.moe_parallel_check", str(tmp_path),
                        str(int(rng.integers(2**31)))],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert len(r["layer"]) == 8
    for mesh, err in r["layer"].items():
        assert err < 2e-5, (mesh, err)
    assert len(r["ragged"]) == 6, r["ragged"]
    for case, err in r["ragged"].items():
        assert err < 2e-5, (case, err, r["ragged_seed"])
    assert r["mixed_rules_error"].startswith("mesh.axis_rules: the experts are split over mesh "
                                             "axes ('expert', 'tensor')"), r["mixed_rules_error"]
    losses = r["single_losses"]
    assert losses[-1] < losses[0] - 0.5, losses
    np.testing.assert_allclose(r["sharded_losses"], losses[:len(r["sharded_losses"])], rtol=2e-5)
    assert r["param_diff"] < 2e-5 and r["bias_diff"] < 1e-6, r
    assert r["bias_moved"] > 0 and r["restored_bias_diff"] == 0.0
    assert r["specs"]["wi"] == "P(None, 'expert', 'fsdp', None, 'tensor')", r["specs"]


def test_expert_matmul_auto_is_blocked_on_gpu_and_dense_refuses_all_to_all():
    from kimi_k3.dispatch import choose_expert_matmul
    for moves in (False, True):  # the blocked kernels take tokens from any device
        assert choose_expert_matmul("auto", tokens_move=moves, dims=(2048, 512),
                                    backend="gpu") == "blocked"
    assert choose_expert_matmul("auto", tokens_move=False, backend="cpu") == "ragged"
    assert choose_expert_matmul("auto", tokens_move=False, backend="tpu") == "ragged"
    with pytest.raises(ValueError, match="expert_matmul='blocked' cannot run here.*tpu"):
        choose_expert_matmul("blocked", tokens_move=False, dims=(2048, 512), backend="tpu")
    with pytest.raises(ValueError, match="expert_matmul='blocked'.*moe.expert_dim = 12"):
        choose_expert_matmul("blocked", tokens_move=False, dims=(2048, 12), backend="cpu")
    with pytest.raises(ValueError, match="expert_matmul='dense' cannot run with all-to-all"):
        choose_expert_matmul("dense", tokens_move=True, backend="gpu")


def test_micro_batches_sum_the_experts_gradients_as_one_pass_does():
    """configs/moe_tiny.py as two scanned MLA layers, in 4 micro-batches against one pass:
    the same parameters after two steps. Each micro-batch's expert gradient comes back with
    the running sum added (GradientSum; here onto the weights' gradients, the ragged form;
    the blocked kernels' own addition: the test below)."""
    config = load_config("moe_tiny.py")
    config.model.moe.expert_matmul = "ragged"
    config.model.moe.expert_dim = 24
    # "MM": one scanned layer, repeated twice, so each GradientSum is a stack of two.
    config.model.num_layers, config.model.kda_per_mla, config.model.moe.first_k_dense = 2, 0, 0
    config.data.seq_len, config.data.global_batch_size = 32, 4
    config.checkpoint.enabled = False
    rng = np.random.default_rng()
    batches = [{"tokens": rng.integers(1, 256, (4, 32)).astype(np.int32),
                "segment_ids": np.sort(rng.integers(1, 3, (4, 32)), axis=1).astype(np.int32)}
               for _ in range(2)]
    mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
    seen = []
    real = train_lib.set_gradient_sums
    params = {}
    for micro in (4, 1):
        config.train.microbatch_size = micro
        setup = train_lib.build(config, mesh)
        state = setup.init_state()
        with mock.patch.object(train_lib, "set_gradient_sums",
                               lambda model, sums, m=micro: (seen.append(m), real(model, sums))):
            for b in batches:
                with setup.context():
                    state, _ = setup.train_step(state, train_lib.global_batch(
                        b, setup.batch_sharding, 4))
        params[micro] = jax.device_get(state["params"])
    assert seen == [1]  # traced once, for the micro-batched step only
    for path, a in jax.tree_util.tree_leaves_with_path(params[4]):
        b = params[1]
        for k in path:
            b = b[k.key]
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mesh", ["none", "one_device"])
def test_gradient_sums_come_back_added_to_the_experts_gradients(rng, mesh):
    """A blocked layer given GradientSums S: the gradients of wi and wo are S + those of the
    same layer without them (added inside the weight-gradient kernels: with no mesh, and on a
    mesh of one device, through shard_map); every other gradient and the output unchanged."""
    from kimi_k3 import sharding

    spec = moe_spec(expert_dim=16, shared_dim=16, expert_matmul="blocked")
    layer = nnx.jit(lambda: MoE(D, spec, rngs=nnx.Rngs(jax.random.key(4, impl="rbg"))))()
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    R = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    experts = nnx.to_pure_dict(params)["experts"]
    S = {k: jnp.asarray(rng.normal(size=v.shape), v.dtype) for k, v in experts.items()}

    @jax.jit
    def grads(params, x, sums):
        def loss(params):
            model = nnx.merge(graphdef, params, rest, copy=True)
            if sums is not None:
                model.experts.wi_sum.set_value(sums["wi"])
                model.experts.wo_sum.set_value(sums["wo"])
            y = model(x)
            return jnp.sum(y * R), y
        (_, y), g = jax.value_and_grad(loss, has_aux=True)(params)
        return y, nnx.to_pure_dict(g)

    def both():
        # The sums go into the two weight-gradient kernels, whose outputs overwrite them.
        text = str(jax.make_jaxpr(grads)(params, x, S))
        assert len(re.findall(r"input_output_aliases=\(\(\d+, 0\),\)", text)) == 2
        return grads(params, x, None), grads(params, x, S)

    if mesh == "none":
        (y0, g0), (y1, g1) = both()
    else:
        one = mesh_lib.make_mesh(load_config("tiny.py").mesh, jax.devices()[:1])
        with jax.set_mesh(one), sharding.axis_rules(sharding.make_rules(one)):
            (y0, g0), (y1, g1) = both()
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    for path, a in jax.tree_util.tree_leaves_with_path(g1):
        keys = [k.key for k in path]
        b = g0
        for k in keys:
            b = b[k]
        want = np.asarray(b, np.float64)
        if keys[-2:] in (["experts", "wi"], ["experts", "wo"]):
            want = want + np.asarray(S[keys[-1]], np.float64)
        np.testing.assert_allclose(np.asarray(a), want, rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
