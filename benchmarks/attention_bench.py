r"""Causal attention over packed documents, forward + backward: each implementation checked
against the blockwise "xla" path and timed, at the MLA layer's training shapes.

    python benchmarks/attention_bench.py                       # configs/1b.py's MLA: 8 x 4096
    python benchmarks/attention_bench.py --batch=2 --seq=1024 --impls=xla,reference   # CPU

Heads 16, query/key head dim 192 (128 + 64 shared), value head dim 128, bf16 on GPU, documents
of random lengths packed into each row. Prints, per implementation, the relative error of the
output and of dq, dk, dv against "xla", and the median forward and forward+backward times
(benchmarks/timing.py); ``IMPL:rows``
times IMPL with one document per row instead (no segment masks), for what the masks cost;
``cudnn:mask`` is cuDNN with the documents as a [B, 1, T, T] mask instead of its packed layout;
``cudnn:runs=N`` is the packed layout with room for N documents per row only (the model takes
the smallest room of ``PACKED_RUNS_PER_ROW`` that fits; cuDNN's backward keeps a float32 dq
accumulator for B x N sequences of T tokens, so N sets its size).

    python benchmarks/attention_bench.py --batch=4 --doc_len=5000 \
        --impls=cudnn,cudnn:runs=4,cudnn:runs=8,cudnn:rows      # the 1B step's rows: 1-2 docs
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
from kimi_k3.layers.attention import attention

# The module itself (kimi_k3.layers re-exports the function under the module's name).
attention_module = sys.modules[attention.__module__]


def packed_segments(rng, B: int, T: int, mean_len: int) -> np.ndarray:
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        t, s = 0, 0
        while t < T:
            n = int(rng.integers(1, 2 * mean_len))
            out[b, t:t + n] = s
            t, s = t + n, s + 1
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--doc_len", type=int, default=1500, help="mean document length")
    ap.add_argument("--impls", default="xla,pallas,cudnn")
    ap.add_argument("--qk_dim", type=int, default=192, help="query/key head dim (MLA: 192)")
    ap.add_argument("--v_dim", type=int, default=128, help="value head dim (MLA: 128)")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    B, T, H = a.batch, a.seq, a.heads
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    Dk, Dv = a.qk_dim, a.v_dim
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, Dk)), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, Dv)), dtype)
    seg = jnp.asarray(packed_segments(rng, B, T, a.doc_len))
    w = jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.float32)
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: B={B} T={T} H={H} "
          f"head dims {Dk}/{Dv}, "
          f"{int(seg.max()) + 1} documents in row 0", flush=True)

    def make(name):
        # "<impl>:rows" times one document per row (no segment ids): what the masks cost.
        impl, _, variant = name.partition(":")
        s = None if variant == "rows" else seg

        def loss(q, k, v):
            o = attention(q, k, v, scale=Dk ** -0.5, segment_ids=s, impl=impl)
            return jnp.sum(o.astype(jnp.float32) * w)
        fwd = jax.jit(lambda q, k, v: attention(q, k, v, scale=Dk ** -0.5, segment_ids=s,
                                                impl=impl))
        return fwd, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    ref_o, (_, ref_g) = None, (None, None)
    packed_default = attention_module.PACKED_RUNS_PER_ROW
    print("| impl | fwd ms | fwd+bwd ms | err o | err dq | err dk | err dv |")
    print("|---|---|---|---|---|---|---|")
    for impl in a.impls.split(","):
        fwd, both = make(impl)
        # Read while tracing (the first calls below): the mask instead of the packed layout.
        variant = impl.partition(":")[2]
        attention_module.PACKED_RUNS_PER_ROW = (
            () if variant == "mask" else
            (int(variant.removeprefix("runs=")),) if variant.startswith("runs=")
            else packed_default)
        try:
            o = fwd(q, k, v)
            _, g = both(q, k, v)
            t_f, t_b = timing.time_jax(fwd, q, k, v).ms, timing.time_jax(both, q, k, v).ms
        except Exception as err:  # a kernel this machine cannot run
            print(f"| {impl} | failed: {str(err).splitlines()[0][:120]} |||||")
            continue
        if ref_o is None:
            ref_o, ref_g = o, g
        if impl.endswith(":rows"):  # another function: timed, not compared
            print(f"| {impl} | {t_f:.2f} | {t_b:.2f} | (one document per row) ||||", flush=True)
            continue
        errs = [rel(o, ref_o)] + [rel(x, y) for x, y in zip(g, ref_g, strict=True)]
        print(f"| {impl} | {t_f:.2f} | {t_b:.2f} | " + " | ".join(f"{e:.1e}" for e in errs)
              + " |", flush=True)


if __name__ == "__main__":
    main()
