"""The whole stack: pattern, config validation, causality, prefill/step, scan, remat, sharding."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import model as model_lib
from kimi_k3 import model_state
from kimi_k3.config import default_model_config, layer_pattern, model_spec, scan_plan
from kimi_k3.layers import Dense
from kimi_k3.layers.moe import MoeStat
from kimi_k3.model import HybridLM, flops_per_token
from kimi_k3.runtime import run_once_compiler_options
from kimi_k3.sharding import LOGICAL_AXES
from tests.helpers import FAST_COMPILE, SUBPROCESS_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_cfg(**overrides):
    """3 layers "KKM": a scanned "K" x 2 plus an unrolled "M"; grouped KDA value heads;
    Attention Residual blocks of 3 sublayers, so a block closes inside the scan.

    The KDA core runs token by token ("recurrent"): it compiles in half the time of the chunked
    form, which test_layers holds to it.
    """
    c = default_model_config()
    c.kda.impl = "recurrent"
    c.vocab_size, c.d_model, c.num_layers, c.kda_per_mla = 64, 32, 3, 2
    c.num_heads, c.kda.head_dim, c.kda.num_v_heads, c.kda.chunk_size = 2, 8, 4, 8
    c.mla.num_heads, c.mla.kv_lora_rank, c.mla.qk_nope_head_dim = 2, 12, 8
    c.mla.shared_head_dim, c.mla.v_head_dim, c.mla.attn_block_size = 4, 6, 8
    c.mlp_dim, c.attn_res, c.attn_res_block_size = 48, "block", 3
    for key, value in overrides.items():
        c[key] = value
    return c



# The initialisers compile with XLA:CPU's MLIR fusion emitters (its default; tests/conftest.py
# turns them off): a scanned and an unrolled model draw bit-identical weights with them, while
# the older emitters round a few of the unrolled model's scaled weights one ulp apart.
INIT_COMPILE = {**FAST_COMPILE, "xla_cpu_use_fusion_emitters": True}


def build(cfg, seed=0):
    # rbg keys and one jit: far less XLA:CPU compile time than threefry op by op.
    make = lambda: HybridLM(cfg, rngs=nnx.Rngs(jax.random.key(seed, impl="rbg")))
    state = jax.jit(lambda: nnx.state(make()), compiler_options=INIT_COMPILE)()
    return nnx.merge(nnx.graphdef(nnx.eval_shape(make)), state)


def model_jit(fn):
    """``fn(model, *args)`` jitted with FAST_COMPILE (the model split into its static graph
    and its state; ``fn`` must not update the model's state)."""
    @functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
    def run(graphdef, state, *args):
        return fn(nnx.merge(graphdef, state, copy=True), *args)

    return lambda model, *args: run(*nnx.split(model), *args)


forward = model_jit(lambda model, tokens, seg=None: model(tokens, seg))
prefill = model_jit(lambda model, tokens, cache: model.prefill(tokens, cache))
step = model_jit(lambda model, token, cache: model.step(token, cache))


@pytest.fixture(scope="module")
def model():
    return build(small_cfg())


def tokens(B, T, seed=0, vocab=64):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (B, T)), jnp.int32)


# ----------------------------------------------------------------------------------------------
# layer pattern
# ----------------------------------------------------------------------------------------------


def test_k3_pattern_is_69_kda_24_mla_with_mla_last():
    cfg = default_model_config()
    cfg.num_layers, cfg.kda_per_mla, cfg.final_mla = 93, 3, True
    p = layer_pattern(cfg)
    assert (p.count("K"), p.count("M")) == (69, 24)
    assert [i + 1 for i, c in enumerate(p) if c == "M"] == list(range(4, 93, 4)) + [93]
    assert scan_plan(p) == ("KKKM", 23, "M")


@pytest.mark.parametrize("ratio", [0, 1, 3, 7])
def test_ratio_gives_r_kda_layers_per_mla(ratio):
    cfg = default_model_config()
    cfg.num_layers, cfg.kda_per_mla, cfg.final_mla = 16, ratio, False
    p = layer_pattern(cfg)
    assert p == ("K" * ratio + "M") * (16 // (ratio + 1))
    assert p.count("M") == 16 // (ratio + 1)


def test_all_kda_and_explicit_pattern():
    cfg = default_model_config()
    cfg.num_layers, cfg.kda_per_mla, cfg.final_mla = 6, 6, False
    assert layer_pattern(cfg) == "KKKKKK"
    cfg.final_mla = True
    assert layer_pattern(cfg) == "KKKKKM"
    cfg.pattern = "MKKMKK"
    assert layer_pattern(cfg) == "MKKMKK"
    model_spec(cfg)


def test_scan_plan_compiles_the_fewest_layers():
    assert scan_plan("MMMMM") == ("M", 5, "")
    assert scan_plan("KMKMM") == ("KM", 2, "M")
    assert scan_plan("KKKM") == ("K", 3, "M")
    assert scan_plan("KMM") == ("", 0, "KMM")  # nothing worth scanning: unrolled
    assert scan_plan("KKKMKKKMM", scan_layers=False) == ("", 0, "KKKMKKKMM")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("kda_per_mla", -1, "kda_per_mla"),
        ("attn_res", "deep", "attn_res"),
        ("attn_res_block_size", 0, "attn_res_block_size"),
        ("attn_res_block_size", -2, "attn_res_block_size"),
        ("pattern", "KKXM", "pattern"),
        ("pattern", "KKM", "pattern"),  # wrong length for 4 layers
        ("kda.num_v_heads", 6, "kda.num_v_heads"),
        ("kda.gate", "relu", "kda.gate"),
        ("kda.chunk_size", 48, "kda.chunk_size"),
        ("mla.attn_impl", "flash9", "mla.attn_impl"),
        ("dtype", "int8", "dtype"),
        ("remat", "some", "remat"),
    ],
)
def test_bad_configs_raise_naming_the_field(field, value, match):
    cfg = default_model_config()
    node, _, leaf = field.rpartition(".")
    (cfg[node] if node else cfg)[leaf] = value
    with pytest.raises(ValueError, match=rf"config\.model\.{match}"):
        model_spec(cfg)


def test_heads_not_dividing_the_width_raise_naming_the_field():
    cfg = default_model_config()
    cfg.d_model, cfg.num_heads, cfg.kda.head_dim = 130, 4, 0  # head dim derived from the width
    with pytest.raises(ValueError, match=r"config\.model\.num_heads"):
        model_spec(cfg)
    cfg = default_model_config()
    cfg.d_model, cfg.mla.num_heads, cfg.mla.v_head_dim = 130, 4, 0
    with pytest.raises(ValueError, match=r"config\.model\.mla\.num_heads"):
        model_spec(cfg)
    with pytest.raises(ValueError, match=r"config\.model\.mla\.num_heads"):
        HybridLM(cfg, rngs=nnx.Rngs(0))


def test_flops_per_token_counts_matmuls_kda_chunks_and_attention():
    """3 x forward, forward = 2 x (every Dense weight, counted from the built model, + the tied
    head) + KDA chunk cost + causal MLA attention."""
    cfg = small_cfg(attn_res="none")
    abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    dense = sum(node.kernel.get_value().size for _, node in nnx.iter_graph(abstract)
                if isinstance(node, Dense))
    T, C, K, HV = 128, 8, 8, 4
    kda_core = 2 * HV * (6 * K * K + 3 * C * K + C * C)  # 2 KDA layers
    attention = 2 * 2 * (8 + 4 + 6) * (T + 1) / 2  # 1 MLA layer, 2 heads
    want = 3 * (2 * (dense + 32 * 64) + kda_core + attention)
    assert flops_per_token(cfg, T) == pytest.approx(want)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(cfg, 0)


# ----------------------------------------------------------------------------------------------
# the stack
# ----------------------------------------------------------------------------------------------


def test_forward_gives_float32_logits(model):
    logits = forward(model, tokens(2, 12))
    assert logits.shape == (2, 12, 64) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert model.pattern == "KKM" and (model.unit, model.repeats) == ("K", 2)


def test_stack_is_causal_by_gradient_across_documents(model):
    B, T, D = 2, 12, 32
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, D)), jnp.float32)
    seg = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2], [0] * 7 + [1] * 5], jnp.int32)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, 64)), jnp.float32)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def jacobian(state, x):
        f = lambda x: jnp.sum(nnx.merge(graphdef, state, copy=True).from_embeddings(x, seg) * w, -1)
        return jax.jacrev(f)(x)

    jac = jacobian(state, x)
    dep = np.asarray(jnp.abs(jac).sum(-1))  # [B, T, B, T]: d out[b, t] / d x[b', s]
    s = np.asarray(seg)
    bb = np.arange(B)
    tt = np.arange(T)
    allowed = ((bb[:, None, None, None] == bb[None, None, :, None])
               & (tt[None, None, None, :] <= tt[None, :, None, None])
               & (s[:, :, None, None] == s[None, None, :, :]))
    # Tolerance: the chunked KDA core's gate gradient crosses documents at rounding level.
    assert dep[~allowed].max() <= 1e-5 * dep.max()
    assert (dep[allowed] > 0).all()


def test_prefill_in_pieces_and_steps_equal_one_pass(model):
    toks = tokens(2, 12, seed=3)
    one = forward(model, toks)
    cache = model.init_cache(2, 16)
    assert cache["tail"][0]["latent_kv"].shape == (2, 16, 16)
    assert cache["groups"][0]["state"].shape == (2, 2, 4, 8, 8)  # [repeats, B, HV, K, V]
    assert cache["groups"][0]["conv_v"].shape == (2, 2, 3, 4, 8)  # [repeats, B, W-1, HV, V]
    structure = jax.tree.structure(cache)
    a, cache = prefill(model, toks[:, :5], cache)
    assert jax.tree.structure(cache) == structure  # a jitted prefill compiles once
    b, cache = prefill(model, toks[:, 5:10], cache)
    c, cache = step(model, toks[:, 10], cache)
    d, cache = step(model, toks[:, 11], cache)
    assert int(cache["pos"]) == 12
    pieces = jnp.concatenate([a, b, c[:, None], d[:, None]], axis=1)
    np.testing.assert_allclose(pieces, one, atol=5e-5, rtol=1e-5)


def test_prefill_traces_each_kind_of_sublayer_once(monkeypatch):
    """A prefill of an unrolled stack traces each kind of mixer and FFN once however many
    layers have it (``model.traced_once``: most of a 20-layer evaluation program's tracing and
    lowering was its layers' copies of the same code); called inline, as the training forward
    calls them, every layer is traced."""
    from kimi_k3.layers import GatedMLA, KDALayer, SwiGLU

    counts = collections.Counter()
    for cls in (KDALayer, GatedMLA, SwiGLU):
        monkeypatch.setattr(cls, "__call__", lambda self, *args, _call=cls.__call__, **kw: (
            counts.update([type(self).__name__]), _call(self, *args, **kw))[1])
    cfg = small_cfg(scan_layers=False, pattern="KKKKM", num_layers=5)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: nnx.merge(graphdef, state).init_cache(1, 16))
    toks = jax.ShapeDtypeStruct((1, 8), jnp.int32)

    def traced(fn, *args):
        counts.clear()
        jax.clear_caches()
        jax.jit(fn).trace(state, *args)
        return dict(counts)

    prefill_fn = lambda state, t, cache: nnx.merge(graphdef, state).prefill(t, cache)
    train_fn = lambda state, t: nnx.merge(graphdef, state)(t)
    assert traced(prefill_fn, toks, cache) == {"KDALayer": 1, "GatedMLA": 1, "SwiGLU": 1}
    assert traced(train_fn, toks) == {"KDALayer": 4, "GatedMLA": 1, "SwiGLU": 5}
    monkeypatch.setattr(model_lib, "traced_once", lambda module, *args: module(*args))
    assert traced(prefill_fn, toks, cache) == {"KDALayer": 4, "GatedMLA": 1, "SwiGLU": 5}


def test_a_prefill_keeps_the_expert_load_each_layer_counts(monkeypatch):
    """State a sublayer writes while traced once (a mixture of experts' per-layer load and
    dropped counts) comes back to its own layer: the same values as inline calls give."""
    cfg = small_cfg(scan_layers=False)
    cfg.moe.num_experts, cfg.moe.top_k = 4, 2
    model = build(cfg, seed=int(np.random.default_rng().integers(1 << 30)))
    toks = tokens(2, 12, seed=int(np.random.default_rng().integers(1 << 30)))

    @jax.jit
    def stats(state, toks):
        m = nnx.merge(nnx.graphdef(model), state)
        m.prefill(toks, m.init_cache(2, 16))
        return nnx.state(m, MoeStat)

    once = nnx.to_flat_state(stats(nnx.state(model), toks))
    monkeypatch.setattr(model_lib, "traced_once", lambda module, *args: module(*args))
    inline = nnx.to_flat_state(stats(nnx.state(model), toks))
    assert len(once) == 9  # load, dropped and balance loss of three layers
    loads = [var.get_value() for path, var in once if path[-1] == "load"]
    assert all(load.sum() > 0 for load in loads) and not np.array_equal(loads[0], loads[1])
    for (path, var), (_, ref) in zip(once, inline, strict=True):
        np.testing.assert_array_equal(var.get_value(), ref.get_value(), err_msg=str(path))


def with_params_of(model, **overrides):
    """A model of ``small_cfg(**overrides)`` holding ``model``'s parameters."""
    other = nnx.eval_shape(lambda: HybridLM(small_cfg(**overrides), rngs=nnx.Rngs(0)))
    nnx.update(other, nnx.state(model))
    return other


def test_full_attn_res_equals_block_of_one_sublayer(model):
    full = with_params_of(model, attn_res="full")
    one_per_block = with_params_of(model, attn_res="block", attn_res_block_size=1)
    toks = tokens(2, 10, seed=4)
    np.testing.assert_allclose(forward(one_per_block, toks), forward(full, toks), atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_switch_rematerialises_each_scanned_unit_and_tail_layer(model, policy):
    toks = jax.ShapeDtypeStruct((1, 8), jnp.int32)

    def n_checkpoints(m):
        graphdef, state = nnx.split(m)
        loss = lambda state, t: jnp.mean(nnx.merge(graphdef, state)(t))
        jaxpr = jax.make_jaxpr(jax.grad(loss))(state, toks)
        # The model's rematerialisation uses prevent_cse=False (it sits inside a scan); the
        # chunked KDA core's own chunk-loop checkpoint keeps the default.
        return str(jaxpr).count("prevent_cse=False")

    assert n_checkpoints(model) == 0
    # One for the scanned unit ("K" x 2) and one for the tail layer ("M").
    assert n_checkpoints(with_params_of(model, remat=policy)) == 2


def unrolled_values(scanned) -> dict:
    """A scanned model's parameters under the paths of the unrolled model's: ("groups",
    "layers", i, ...) slice r -> ("tail", r * len(unit) + i, ...), its tail after them."""
    n_unit, values = len(scanned.unit), {}
    for path, var in nnx.to_flat_state(nnx.state(scanned, nnx.Param)):
        if path[0] == "groups":  # stacked over the repeats
            for r in range(scanned.repeats):
                values[("tail", r * n_unit + path[2], *path[3:])] = var.get_value()[r]
        elif path[0] == "tail":
            values[("tail", scanned.repeats * n_unit + path[1], *path[2:])] = var.get_value()
        else:
            values[path] = var.get_value()
    return values


def test_an_unrolled_model_starts_from_the_scanned_models_weights(model):
    """scan_layers=False builds the repeating unit under vmap and cuts it into layers (its
    initialisers compile once): the same seed gives the scanned model's weights, layer for
    layer ("K" x 2 scanned + "M" against three unrolled layers), and no two layers share them."""
    unrolled = build(small_cfg(scan_layers=False), seed=0)  # the fixture's seed
    assert (model.repeats, unrolled.repeats, len(unrolled.tail)) == (2, 0, 3)
    want = unrolled_values(model)
    got = dict(nnx.to_flat_state(nnx.state(unrolled, nnx.Param)))
    assert set(got) == set(want)
    for path, var in got.items():
        np.testing.assert_array_equal(var.get_value(), want[path], err_msg=str(path))
    first, second = (np.asarray(got[("tail", i, "mlp", "wo", "kernel")].get_value()) for i in (0, 1))
    assert not np.array_equal(first, second)


def test_init_model_traces_the_model_once_with_the_jitted_initialisers_weights(monkeypatch):
    """init_model (eval.py's --checkpoint=init) builds the model in one trace: its graphdef
    comes out of the jitted program beside the state, not from a second trace under
    ``nnx.eval_shape``. Same structure as that trace gives, and bit for bit the weights of
    ``make_model`` under one jit with the same compiler options (the same threefry keys), an
    unrolled stack's layers cut from the vmapped unit included."""
    cfg, seed = small_cfg(scan_layers=False), 3
    make_model, calls = model_state.make_model, []
    monkeypatch.setattr(model_state, "make_model",
                        lambda *args: calls.append(args) or make_model(*args))
    model = model_state.init_model(cfg, seed)
    assert len(calls) == 1
    assert nnx.graphdef(model) == nnx.graphdef(nnx.eval_shape(lambda: make_model(cfg, seed)))
    # Its shapes before it runs (ModelInit.abstract), from the same single trace.
    init = model_state.ModelInit(cfg, seed)
    assert len(calls) == 2
    assert nnx.graphdef(init.abstract) == nnx.graphdef(model)
    abstract = [(p, s.shape, s.dtype, s.weak_type)
                for p, s in jax.tree_util.tree_leaves_with_path(nnx.state(init.abstract))]
    assert abstract == [(p, x.shape, x.dtype, x.weak_type) for p, x in
                        jax.tree_util.tree_leaves_with_path(nnx.state(model))]
    assert all(isinstance(s, jax.ShapeDtypeStruct) for s in jax.tree.leaves(nnx.state(init.abstract)))
    np.testing.assert_array_equal(jax.tree.leaves(nnx.state(init.run()))[0],
                                  jax.tree.leaves(nnx.state(model))[0])
    assert len(calls) == 2
    options = run_once_compiler_options(jax.default_backend())
    want = jax.jit(lambda: nnx.state(make_model(cfg, seed)), compiler_options=options)()
    got = nnx.to_flat_state(nnx.state(model))
    assert [path for path, _ in got] == [path for path, _ in nnx.to_flat_state(want)]
    for (path, var), (_, ref) in zip(got, nnx.to_flat_state(want), strict=True):
        np.testing.assert_array_equal(var.get_value(), ref.get_value(), err_msg=str(path))


def test_model_init_compiles_with_the_run_once_options(monkeypatch):
    """ModelInit's program takes ``run_once_compiler_options`` (on the GPU they compile it
    several times faster than XLA's defaults): an option XLA does not know fails its compile."""
    monkeypatch.setattr(model_state, "run_once_compiler_options",
                        lambda platform: {"xla_no_such_option_here": True})
    init = model_state.ModelInit(small_cfg(), 0)
    with pytest.raises(Exception, match="xla_no_such_option_here"):
        init.run()


def test_scanned_stack_equals_the_unrolled_stack(model):
    """Slice r of the stacked unit parameters is layer r of an unrolled model: same logits, with
    random depth queries (the unrolled model's Attention Residuals run on the SourceList form,
    the scanned one's on the stacked carry; a block closes inside the scan). Their gradients:
    test_layers.test_attn_res_source_list_gradients_equal_the_stacked_form."""
    scanned = with_params_of(model)
    rng = np.random.default_rng()
    for path, var in nnx.to_flat_state(nnx.state(scanned, nnx.Param)):
        if path[-1] == "w":  # the depth queries start at zero: make the mixtures non-uniform
            var.set_value(jnp.asarray(0.5 * rng.normal(size=var.get_value().shape), jnp.float32))
    unrolled = nnx.eval_shape(lambda: HybridLM(
        small_cfg(scan_layers=False), rngs=nnx.Rngs(0)))
    assert (unrolled.repeats, len(unrolled.tail)) == (0, 3)
    values = unrolled_values(scanned)
    state = nnx.state(unrolled, nnx.Param)
    pure = nnx.to_pure_dict(state)
    for path, _ in nnx.to_flat_state(state):
        node = pure
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = values.pop(path)
    assert not values
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(unrolled, state)
    toks = tokens(2, 12, seed=int(rng.integers(1 << 30)))
    seg = jnp.asarray(np.repeat([[1] * 5 + [2] * 7], 2, axis=0), jnp.int32)
    want = forward(scanned, toks, seg)
    np.testing.assert_allclose(forward(unrolled, toks, seg), want, rtol=1e-5, atol=1e-4)
    # The unrolled reads with their norms as one kernel pass (model.attn_res_impl "pallas",
    # interpret mode here; test_layers holds the kernels' gradients to the XLA read's).
    unrolled.depth = dataclasses.replace(unrolled.depth, impl="pallas")
    np.testing.assert_allclose(forward(unrolled, toks, seg), want, rtol=1e-5, atol=1e-4)


def test_compiled_program_does_not_grow_with_depth():
    def n_eqns(num_layers):
        cfg = small_cfg(num_layers=num_layers)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
        fn = lambda state, t: nnx.merge(graphdef, state)(t)
        jaxpr = jax.make_jaxpr(fn)(state, jax.ShapeDtypeStruct((1, 8), jnp.int32))
        return len(jaxpr.jaxpr.eqns)

    assert n_eqns(9) == n_eqns(33)  # "KKM" x 3 vs "KKM" x 11


def test_every_parameter_has_logical_axis_names(model):
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = var.get_metadata().get("out_sharding")
        assert names is not None and len(names) == var.get_value().ndim, path
        assert set(names) - {None} <= set(LOGICAL_AXES), (path, names)
        assert (names[0] == "layers") == (path[0] == "groups"), (path, names)


def test_sharded_model_on_a_4_device_mesh_matches_one_device():
    """Four host CPU devices, mesh (data=2, tensor=2), the default rules: parameters land where
    the rules say and the sharded forward equals the unsharded one."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from kimi_k3 import sharding
        from kimi_k3.model import HybridLM
        from tests.test_model import small_cfg
        cfg = small_cfg()
        make = lambda: HybridLM(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
        mesh = jax.make_mesh((2, 2), ("data", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        rules = sharding.make_rules(mesh)
        model = sharding.create_sharded(make, mesh, rules)
        emb = model.embed.embedding[...]
        assert emb.sharding.spec == jax.P("tensor", None), emb.sharding
        up = model.groups.layers[0].mixer.q_proj.kernel[...]
        assert up.sharding.spec == jax.P(None, None, "tensor", None), up.sharding
        toks = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 8)), jnp.int32)
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            sharded = nnx.jit(lambda m, t: m(t))(model, toks)
        graphdef, state = nnx.split(model)
        one_device = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
        plain = nnx.jit(lambda m, t: m(t))(one_device, toks)
        np.testing.assert_allclose(np.asarray(sharded), np.asarray(plain), atol=1e-5)
        print("SHARDED_OK")
        """
    )
    # Four devices; XLA's CPU backend optimisations off, as for the other subprocess checks
    # (tests/xla_flags.py): a tiny program, compiled more than it runs.
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS=f"{SUBPROCESS_XLA_FLAGS} --xla_force_host_platform_device_count=4")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert "SHARDED_OK" in result.stdout, result.stderr[-3000:]


def test_token_nll_in_chunks_equals_the_logits_and_their_gradients(rng):
    """model.token_nll (head and loss a chunk at a time, never [B, T, V] logits) against
    logsumexp(model(tokens)) - logits[target]: values and parameter gradients, with a chunk
    that does not divide T and packed documents; and in two pieces through the cache. The body
    is one KDA and one MLA layer: the head is what is under test (and two layers compile in
    a fraction of three's time)."""
    cfg = small_cfg(head_chunk=5, num_layers=2, pattern="KM")
    model = build(cfg)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 23)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 64, (2, 23)), jnp.int32)
    seg = jnp.asarray(np.sort(rng.integers(1, 4, (2, 23)), axis=1), jnp.int32)

    def by_logits(m):
        logits = m(tokens, seg)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    def summed(nll_fn):  # (sum, per-token NLLs): the values come out of the gradient's own
        return lambda m: (jnp.sum(v := nll_fn(m)), v)  # forward pass (half the compile)

    @model_jit
    def both(m):
        chunked = lambda m: m.token_nll(tokens, targets, seg)[0]
        (_, v1), g1 = nnx.value_and_grad(summed(chunked), has_aux=True)(m)
        (_, v2), g2 = nnx.value_and_grad(summed(by_logits), has_aux=True)(m)
        return v1, v2, nnx.state(g1), nnx.state(g2)

    nll_chunked, nll_logits, g1, g2 = both(model)
    np.testing.assert_allclose(nll_chunked, nll_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    @model_jit
    def pieces(m):
        cache = m.init_cache(2, 23)
        first, cache = m.token_nll(tokens[:, :11], targets[:, :11], cache=cache)
        second, _ = m.token_nll(tokens[:, 11:], targets[:, 11:], cache=cache)
        return jnp.concatenate([first, second], 1), m.token_nll(tokens, targets)[0]

    in_pieces, whole = pieces(model)
    np.testing.assert_allclose(in_pieces, whole, rtol=1e-4, atol=1e-4)
