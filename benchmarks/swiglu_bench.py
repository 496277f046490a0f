r"""The SwiGLU activation's backward pass: XLA's fusion against pallas_kernels/swiglu.py.

    python benchmarks/swiglu_bench.py                            # configs/1b.py: 4 x 4096, F 5632
    python benchmarks/swiglu_bench.py --tokens=256 --width=512   # CPU (interpret mode: slow)
    python benchmarks/swiglu_bench.py --tiles="16,256,4;32,256,8"

Rows timed (the gradient of y = SiLU(h[:, 0]) * h[:, 1] for a given dy, h [N, 2, F]):

    copy        dh = c * h: one pass over h, the floor for writing dh.
    xla         ``jax.vjp`` of the layer's form, as XLA fuses it.
    pallas      ``swiglu_backward`` with the default tiles.
    BN,BF,warps the kernel with other launch parameters (SwigluTiles).

bf16 on the GPU. Prints the median ms (benchmarks/timing.py), the bandwidth that means for the
tensors the backward must move (h and dy in, dh out) and the largest error against ``xla``
relative to its largest element.
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
from pallas_kernels import swiglu as kernels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4 * 4096)
    ap.add_argument("--width", type=int, default=5632)
    ap.add_argument("--tiles", default="", help="launch parameters besides the default, "
                                                "'BN,BF,warps;...'")
    a = ap.parse_args(argv)
    N, F = a.tokens, a.width
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    h = jnp.asarray(rng.normal(size=(N, 2, F)), dtype)
    dy = jnp.asarray(rng.normal(size=(N, F)), dtype)

    def xla_bwd(h, dy):
        return jax.vjp(kernels.swiglu_reference, h)[1](dy)[0]

    rows = {"copy": jax.jit(lambda h, dy: h * jnp.asarray(1.5, h.dtype)), "xla": jax.jit(xla_bwd),
            "pallas": jax.jit(kernels.swiglu_backward)}
    for spec in filter(None, a.tiles.split(";")):
        tiles = kernels.SwigluTiles(*(int(v) for v in spec.split(",")))
        rows[spec] = jax.jit(lambda h, dy, t=tiles: kernels.swiglu_backward(h, dy, tiles=t))
    moved = 5 * N * F * jnp.dtype(dtype).itemsize  # h (2F) and dy (F) in, dh (2F) out
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: N={N}, F={F}, "
          f"{jnp.dtype(dtype).name}, default tiles {kernels.DEFAULT_TILES}\n")
    print("| form | backward ms | GB/s | largest error |")
    print("|---|---|---|---|")
    want = np.asarray(rows["xla"](h, dy), np.float32)
    for name, fn in rows.items():
        got = np.asarray(fn(h, dy), np.float32)
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        ms = timing.time_jax(fn, h, dy).ms
        print(f"| {name} | {ms:.3f} | {moved / ms / 1e6:.0f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
