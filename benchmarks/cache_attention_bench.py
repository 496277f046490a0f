r"""MLA's attention against its cache, one block at a time, on the GPU: which cuDNN form is fast.

    python benchmarks/cache_attention_bench.py              # the 1B MLA shapes, blocks of 64K
    python benchmarks/cache_attention_bench.py --smoke      # CPU, toy sizes ("xla" only)

Rows (batch 1, H heads, key/query head dim dn + ds, value head dim dv, T queries against S keys):

- ``causal T x T``: the piece against itself (what the whole-sequence forward runs per layer);
- ``none T x S``: a whole earlier block (no mask), with its log-sum-exp;
- ``padding T x S``: a block cut at pos (keys past kv_len masked), with its log-sum-exp;
- ``piece at pos``: ``cache_attention`` for one piece after ``--blocks`` earlier blocks: the
  expansion of every block from the latent, the blocks and their merging.

ms is the median per call (benchmarks/timing.py); TF/s counts the useful FLOPs, 2 H (dn + ds + dv)
per visible (query, key) pair.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing
from kimi_k3.layers.attention import attention_lse, cache_attention


def timed(f, *args, batches: int = 3) -> float:
    """Median seconds per call of ``f(*args)`` (benchmarks/timing.py, ``batches`` batches)."""
    return timing.time_jax(f, *args, batches=batches).seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dn", type=int, default=128)
    p.add_argument("--ds", type=int, default=64)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--rank", type=int, default=512, help="kv_lora_rank (the latent)")
    p.add_argument("--T", type=int, default=65536, help="queries per piece = keys per block")
    p.add_argument("--blocks", type=int, default=7, help="earlier blocks for 'piece at pos'")
    p.add_argument("--impl", default="cudnn")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.heads, a.dn, a.ds, a.dv, a.rank, a.T, a.blocks, a.impl = 2, 8, 4, 8, 16, 64, 2, "xla"
    H, T, Q, dv = a.heads, a.T, a.dn + a.ds, a.dv
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    rng = np.random.default_rng(0)

    def arr(*shape, scale=1.0):
        return jnp.asarray(rng.normal(size=shape) * scale, dtype)

    q, k, v = arr(1, T, H, Q, scale=Q ** -0.5), arr(1, T, H, Q), arr(1, T, H, dv)
    scale = Q ** -0.5
    flops_pair = 2 * H * (Q + dv)
    rows = []

    def row(name, seconds, pairs):
        rows.append((name, seconds * 1e3, pairs * flops_pair / seconds / 1e12))
        print(f"| {name} | {seconds * 1e3:.2f} | {rows[-1][2]:.1f} |", flush=True)

    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}, impl {a.impl}, H={H}, "
          f"head dims {Q}/{dv}, T={T}\n\n| block | ms | TF/s (useful) |\n|---|---|---|")
    for name, causal, kv_len in (("causal T x T", True, None), ("none T x S", False, None),
                                 ("padding T x S", False, T - T // 16)):
        f = jax.jit(lambda q, k, v, c=causal, n=kv_len: attention_lse(
            q, k, v, scale=scale, causal=c, kv_len=n, impl=a.impl))
        pairs = T * (T + 1) // 2 if causal else T * (kv_len or T)
        row(name, timed(f, q, k, v), pairs)

    L = a.rank + a.ds
    W_k, W_v = arr(a.rank, H, a.dn, scale=a.rank ** -0.5), arr(a.rank, H, dv, scale=a.rank ** -0.5)
    pos = a.blocks * T
    cache = arr(1, pos + T, L)

    def expand(e):
        c, ks = e[..., :a.rank], e[..., a.rank:]
        kn = jnp.einsum("bnr,rhd->bnhd", c, W_k)
        k = jnp.concatenate([kn, jnp.broadcast_to(ks[:, :, None], (*ks.shape[:2], H, a.ds))], -1)
        return k, jnp.einsum("bnr,rhd->bnhd", c, W_v)

    f = jax.jit(lambda q, c, p: cache_attention(q, c, p, expand, scale=scale, impl=a.impl))
    row(f"piece at pos {pos}", timed(f, q, cache, jnp.int32(pos)), T * pos + T * (T + 1) // 2)
    return rows


if __name__ == "__main__":
    main()
