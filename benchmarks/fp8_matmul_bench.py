r"""The FP8 products alone against the bf16 ones, at configs/1b.py's projection shapes (#59).

    python benchmarks/fp8_matmul_bench.py                # a Hopper GPU: the table on stdout
    python benchmarks/fp8_matmul_bench.py --smoke        # CPU, toy sizes (the tests run this)

For each product x [M, K] @ W [K, N] (M tokens of one micro-batch, W a float32 master weight
as the model holds it), four functions, each jitted alone and timed by ``benchmarks/timing.py``:

    bf16        ``layers.dense.low_precision_einsum``: x and W rounded to bf16, a bf16 result
    fp8         ``layers.dense.fp8_einsum``: x and W quantised to E4M3 with per-tensor scales
                (Qwix), the scaled FP8 product
    quantise    the two quantisations alone (their amax reductions and casts): fp8's overhead
    fp8 GEMM    the product of already quantised operands alone: what the card's FP8 units
                give once the quantisation is paid

forward, and forward + backward (the loss sum(y * dy) for a fixed random dy: dx and dW, fp8's
dy quantised to E5M2). Beside each time: TFLOP/s (2 M K N per product, 3 products forward +
backward) and fp8's ratio to bf16. The last column says whether XLA made every FP8 product a
cuBLASLt FP8 GEMM (a ``__cublas$lt$matmul$f8`` custom call in the compiled program) and how
many transposes or copies of f8 operands the program holds.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks import timing
from kimi_k3.layers import dense

# configs/1b.py: KDA's q/k/v and out (2048 -> 2048), the MLP's gate+up (2048 -> 2 x 5632) and
# down (5632 -> 2048), at 2 rows x 4096 tokens (the planner's micro-batch at 8 rows).
SHAPES = ((8192, 2048, 2048), (8192, 2048, 11264), (8192, 5632, 2048))
SMOKE_SHAPES = ((64, 48, 32),)
F8_GEMM = "__cublas$lt$matmul$f8"


def functions():
    """{name: (forward fn(x, w), whether it is an FP8 path)}."""
    def bf16(x, w):
        return dense.low_precision_einsum(1, 1, jnp.bfloat16, x, w)

    def fp8(x, w):
        return dense.fp8_einsum("mk,kn->mn", x, w)

    def quantise(x, w):
        xq, wq = dense.quantize(x, dense.E4M3), dense.quantize(w, dense.E4M3)
        return xq.qvalue, wq.qvalue, xq.scale, wq.scale

    def fp8_gemm(xq, wq, sx, sw):
        y = jnp.einsum("mk,kn->mn", xq, wq, preferred_element_type=jnp.bfloat16)
        return y * (sx * sw).reshape(()).astype(jnp.bfloat16)

    return {"bf16": bf16, "fp8": fp8, "quantise": quantise, "fp8 GEMM": fp8_gemm}


def with_backward(fn):
    """fn's forward and backward: sum(fn(x, w) * dy) and its gradients in x and w (the value
    keeps the forward product, which the gradients alone would not need)."""
    def loss(x, w, dy):
        return jnp.sum(fn(x, w).astype(jnp.float32) * dy)
    return jax.value_and_grad(loss, argnums=(0, 1))


def hlo_notes(compiled) -> str:
    """FP8 GEMMs, other products and f8 copies/transposes in a compiled program."""
    text = compiled.as_text()
    f8_gemms = text.count(F8_GEMM)
    gemms = len(re.findall(r"custom_call_target=\"__cublas\$(?:lt\$)?(?:matmul|gemm)", text))
    f8_moves = len(re.findall(r"= f8e\w+\[[^\]]*\]\S* (?:transpose|copy)\(", text))
    dots = len(re.findall(r" dot\(", text))  # products XLA left as plain dots (not library calls)
    return f"{f8_gemms} FP8 of {gemms} GEMMs, {dots} other dots, {f8_moves} f8 copies"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, toy sizes")
    p.add_argument("--budget_s", type=float, default=2.0, help="seconds per timing")
    args = p.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    fns = functions()
    key = jax.random.key(0)
    lines = [f"Device: {jax.devices()[0].device_kind}, JAX {jax.__version__}", "",
             "| M x K x N | pass | bf16 ms | fp8 ms (x bf16) | quantise ms | fp8 GEMM ms | "
             "bf16 / fp8 GEMM TFLOP/s | fp8's program |", "|---|---|---|---|---|---|---|---|"]
    for M, K, N in shapes:
        kx, kw, kd = jax.random.split(jax.random.fold_in(key, M * K + N), 3)
        x = jax.random.normal(kx, (M, K), jnp.bfloat16)
        w = jax.random.normal(kw, (K, N), jnp.float32) * K ** -0.5
        dy = jax.random.normal(kd, (M, N), jnp.float32)
        xq, wq, sx, sw = jax.jit(fns["quantise"])(x, w)
        for pass_ in ("forward", "forward + backward"):
            back = pass_ != "forward"
            ms, notes = {}, ""
            for name, fn in fns.items():
                if name == "fp8 GEMM":
                    if back:
                        ms[name] = None
                        continue
                    f, a = jax.jit(fn), (xq, wq, sx, sw)
                elif name == "quantise":
                    f, a = jax.jit(fn), (x, w)
                else:
                    f = jax.jit(with_backward(fn) if back else fn)
                    a = (x, w, dy) if back else (x, w)
                compiled, _ = timing.compile_jax(f, *a)
                if name == "fp8":
                    notes = hlo_notes(compiled)
                ms[name] = timing.time_jax(compiled, *a, budget_s=args.budget_s).ms
            flops = 2 * M * K * N * (3 if back else 1)
            gemm = ms["fp8 GEMM"]
            def f(ms_):
                return "" if ms_ is None else f"{ms_:.4g}"
            lines.append(
                f"| {M} x {K} x {N} | {pass_} | {f(ms['bf16'])} | {f(ms['fp8'])} "
                f"({ms['bf16'] / ms['fp8']:.2f}x) | {f(ms['quantise'])} | {f(gemm)} | "
                f"{flops / ms['bf16'] / 1e9:.0f} / "
                f"{'' if gemm is None else f'{M * K * N * 2 / gemm / 1e9:.0f}'} | {notes} |")
    out = "\n".join(lines)
    print(out)
    return out


if __name__ == "__main__":
    main()
