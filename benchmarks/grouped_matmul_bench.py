r"""The grouped matmul of ``kimi_k3.ops.grouped_matmul`` alone: each implementation at the MoE
layer's shapes, forward and forward + backward, against a batched einsum of the same FLOPs
(every group the same size: the ceiling a grouped matmul can reach).

    python benchmarks/grouped_matmul_bench.py                       # configs/moe_1b.py's shapes
    python benchmarks/grouped_matmul_bench.py --rows=32768,262144 --impls=mosaic_gpu,xla

Rows A are the token-expert assignments (tokens x top-k), split over G groups at random (some
empty); K x N is one expert matrix (2048 x 1024 is moe_1b's input projection, gate and up).
Compilation and run times (benchmarks/timing.py: median ms per call) are printed per row as
they finish (a slow compile shows itself).
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
from kimi_k3.ops.grouped_matmul import GROUPED_MATMULS, grouped_matmul


def bench(impl: str, A: int, G: int, K: int, N: int, reps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, A + 1, size=G - 1))
    sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts, [A]])), jnp.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k1, (A, K), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (G, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    dout = jax.random.normal(k3, (A, N), jnp.bfloat16)
    if impl == "einsum":  # equal groups: [G, A/G, K] x [G, K, N]
        def fwd(lhs, rhs):
            return jnp.einsum("gak,gkn->gan", lhs.reshape(G, A // G, K), rhs).reshape(A, N)
    else:
        def fwd(lhs, rhs):
            return grouped_matmul(lhs, rhs, sizes, impl)

    def both(lhs, rhs):
        out, vjp = jax.vjp(fwd, lhs, rhs)
        return out, vjp(dout)

    row = {"impl": impl, "rows": A, "groups": G, "K": K, "N": N}
    f, f_s = timing.compile_jax(jax.jit(fwd), lhs, rhs)
    b, b_s = timing.compile_jax(jax.jit(both), lhs, rhs)
    row["compile_s"] = f_s + b_s
    row["fwd_ms"] = timing.time_jax(f, lhs, rhs, batches=reps).ms
    row["fwd_bwd_ms"] = timing.time_jax(b, lhs, rhs, batches=reps).ms
    flops = 2 * A * K * N
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = 3 * flops / row["fwd_bwd_ms"] / 1e9
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32768,262144", help="assignments A, comma-separated")
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--shapes", default="2048x1024,512x2048", help="K x N of an expert matrix")
    ap.add_argument("--impls", default="mosaic_gpu,einsum",
                    help=f"of {','.join((*GROUPED_MATMULS, 'einsum'))}")
    ap.add_argument("--reps", type=int, default=5, help="timed batches of calls per row")
    a = ap.parse_args(argv)
    print(f"# grouped matmul: {jax.devices()[0].device_kind}, JAX {jax.__version__}\n")
    print("| impl | rows x groups | K x N | compile s | fwd ms | fwd TFLOP/s | fwd+bwd ms "
          "| fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        for A in (int(v) for v in a.rows.split(",")):
            for impl in a.impls.split(","):
                try:
                    r = bench(impl, A, a.groups, K, N, a.reps)
                    print(f"| {impl} | {A} x {a.groups} | {K} x {N} | {r['compile_s']:.1f} | "
                          f"{r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.2f} | "
                          f"{r['fwd_bwd_tflops']:.0f} |", flush=True)
                except Exception as err:  # the row says what went wrong
                    print(f"| {impl} | {A} x {a.groups} | {K} x {N} | failed: "
                          f"{type(err).__name__}: {str(err)[:200]} |", flush=True)


if __name__ == "__main__":
    main()
