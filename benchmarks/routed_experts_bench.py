r"""The routed experts alone (``kimi_k3.ops.routed_experts``): each implementation at a
mixture's shapes, forward and forward + backward, against the ceiling of equal-sized groups.

    python benchmarks/routed_experts_bench.py                    # configs/moe_1b.py's experts
    python benchmarks/routed_experts_bench.py --tokens=4096,8192 --impls=blocked,sorted_mosaic \
        --tiles=128,128,64,8,3 --tiles=64,128,64,4,4
    python benchmarks/routed_experts_bench.py --smoke            # CPU, tiny, seconds

N tokens each choose k of E experts (uniformly at random, or ``--skew``: expert e drawn with
weight 1 / (e + 1)), weights random; x [N, D] bf16, SwiGLU experts of width F. Implementations:

    blocked          the blocked layout and its Pallas kernels (``impl="blocked"``), per
                     ``--tiles`` (block_m, block_n, block_k, warps, stages)
    sorted_mosaic    sorted rows through the Hopper Mosaic GPU grouped matmul (GPU sm_90)
    sorted_xla       sorted rows through ``jax.lax.ragged_dot``
    capacity         the layer's capacity buffers (``moe.capacity_factor``, here
                     ``--capacity_factor``): each expert's first C = ceil(c N k / E) rows
                     gathered into [E, C, D], batched einsums, the rest dropped (not dropless:
                     what a padded layout on the einsums would cost; its check shows the drops)
    ceiling          the same FLOPs as batched einsums over E equal groups of N k / E rows
                     (no routing, no gathers): what a grouped matmul can at best reach

Useful FLOPs: 6 N k D F forward (two matmuls of 2F and F columns), three times that forward
and backward. Each row: compile seconds, ms (benchmarks/timing.py medians), TF/s, and the share
of the ceiling's time. Before timing, every implementation is checked against ``sorted_xla`` on
the same inputs (largest difference over the largest value, bf16). With ``--kernels`` the
blocked kernels are also timed one by one (``pallas_kernels.grouped_matmul``) against the
equal-group einsum of each, and on a Hopper GPU the same six products through the Mosaic GPU
kernels on the layout's rows (``mosaic_cases``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for benchmarks/

from benchmarks import timing
from kimi_k3.layers import moe as moe_lib
from kimi_k3.ops import grouped_matmul as go
from kimi_k3.ops import routed_experts as re_lib
from pallas_kernels import grouped_matmul as gk

IMPLS = ("blocked", "sorted_mosaic", "sorted_xla", "capacity", "ceiling")


def inputs(N, E, k, D, F, skew, seed=0):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) if skew else np.ones(E)
    p = p / p.sum()
    ids = np.stack([rng.choice(E, size=k, replace=False, p=p) for _ in range(N)]).astype(np.int32)
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (N, D), jnp.bfloat16)
    w = jax.random.uniform(ks[1], (N, k), jnp.float32)
    wi = (jax.random.normal(ks[2], (E, D, 2, F)) / np.sqrt(D)).astype(jnp.bfloat16)
    wo = (jax.random.normal(ks[3], (E, F, D)) / np.sqrt(F)).astype(jnp.bfloat16)
    return x, jnp.asarray(ids), w, wi, wo


def fn_for(impl: str, tiles: gk.GmmTiles, E: int, k: int, capacity_factor: float = 1.25):
    if impl == "capacity":
        def capacity(x, ids, w, wi, wo):
            C = -(-int(capacity_factor * x.shape[0] * k) // E)
            return moe_lib._with_capacity(x, ids, w, wi.astype(x.dtype), wo.astype(x.dtype),
                                          P=1, axes=(), capacity=C)[0]
        return capacity
    if impl == "blocked":
        return lambda x, ids, w, wi, wo: re_lib.routed_blocked(x, ids, w, wi, wo, tiles)
    if impl in ("sorted_mosaic", "sorted_xla"):
        matmul = "mosaic_gpu" if impl == "sorted_mosaic" else "xla"
        return lambda x, ids, w, wi, wo: re_lib.routed_sorted(x, ids, w, wi, wo, matmul)

    def ceiling(x, ids, w, wi, wo):  # E equal groups of the N k assignments, no routing
        N, D = x.shape
        F = wo.shape[1]
        xg = jnp.broadcast_to(x[None], (k, N, D)).reshape(E, N * k // E, D)
        h = jnp.einsum("ead,edf->eaf", xg, wi.reshape(E, D, 2 * F))
        a = jax.nn.silu(h[..., :F]) * h[..., F:]
        z = jnp.einsum("eaf,efd->ead", a, wo)
        return z.reshape(k, N, D).astype(jnp.float32).sum(0)
    return ceiling


def bench(impl, tiles, args_, reps, dy, capacity_factor=1.25):
    E, k = args_[3].shape[0], args_[1].shape[1]
    fwd = fn_for(impl, tiles, E, k, capacity_factor)

    def both(x, ids, w, wi, wo):
        out, vjp = jax.vjp(lambda x, w, wi, wo: fwd(x, ids, w, wi, wo), x, w, wi, wo)
        return out, vjp(dy)

    f, f_s = timing.compile_jax(jax.jit(fwd), *args_)
    b, b_s = timing.compile_jax(jax.jit(both), *args_)
    return {"compile_s": f_s + b_s, "fwd_ms": timing.time_jax(f, *args_, batches=reps).ms,
            "fwd_bwd_ms": timing.time_jax(b, *args_, batches=reps).ms}


def mosaic_cases(x, lay, wi2, wo, h, a, dy, BM):
    """The same six products through the Hopper Mosaic GPU kernels (``kimi_k3.ops.
    grouped_matmul``) on the blocked layout's rows, each expert's blocks one group (padding rows
    zero), the token rows gathered by XLA into the layout's order inside the timed call: what
    a layout that let Mosaic GPU take some of the products would cost."""
    A = lay.pos.size
    D, F = x.shape[1], wo.shape[1]
    sizes = ((lay.block_end - lay.block_start) * BM).astype(jnp.int32)
    rows = lambda m: jnp.take(m, lay.rows, axis=0, mode="fill", fill_value=0)
    return {
        "mosaic x->h (XLA gather)": (lambda: go.mosaic_products(rows(x), wi2, sizes), (A, D, 2 * F)),
        "mosaic a->z": (lambda: go.mosaic_products(a, wo, sizes), (A, F, D)),
        "mosaic dy->da (XLA gather)": (lambda: go.mosaic_products(rows(dy), wo, sizes,
                                                                  transpose_rhs=True), (A, D, F)),
        "mosaic dh->dx": (lambda: go.mosaic_products(h, wi2, sizes, transpose_rhs=True),
                          (A, 2 * F, D)),
        "mosaic wgrad x,dh->dWi (XLA gather)": (lambda: go.mosaic_weight_grad(rows(x), h, sizes),
                                                (A, D, 2 * F)),
        "mosaic wgrad a,dy->dWo (XLA gather)": (lambda: go.mosaic_weight_grad(a, rows(dy), sizes),
                                                (A, F, D)),
    }


def kernel_rows(x, ids, wi, wo, tiles, reps, which="all", ceilings=None):
    """The blocked kernels one by one at these shapes (all, or those whose name holds one of
    ``which``'s comma-separated texts; the Mosaic GPU ones only for "all" or a text naming
    "mosaic"), each against its equal-group einsum (timed once per shape into ``ceilings``)."""
    ceilings = {} if ceilings is None else ceilings
    N, D = x.shape
    E, _, _, F = wi.shape
    k = ids.shape[1]
    lay = re_lib.blocked_layout(ids, E, tiles.block_m)
    M = lay.rows.shape[0]
    A = N * k
    wi2 = wi.reshape(E, D, 2 * F)
    h = jnp.zeros((M, 2 * F), x.dtype) + 0.1
    a = jnp.zeros((M, F), x.dtype) + 0.1
    dy = x
    cases = {
        "gmm x->h (gathered)": (lambda: gk.gmm(x, wi2, lay.block_group, lay.rows, tiles=tiles),
                                (A, D, 2 * F)),
        "gmm a->z": (lambda: gk.gmm(a, wo, lay.block_group, tiles=tiles), (A, F, D)),
        "gmm_t dy->da (gathered)": (lambda: gk.gmm(dy, wo, lay.block_group, lay.rows,
                                                   transpose_rhs=True, tiles=tiles), (A, D, F)),
        "gmm_t dh->dx": (lambda: gk.gmm(h, wi2, lay.block_group, transpose_rhs=True,
                                        tiles=tiles), (A, 2 * F, D)),
        "wgrad x,dh->dWi": (lambda: gk.wgrad(x, h, lay.block_start, lay.block_end,
                                             rows_a=lay.rows, tiles=tiles), (A, D, 2 * F)),
        "wgrad a,dy->dWo": (lambda: gk.wgrad(a, dy, lay.block_start, lay.block_end,
                                             rows_b=lay.rows, tiles=tiles), (A, F, D)),
    }
    texts = which.split(",")
    mosaic = which == "all" or any("mosaic" in t for t in texts)
    if mosaic and go.mosaic_gpu_fits(D, F, x.dtype) is None and jax.default_backend() == "gpu":
        cases.update(mosaic_cases(x, lay, wi2, wo, h, a, dy, tiles.block_m))
    rows = []
    for name, (fn, (A_, K_, N_)) in cases.items():
        if which != "all" and not any(t in name for t in texts):
            continue
        try:
            f, _ = timing.compile_jax(jax.jit(fn))
            ms = timing.time_jax(f, batches=reps).ms
        except Exception as e:  # one kernel that does not run here must not stop the others
            rows.append(f"| {tile_label(tiles)} | {name} | failed: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160]} | | | |")
            continue
        if (A_, K_, N_) not in ceilings:
            lhs = jnp.zeros((E, A_ // E, K_), x.dtype) + 0.1
            rhs = jnp.zeros((E, K_, N_), x.dtype) + 0.1
            c, _ = timing.compile_jax(jax.jit(lambda l, r: jnp.einsum("eak,ekn->ean", l, r)),
                                      lhs, rhs)
            ceilings[A_, K_, N_] = timing.time_jax(c, lhs, rhs, batches=reps).ms
        cms = ceilings[A_, K_, N_]
        tf = 2 * A_ * K_ * N_ / ms / 1e9
        rows.append(f"| {tile_label(tiles)} | {name} | {ms:.3f} | {tf:.0f} | {cms:.3f} | "
                    f"{cms / ms:.2f} |")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,8192", help="N tokens, comma-separated")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top_k", type=int, default=8)
    ap.add_argument("--d_model", type=int, default=2048)
    ap.add_argument("--expert_dim", type=int, default=512)
    ap.add_argument("--impls", default="blocked,sorted_mosaic,ceiling",
                    help=f"of {','.join(IMPLS)}")
    ap.add_argument("--tiles", action="append", default=None,
                    help="block_m,block_n,block_k,warps,stages for 'blocked' (repeatable)")
    ap.add_argument("--capacity_factor", type=float, default=1.25,
                    help="'capacity': buffers of ceil(c N k / E) rows per expert")
    ap.add_argument("--skew", action="store_true", help="experts drawn with weight 1/(e+1)")
    ap.add_argument("--kernels", nargs="?", const="all", default="",
                    help="also time each blocked kernel (or those whose name holds one of these "
                         "comma-separated texts, e.g. gmm,wgrad; the Mosaic GPU ones only "
                         "for all or mosaic), for every --tiles")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU sizes: seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        a.tokens, a.experts, a.top_k, a.d_model, a.expert_dim = "64", 4, 2, 32, 32
        a.impls, a.reps, a.tiles = "blocked,sorted_xla,capacity,ceiling", 1, ["16,32,16,4,1"]
    if not a.capacity_factor > 0:
        ap.error(f"--capacity_factor: {a.capacity_factor} must be > 0 (buffers of ceil(c N k / E) "
                 f"rows per expert)")
    impls = a.impls.split(",")
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: {bad} not in {IMPLS}")
    tile_sets = [parse_tiles(t, ap) for t in a.tiles] if a.tiles else [gk.DEFAULT_TILES]
    E, k, D, F = a.experts, a.top_k, a.d_model, a.expert_dim
    print(f"routed experts: E={E} k={k} D={D} F={F} {'skewed' if a.skew else 'uniform'} "
          f"routing, bf16; {jax.devices()[0].device_kind}, JAX {jax.__version__}")
    print("| tokens | impl | tiles | max err | compile s | fwd ms | TF/s | fwd+bwd ms | TF/s | "
          "ceiling / this (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for N in map(int, a.tokens.split(",")):
        args_ = inputs(N, E, k, D, F, a.skew)
        dy = jax.random.normal(jax.random.key(9), (N, D), jnp.float32)
        ref = np.asarray(jax.jit(fn_for("sorted_xla", tile_sets[0], E, k))(*args_))
        flops = 6 * N * k * D * F
        runs = [(i, t) for i in impls for t in (tile_sets if i == "blocked" else [None])]
        results = []
        for impl, t in runs:
            try:
                out = np.asarray(jax.jit(fn_for(impl, t or tile_sets[0], E, k,
                                                a.capacity_factor))(*args_))
                err = (np.abs(out - ref).max() / np.abs(ref).max() if impl != "ceiling"
                       else float("nan"))
                r = bench(impl, t or tile_sets[0], args_, a.reps, dy, a.capacity_factor)
                results.append((impl, t, err, r))
            except Exception as e:  # one failing variant must not stop the others
                print(f"| {N} | {impl} | {t} | failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]} |", flush=True)
        ceil_ms = next((r["fwd_bwd_ms"] for i, _, _, r in results if i == "ceiling"), None)
        for impl, t, err, r in results:
            tiles = "" if t is None else tile_label(t)
            ratio = f"{ceil_ms / r['fwd_bwd_ms']:.2f}" if ceil_ms else ""
            print(f"| {N} | {impl} | {tiles} | {err:.1e} | {r['compile_s']:.1f} | "
                  f"{r['fwd_ms']:.3f} | {flops / r['fwd_ms'] / 1e9:.0f} | {r['fwd_bwd_ms']:.3f} | "
                  f"{3 * flops / r['fwd_bwd_ms'] / 1e9:.0f} | {ratio} |", flush=True)
        if a.kernels and "blocked" in impls:
            print(f"\nblocked kernels at N={N}:\n")
            print("| tiles | kernel | ms | TF/s | equal-group einsum ms | einsum / kernel |")
            print("|---|---|---|---|---|---|")
            ceilings = {}
            for t in tile_sets:
                try:
                    for line in kernel_rows(args_[0], args_[1], args_[3], args_[4], t, a.reps,
                                            a.kernels, ceilings):
                        print(line, flush=True)
                except Exception as e:  # a tile set that does not fit must not stop the others
                    print(f"| {tile_label(t)} | failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]} |", flush=True)
            print()


def parse_tiles(spec: str, ap) -> gk.GmmTiles:
    """``bm,bn,bk,warps,stages`` (the weight gradient's tiles alike), or those five then
    ``wgrad_bk,wgrad_bn,wgrad_warps,wgrad_stages`` and optionally ``wgrad_bm`` (the weight
    gradient's rows per step; bm when not given)."""
    v = [int(s) for s in spec.split(",")]
    if len(v) == 5:
        v += [v[1], v[1], v[3], v[4]]
    if len(v) == 9:
        v += [v[0]]
    if len(v) != 10:
        ap.error(f"--tiles={spec!r}: give 5, 9 or 10 comma-separated integers")
    try:
        return gk.GmmTiles(*v)
    except ValueError as e:
        ap.error(f"--tiles={spec!r}: {e}")


def tile_label(t: gk.GmmTiles) -> str:
    return (f"{t.block_m}x{t.block_n}x{t.block_k} w{t.warps} s{t.stages}; wgrad "
            f"{t.wgrad_block_k}x{t.wgrad_block_n} w{t.wgrad_warps} s{t.wgrad_stages} "
            f"by {t.wgrad_block_m} rows")


if __name__ == "__main__":
    main()
