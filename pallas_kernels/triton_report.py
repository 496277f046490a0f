"""Resource report of the Pallas-Triton KDA kernels for sm_90, on a machine without a GPU.

    pip install --target /tmp/tsite triton==3.6.0          # once, outside the project venv
    PYTHONPATH=/tmp/tsite:. python -m pallas_kernels.triton_report [--tune bk=16] [--safe] \
        [--dim 64]

Pallas lowers each kernel to Triton IR in Python (no GPU needed); Triton then compiles it for
sm_90 and ptxas reports registers and spills. Per kernel this prints shared memory (the H200
allows 227 KB per block), registers per thread and spill bytes: what decides occupancy and
whether a launch fits, without spending device time. The GPU runs JAX's own bundled Triton,
so numbers can differ a little from what runs there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as triton_lowering

from pallas_kernels import kda as pk

# The card the report is for (sm_90): its default launch parameters are the starting point.
DEVICE_KIND = "NVIDIA H200"


def dump_ttir(outdir: str, tuning: pk.KernelTuning, *, B=1, T=256, H=16, D=128, lower_bound=-5.0,
              segments=False):
    """Lower forward+backward for the GPU with ``tuning`` and write each kernel's Triton IR to
    outdir. Returns {kernel name: path}."""
    found = {}
    orig_lower = triton_lowering.lower_jaxpr_to_triton_module

    def lower(jaxpr, grid_mapping, *a, **kw):
        res = orig_lower(jaxpr, grid_mapping, *a, **kw)
        name = jaxpr.debug_info.func_name
        path = os.path.join(outdir, f"{name}.ttir")
        with open(path, "w") as f:
            f.write(res.module.operation.get_asm(enable_debug_info=False))
        found[name] = path
        return res

    triton_lowering.lower_jaxpr_to_triton_module = lower
    try:
        bf = jnp.bfloat16
        shape = (B, T, H, D)
        args = (jnp.zeros(shape, bf), jnp.zeros(shape, bf), jnp.zeros(shape, bf),
                jnp.zeros(shape, jnp.float32), jnp.zeros((B, T, H), bf))
        seg = jnp.zeros((B, T), jnp.int32) if segments else None

        def loss(q, k, v, g, beta):
            o, _ = pk.kda_pallas(q, k, v, g, beta, scale=D ** -0.5, initial_state=None,
                                 segment_ids=seg, chunk_size=64, lower_bound=lower_bound,
                                 backend="gpu", tuning=tuning)
            return jnp.sum(o.astype(jnp.float32))

        jax.jit(jax.grad(loss, argnums=range(5))).trace(*args).lower(
            lowering_platforms=("cuda",))
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = orig_lower
    return found


def launch_params(name: str, t: pk.KernelTuning) -> tuple[int, int]:
    """(warps, stages) of kernel ``name`` under tuning ``t``, as kda_calls launches it."""
    return {"kda_intra_fwd": (t.warps_intra, t.stages_intra),
            "kda_state_fwd": (t.warps_seq, t.stages_seq),
            "kda_state_bwd": (t.warps_seq, t.stages_seq),
            "kda_intra_bwd_scores": (t.warps_grad, t.stages_intra),
            "kda_intra_bwd_channels": (t.warps_chan, t.stages_intra)}[name]


def report(path: str, warps: int, stages: int) -> str:
    # Optional: the triton package is not a project dependency (see the module docstring).
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    ptx = path + ".ptx"
    with open(ptx, "w") as f:
        f.write(kernel.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    regs = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if "registers" in ln]
    spills = [ln.strip() for ln in out.splitlines() if "spill" in ln]
    return (f"warps={warps} stages={stages} shared={kernel.metadata.shared / 1024:.0f} KB | "
            f"{'; '.join(regs)} | {'; '.join(spills)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", default="",
                    help=f"launch parameters changed from {DEVICE_KIND}'s defaults, e.g. "
                         "bk=16,warps_grad=4 (pallas_kernels.kda.KernelTuning)")
    ap.add_argument("--safe", action="store_true", help="unbounded-gate path")
    ap.add_argument("--segments", action="store_true", help="packed-segment variant")
    ap.add_argument("--dim", type=int, default=128,
                    help="head dim K = V (configs/small.py's heads are 64)")
    args = ap.parse_args(argv)
    if args.dim < 1:
        ap.error(f"--dim: the head dim must be >= 1, got {args.dim}")
    tuning = pk.KernelTuning.parse(args.tune, base=pk.default_tuning(DEVICE_KIND), source="--tune")
    print(f"tuning: {tuning}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        found = dump_ttir(tmp, tuning, D=args.dim, lower_bound=None if args.safe else -5.0,
                          segments=args.segments)
        for name, path in sorted(found.items()):
            print(f"{name}: {report(path, *launch_params(name, tuning))}", flush=True)


if __name__ == "__main__":
    main()
