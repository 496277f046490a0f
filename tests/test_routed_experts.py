"""The routed experts (kimi_k3/ops/routed_experts.py) and their blocked-layout kernels
(pallas_kernels/grouped_matmul.py, interpret mode here), held to float64 NumPy written from the
equations; and the bfloat16 training state (opt.moments_dtype, train.grad_accum_dtype) that
lets configs/moe_1b.py fit one card."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kimi_k3 import optim
from kimi_k3.config import ConfigError, add_training_defaults, opt_spec, train_spec
from kimi_k3.layers.dense import low_copies
from kimi_k3.ops import routed_experts as re_lib
from pallas_kernels import grouped_matmul as gk

# Blocks of 32 rows that the weight gradient contracts 16 rows at a time, as the default tiles
# step through theirs in halves.
TILES = gk.GmmTiles(block_m=32, block_n=32, block_k=16, warps=4, stages=1, wgrad_block_k=16,
                    wgrad_block_n=32, wgrad_warps=4, wgrad_stages=1, wgrad_block_m=16)


def routed_numpy(x, ids, w, wi, wo):
    """y_n = sum_j w[n,j] (silu(x W_gate) * (x W_up)) W_o over the held experts, float64."""
    E = wi.shape[0]
    y = np.zeros(x.shape, np.float64)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]
            if e >= E:
                continue
            g, u = x[n] @ wi[e, :, 0], x[n] @ wi[e, :, 1]
            y[n] += w[n, j] * ((g / (1 + np.exp(-g)) * u) @ wo[e])
    return y


def draw(rng, R, K, E, D, F):
    """Random routing with choices held elsewhere (id E) and experts nobody chose."""
    ids = np.stack([rng.permutation(E + 1)[:K] for _ in range(R)]).astype(np.int32)
    ids[ids == 0] = E  # expert 0 empty, its choices served elsewhere
    return (rng.normal(size=(R, D)), ids, rng.random((R, K)),
            rng.normal(size=(E, D, 2, F)) / np.sqrt(D), rng.normal(size=(E, F, D)) / np.sqrt(F))


def test_the_layout_puts_each_expert_in_whole_blocks(rng):
    R, K, E, BM = int(rng.integers(20, 60)), 3, 5, 16
    ids = np.asarray(draw(rng, R, K, E, 16, 16)[1])
    lay = jax.device_get(re_lib.blocked_layout(jnp.asarray(ids), E, BM))
    NB = lay.block_group.shape[0]
    assert NB == -(-R * K // BM) + E
    for n in range(R):
        for j in range(K):
            if ids[n, j] >= E:
                assert lay.pos[n, j] == NB * BM
            else:
                p = lay.pos[n, j]
                assert lay.rows[p] == n and lay.block_group[p // BM] == ids[n, j]
    for e in range(E):
        held = int((ids == e).sum())
        assert lay.block_end[e] - lay.block_start[e] == -(-held // BM)
    assert (lay.rows >= 0).sum() == (ids < E).sum()


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("gathered", [False, True])
def test_gmm_is_each_blocks_product(rng, gathered, transpose):
    R, K, E, D, N = int(rng.integers(20, 50)), 2, 4, 48, 64
    ids = jnp.asarray(draw(rng, R, K, E, D, N)[1])
    lay = jax.device_get(re_lib.blocked_layout(ids, E, TILES.block_m))
    M = lay.rows.shape[0]
    x = rng.normal(size=(R if gathered else M, D)).astype(np.float32)
    w = rng.normal(size=(E, D, N)).astype(np.float32)
    rhs = np.swapaxes(w, 1, 2).copy() if transpose else w
    out = np.asarray(gk.gmm(jnp.asarray(x), jnp.asarray(rhs), jnp.asarray(lay.block_group),
                            jnp.asarray(lay.rows) if gathered else None,
                            transpose_rhs=transpose, tiles=TILES))
    want = np.zeros((M, N))
    for p in range(M):
        g = lay.block_group[p // TILES.block_m]
        src = (x[lay.rows[p]] if lay.rows[p] >= 0 else 0 * x[0]) if gathered else x[p]
        if g >= 0:
            want[p] = src.astype(np.float64) @ w[g]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_wgrad_sums_each_experts_rows(rng):
    R, K, E, D, N = int(rng.integers(20, 50)), 3, 4, 32, 48
    ids = jnp.asarray(draw(rng, R, K, E, D, N)[1])
    lay = jax.device_get(re_lib.blocked_layout(ids, E, TILES.block_m))
    M = lay.rows.shape[0]
    a = rng.normal(size=(R, D)).astype(np.float32)
    b = rng.normal(size=(M, N)).astype(np.float32)
    out = np.asarray(gk.wgrad(jnp.asarray(a), jnp.asarray(b), jnp.asarray(lay.block_start),
                              jnp.asarray(lay.block_end), rows_a=jnp.asarray(lay.rows),
                              tiles=TILES))
    want = np.zeros((E, D, N))
    for p in range(M):
        if lay.rows[p] >= 0:
            want[lay.block_group[p // TILES.block_m]] += np.outer(a[lay.rows[p]], b[p])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_wgrad_adds_into_an_accumulator_it_overwrites(rng, dtype):
    """wgrad(acc=...) = acc + the groups' sums, rounded once to acc's dtype, the kernel's
    output aliased to acc; experts nobody chose keep acc as it was."""
    R, K, E, D, N = int(rng.integers(20, 50)), 3, 4, 32, 48
    ids = jnp.asarray(draw(rng, R, K, E, D, N)[1])
    lay = re_lib.blocked_layout(ids, E, TILES.block_m)
    M = lay.rows.shape[0]
    a = jnp.asarray(rng.normal(size=(M, D)), dtype)
    b = jnp.asarray(rng.normal(size=(R, N)), dtype)
    acc = jnp.asarray(rng.normal(size=(E, D, N)) * 10, dtype)
    want = (np.asarray(acc, np.float64) + np.asarray(gk.wgrad(
        a, b, lay.block_start, lay.block_end, rows_b=lay.rows, tiles=TILES), np.float64))
    fn = lambda acc: gk.wgrad(a, b, lay.block_start, lay.block_end, rows_b=lay.rows,
                              tiles=TILES, acc=acc)
    (call,) = [e for e in jax.make_jaxpr(fn)(acc).eqns if e.primitive.name == "pallas_call"]
    assert dict(call.params["input_output_aliases"]) == {len(call.invars) - 1: 0}
    out = jax.jit(fn, donate_argnums=0)(jnp.array(acc))
    assert out.dtype == dtype
    one_ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=one_ulp, atol=1e-4)
    nobody = np.setdiff1d(np.arange(E), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(out)[nobody], np.asarray(acc)[nobody])
    with pytest.raises(ValueError, match=r"acc must be \[G, K, N\]"):
        gk.wgrad(a, b, lay.block_start, lay.block_end, rows_b=lay.rows, tiles=TILES,
                 acc=acc[:, :, :-1])


def test_tiles_refuse_weight_gradient_steps_that_do_not_divide_the_block():
    for bad in (0, 48, 256):
        with pytest.raises(ValueError, match=rf"wgrad_block_m = {bad} must be a positive divisor "
                                             r"of block_m = 128"):
            gk.GmmTiles(block_m=128, wgrad_block_m=bad)
    assert gk.GmmTiles(block_m=128, wgrad_block_m=32).wgrad_block_m == 32


def test_gmm_refuses_more_row_blocks_than_cuda_allows_on_a_grid_axis():
    """On the GPU gmm's row blocks are the grid's second axis, which CUDA caps at 65,535: past
    it the error names the count and the tile to grow (shapes only, nothing runs)."""
    NB, K, N = 65_536, 32, 64
    tiles = gk.GmmTiles(block_m=16, block_n=32, block_k=16, warps=4, stages=1, wgrad_block_m=16)
    x = jax.ShapeDtypeStruct((NB * 16, K), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, K, N), jnp.bfloat16)
    groups = jax.ShapeDtypeStruct((NB,), jnp.int32)
    with pytest.raises(ValueError, match=r"gmm: 65536 row blocks of 16 exceed CUDA's 65535 .*"
                                         r"tiles\.block_m"):
        jax.eval_shape(lambda a, b, g: gk.gmm(a, b, g, tiles=tiles, interpret=False), x, w, groups)
    fits = jax.ShapeDtypeStruct((NB - 1,), jnp.int32)
    out = jax.eval_shape(lambda a, b, g: gk.gmm(a, b, g, tiles=tiles, interpret=False),
                         jax.ShapeDtypeStruct(((NB - 1) * 16, K), jnp.bfloat16), w, fits)
    assert out.shape == ((NB - 1) * 16, N)


def test_the_kernels_lower_for_the_gpu_with_a_groups_tiles_side_by_side():
    """Lowered for CUDA here (Triton, the gathered rows as masked loads: a form interpret mode
    lacks), with grids that run tiles reading the same rows side by side (CUDA's x, the first
    axis, moves fastest): gmm's is (column tiles, row blocks), the weight gradient's (K / BK,
    N / BN, G); the weight gradient with a running sum aliases its output to it."""
    E, R, D, N = 4, 40, 32, 64
    ids = jnp.asarray(np.random.default_rng(0).integers(0, E, (R, 2)).astype(np.int32))
    lay = re_lib.blocked_layout(ids, E, TILES.block_m)
    NB, M = lay.block_group.shape[0], lay.rows.shape[0]
    x, b = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((R, D), (M, N)))
    w = jax.ShapeDtypeStruct((E, D, N), jnp.bfloat16)

    def lowered(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered(lambda x, w, bg, r: gk.gmm(x, w, bg, r, tiles=TILES, interpret=False),
                   x, w, lay.block_group, lay.rows)
    assert f"grid_x = {N // TILES.block_n} : i32, grid_y = {NB} : i32, grid_z = 1" in text
    text = lowered(lambda x, b, s, e, r: gk.wgrad(x, b, s, e, rows_a=r, tiles=TILES,
                                                   interpret=False),
                   x, b, lay.block_start, lay.block_end, lay.rows)
    assert (f"grid_x = {D // TILES.wgrad_block_k} : i32, grid_y = "
            f"{N // TILES.wgrad_block_n} : i32, grid_z = {E}") in text
    # With a running sum: the Triton call writes its output over the sum's buffer.
    acc = jax.ShapeDtypeStruct((E, D, N), jnp.bfloat16)
    text = lowered(lambda x, b, s, e, r, acc: gk.wgrad(x, b, s, e, rows_a=r, tiles=TILES,
                                                        interpret=False, acc=acc),
                   x, b, lay.block_start, lay.block_end, lay.rows, acc)
    (call,) = [ln for ln in text.splitlines() if "xla.gpu.triton" in ln]
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<" in call


@pytest.mark.parametrize("remat", [False, True])
def test_blocked_equals_sorted_and_the_float64_definition(rng, remat):
    """Outputs and the gradients of x, the routing weights and both expert matrices."""
    R, K, E, D, F = int(rng.integers(20, 45)), 3, 5, 32, 16
    x, ids, w, wi, wo = draw(rng, R, K, E, D, F)
    dy = rng.normal(size=(R, D))
    args = [jnp.asarray(a, jnp.float32) for a in (x, w, wi, wo)]
    ids_j = jnp.asarray(ids)

    def loss(fn):
        return lambda x, w, wi, wo: jnp.sum(fn(x, ids_j, w, wi, wo) * dy)

    blocked = lambda *a: re_lib.routed_blocked(*a, tiles=TILES, remat=remat)
    sorted_ = lambda *a: re_lib.routed_sorted(*a, "xla")
    with jax.default_matmul_precision("highest"):
        y_b = np.asarray(jax.jit(blocked)(args[0], ids_j, *args[1:]))
        g_b = jax.grad(loss(blocked), argnums=(0, 1, 2, 3))(*args)
        g_s = jax.grad(loss(sorted_), argnums=(0, 1, 2, 3))(*args)
    want = routed_numpy(x, ids, w, wi, wo)
    np.testing.assert_allclose(y_b, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for name, a, b in zip(("x", "w", "wi", "wo"), g_b, g_s, strict=True):
        scale = np.abs(np.asarray(b)).max()
        assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-4 * scale, name


@pytest.mark.parametrize("remat", [False, True])
def test_blocked_with_sums_returns_each_sum_plus_the_gradient(rng, remat):
    """routed_blocked(sums=(S_i, S_o)): the same output, the same gradients of x and the
    routing weights, and S + dW for the expert matrices (the float64 sum of the gradient
    without sums and S); no gradient reaches the sums themselves."""
    R, K, E, D, F = int(rng.integers(20, 45)), 3, 5, 32, 16
    x, ids, w, wi, wo = draw(rng, R, K, E, D, F)
    dy = jnp.asarray(rng.normal(size=(R, D)), jnp.float32)
    args = [jnp.asarray(a, jnp.float32) for a in (x, w, wi, wo)]
    sums = (jnp.asarray(rng.normal(size=wi.shape), jnp.float32),
            jnp.asarray(rng.normal(size=wo.shape), jnp.float32))
    ids_j = jnp.asarray(ids)

    def loss(x, w, wi, wo, sums):
        y = re_lib.routed_blocked(x, ids_j, w, wi, wo, tiles=TILES, remat=remat, sums=sums)
        return jnp.sum(y * dy)

    with jax.default_matmul_precision("highest"):
        plain = jax.grad(loss, argnums=(0, 1, 2, 3))(*args, None)
        summed = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args, sums)
    for name, a, b in zip(("x", "w"), summed[:2], plain[:2], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    for name, a, b, s0 in zip(("wi", "wo"), summed[2:4], plain[2:4], sums, strict=True):
        want = np.asarray(b, np.float64) + np.asarray(s0, np.float64)
        np.testing.assert_allclose(np.asarray(a), want, rtol=1e-5, atol=1e-5, err_msg=name)
    assert all(not np.any(np.asarray(g)) for g in summed[4])


def test_blocked_in_bf16_is_near_float32(rng):
    R, K, E, D, F = 40, 2, 4, 32, 32
    x, ids, w, wi, wo = draw(rng, R, K, E, D, F)
    f32 = re_lib.routed_blocked(*(jnp.asarray(a, jnp.float32) if a is not ids else jnp.asarray(a)
                                  for a in (x, ids, w, wi, wo)), tiles=TILES)
    bf = re_lib.routed_blocked(jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids),
                               jnp.asarray(w, jnp.float32), jnp.asarray(wi, jnp.bfloat16),
                               jnp.asarray(wo, jnp.bfloat16), tiles=TILES)
    assert bf.dtype == jnp.float32
    err = float(jnp.abs(bf - f32).max() / jnp.abs(f32).max())
    assert err < 3e-2, err


# ---------------------------------------------------------------------------------------------
# bfloat16 training state
# ---------------------------------------------------------------------------------------------


def opt_cfg(**kw):
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict()
    add_training_defaults(c)
    c.opt.update(kw)
    return c


def test_bf16_moments_are_stored_in_bf16_and_update_like_float32(rng):
    params = {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(16,)), jnp.float32)}
    steps = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
             for _ in range(4)]
    outs = {}
    for dt in ("float32", "bfloat16"):
        tx, _ = optim.make_optimizer(opt_cfg(moments_dtype=dt, warmup_steps=0).opt, 10, params)
        state = tx.init(params)
        for grads in steps:
            updates, state = tx.update(grads, state, params)
        outs[dt] = (updates, state)
    moments = [x for x in jax.tree.leaves(outs["bfloat16"][1]) if x.ndim]
    assert moments and all(x.dtype == jnp.bfloat16 for x in moments)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(outs["float32"][1]) if x.ndim)
    for a, b in zip(jax.tree.leaves(outs["bfloat16"][0]), jax.tree.leaves(outs["float32"][0]),
                    strict=True):
        assert a.dtype == jnp.float32
        assert float(jnp.abs(a - b).max()) < 2e-2 * float(jnp.abs(b).max())


def test_state_dtype_fields_are_checked():
    with pytest.raises(ConfigError, match=r"config\.opt\.moments_dtype.*float16"):
        opt_spec(opt_cfg(moments_dtype="float16").opt)
    c = opt_cfg()
    c.train.grad_accum_dtype = "fp8"
    with pytest.raises(ConfigError, match=r"config\.train\.grad_accum_dtype.*fp8"):
        train_spec(c.train)


def test_low_copies_round_the_matrices_but_not_the_router_or_embedding():
    params = {"embed": {"embedding": jnp.ones((4, 8))}, "mlp": {"kernel": jnp.ones((8, 8))},
              "moe": {"router": {"kernel": jnp.ones((8, 4))}, "experts": {
                  "wi": jnp.ones((4, 8, 2, 4)), "wo": jnp.ones((4, 4, 8))}},
              "norm": {"scale": jnp.ones((8,))}}
    low = low_copies(params, jnp.bfloat16)
    dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(low)}
    assert dtypes == {"['embed']['embedding']": jnp.float32, "['mlp']['kernel']": jnp.bfloat16,
                      "['moe']['experts']['wi']": jnp.bfloat16,
                      "['moe']['experts']['wo']": jnp.bfloat16,
                      "['moe']['router']['kernel']": jnp.float32,
                      "['norm']['scale']": jnp.float32}
