"""Resource report of the Pallas-Triton kernels for sm_90, on a machine without a GPU.

    pip install --target /tmp/tsite triton==3.6.0          # once, outside the project venv
    PYTHONPATH=/tmp/tsite:. python -m pallas_kernels.triton_report [--tune bk=16] [--safe] \
        [--dim 64] [--gate_in_kernel] [--caps 200,168] [--sass]
    PYTHONPATH=/tmp/tsite:. python -m pallas_kernels.triton_report --depth_read 1x4/1x4x16 \
        [--dim 2048] [--sources 6]                      # the Attention Residual read kernels

Pallas lowers each kernel to Triton IR in Python (no GPU needed); Triton then compiles it for
sm_90 and ptxas reports registers and spills. Per kernel this prints shared memory (sm_90
allows 227 KB per block), registers per thread and spill bytes: what decides occupancy and
whether a launch fits, without spending device time. The GPU runs JAX's own bundled Triton,
so numbers can differ a little from what runs there.

ptxas takes up to 255 registers when it has them, so the count alone does not say how many a
kernel needs. ``--caps`` compiles it again under each register cap (a ``.maxnreg`` directive)
and prints the spills there: k programs of T threads fit on an SM only at 65536 / (k T)
registers or fewer. ``--sass`` counts the SASS instructions (nvdisasm) by kind, and those of
each loop body (a backward branch to its label) apart.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as triton_lowering

from pallas_kernels import depth_read
from pallas_kernels import kda as pk
from pallas_kernels.tuning import KernelTuning


def as_if_on_h200():
    """A context in which ``.lower(lowering_platforms=("cuda",))`` of Pallas' Triton kernels
    targets an H200 (sm_90) on a machine without a GPU. JAX 0.11 asks the abstract mesh's
    device which card to lower a Triton kernel for and, without one, the local device, which on
    a CPU machine fails ("No supported GPU devices found"); JAX 0.10 lowers for a generic card
    and ignores the device. Only the lowering belongs inside: under an abstract mesh, newer JAX
    refuses to run computations."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                         platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("card",), abstract_device=device))


def dump_ttir(outdir: str, tuning: KernelTuning, *, B=1, T=256, H=16, D=128, lower_bound=-5.0,
              segments=False, gate_in_kernel=False):
    """Lower forward+backward for the GPU with ``tuning`` and write each kernel's Triton IR to
    outdir (``gate_in_kernel``: g holds the gate's logits, the gate computed in intra_fwd).
    Returns {kernel name: path}."""
    found = {}
    undo = _capture_ttir(outdir, found)
    try:
        bf = jnp.bfloat16
        shape = (B, T, H, D)
        args = (jnp.zeros(shape, bf), jnp.zeros(shape, bf), jnp.zeros(shape, bf),
                jnp.zeros(shape, jnp.float32), jnp.zeros((B, T, H), bf))
        seg = jnp.zeros((B, T), jnp.int32) if segments else None
        gate = dict(A_log=jnp.zeros((H,)), dt_bias=jnp.zeros((H, D))) if gate_in_kernel else {}

        def loss(q, k, v, g, beta):
            o, _ = pk.kda_pallas(q, k, v, g, beta, scale=D ** -0.5, initial_state=None,
                                 segment_ids=seg, chunk_size=64, lower_bound=lower_bound,
                                 backend="gpu", tuning=tuning, **gate)
            return jnp.sum(o.astype(jnp.float32))

        with as_if_on_h200():
            jax.jit(jax.grad(loss, argnums=range(5))).trace(*args).lower(
                lowering_platforms=("cuda",))
    finally:
        undo()
    return found


def _capture_ttir(outdir: str, found: dict):
    """Wraps Pallas-Triton's lowering so each kernel's Triton IR is written to outdir (its path
    into ``found``); returns the function that undoes it."""
    orig_lower = triton_lowering.lower_jaxpr_to_triton_module

    def lower(jaxpr, grid_mapping, *a, **kw):
        res = orig_lower(jaxpr, grid_mapping, *a, **kw)
        path = os.path.join(outdir, f"{jaxpr.debug_info.func_name}.ttir")
        with open(path, "w") as f:
            f.write(res.module.operation.get_asm(enable_debug_info=False))
        found[jaxpr.debug_info.func_name] = path
        return res

    triton_lowering.lower_jaxpr_to_triton_module = lower
    return lambda: setattr(triton_lowering, "lower_jaxpr_to_triton_module", orig_lower)


def dump_depth_read_ttir(outdir: str, fwd, bwd, *, D=2048, n=6, M=256) -> dict:
    """The Attention Residual read + norm kernels (pallas_kernels.depth_read) for the GPU with
    ``fwd`` / ``bwd`` ReadTiles, n bf16 sources of width D: {kernel name: path}."""
    found = {}
    undo = _capture_ttir(outdir, found)
    try:
        bf = jnp.bfloat16
        sources = [jnp.zeros((M, D), bf)] * n
        rho = [jnp.zeros((M,), jnp.float32)] * n

        def both(sources, rho, w, g, dy):
            _, a = depth_read.read_norm_forward(sources, rho, w, g, eps=1e-6, out_dtype=bf,
                                                tiles=fwd, interpret=False)
            return depth_read.read_norm_backward(sources, rho, w, g, a, dy, eps=1e-6,
                                                 tiles=bwd, interpret=False)

        jax.jit(both).trace(sources, rho, jnp.zeros(D), jnp.zeros(D),
                            jnp.zeros((M, D), bf)).lower(lowering_platforms=("cuda",))
    finally:
        undo()
    return found


def launch_params(name: str, t: KernelTuning) -> tuple[int, int]:
    """(warps, stages) of kernel ``name`` under tuning ``t``, as kda_calls launches it."""
    return {"kda_intra_fwd": (t.warps_intra, t.stages_intra),
            "kda_state_fwd": (t.warps_seq, t.stages_seq),
            "kda_state_bwd": (t.warps_seq, t.stages_seq),
            "kda_intra_bwd_scores": (t.warps_grad, t.stages_intra),
            "kda_intra_bwd_channels": (t.warps_chan, t.stages_intra)}[name]


def _tool(name: str) -> str:
    # Optional: the triton package is not a project dependency (see the module docstring).
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)


def _ptxas(ptx: str, cubin: str = os.devnull) -> str:
    """ptxas -v's report (stderr) for the PTX file ``ptx``, for sm_90a."""
    return subprocess.run([_tool("ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin],
                          capture_output=True, text=True).stderr


def capped(ptx_text: str, warps: int, maxnreg: int) -> str:
    """The PTX with its kernel's registers capped at ``maxnreg`` (after its .reqntid)."""
    line = f".reqntid {32 * warps}"
    if line not in ptx_text:
        raise ValueError(f"no '{line}' in the PTX: cannot place .maxnreg")
    return ptx_text.replace(line, f"{line}\n.maxnreg {maxnreg}", 1)


_SASS_OP = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_SASS_BRA = re.compile(r"BRA\s+`?\((\.L_x_\d+)\)")


def sass_counts(sass: str) -> dict:
    """Instruction counts of nvdisasm output: {"all": n, "loops": [n of each loop body], kind:
    n} (kind: the opcode before its first dot, HGMMA, MUFU, BAR, ...). A loop body runs from a
    label to a later branch back to it."""
    ops, labels, loops = collections.Counter(), {}, []
    n = 0
    for line in sass.splitlines():
        if re.match(r"\.L_x_\d+:", line):
            labels[line.rstrip(":").strip()] = n
            continue
        m = _SASS_OP.match(line)
        if not m:
            continue
        n += 1
        ops[m.group(1).split(".")[0]] += 1
        b = _SASS_BRA.search(line)
        if b and b.group(1) in labels and n - labels[b.group(1)] > 1:  # not the end's BRA to self
            loops.append(n - labels[b.group(1)])
    return {"all": n, "loops": loops, **ops}


SASS_KINDS = ("HGMMA", "HMMA", "MUFU", "BAR", "LDG", "STG", "LDS", "STS", "LDSM", "LDL", "STL")


def report(path: str, warps: int, stages: int, caps=(), sass: bool = False) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    ptx = path + ".ptx"
    with open(ptx, "w") as f:
        f.write(kernel.asm["ptx"])
    out = _ptxas(ptx, path + ".cubin" if sass else os.devnull)
    regs = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if "registers" in ln]
    spills = [ln.strip() for ln in out.splitlines() if "spill" in ln]
    text = (f"warps={warps} stages={stages} shared={kernel.metadata.shared / 1024:.0f} KB | "
            f"{'; '.join(regs)} | {'; '.join(spills)}")
    for cap in caps:
        with open(f"{path}.{cap}.ptx", "w") as f:
            f.write(capped(kernel.asm["ptx"], warps, cap))
        out = _ptxas(f"{path}.{cap}.ptx")
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        text += f"\n    at most {cap} registers: spills {m.group(1)} B stored, {m.group(2)} B loaded"
    if sass:
        dis = subprocess.run([_tool("nvdisasm"), "-c", path + ".cubin"], capture_output=True,
                             text=True, check=True).stdout
        c = sass_counts(dis)
        text += (f"\n    SASS: {c['all']} instructions, loop bodies {c['loops']}; "
                 + ", ".join(f"{k} {c.get(k, 0)}" for k in SASS_KINDS))
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", default="",
                    help="launch parameters changed from the defaults, e.g. "
                         "bk=16,warps_grad=4 (pallas_kernels.tuning.KernelTuning)")
    ap.add_argument("--safe", action="store_true", help="unbounded-gate path")
    ap.add_argument("--segments", action="store_true", help="packed-segment variant")
    ap.add_argument("--gate_in_kernel", action="store_true",
                    help="g as the gate's logits, the gate computed in intra_fwd")
    ap.add_argument("--dim", type=int, default=None,
                    help="head dim K = V (default 128; configs/small.py's heads are 64), or "
                         "with --depth_read the model width (default 2048)")
    ap.add_argument("--depth_read", metavar="RxW/RxWxS", default=None,
                    help="report the Attention Residual read kernels instead, launched with R "
                         "rows at W warps (the backward's programs taking S steps)")
    ap.add_argument("--sources", type=int, default=6, help="sources per read (--depth_read)")
    ap.add_argument("--caps", default="",
                    help="comma list of register caps: the spills of each kernel under each")
    ap.add_argument("--sass", action="store_true",
                    help="count each kernel's SASS instructions by kind, loop bodies apart")
    args = ap.parse_args(argv)
    try:
        caps = [int(c) for c in args.caps.split(",") if c]
    except ValueError:
        caps = None
    if caps is None or any(not 16 <= c <= 255 for c in caps):
        ap.error(f"--caps: want register counts from 16 to 255 (e.g. 200,168), "
                 f"got {args.caps!r}")
    extra = dict(caps=caps, sass=args.sass)
    if args.dim is not None and args.dim < 1:
        ap.error(f"--dim: the head dim must be >= 1, got {args.dim}")
    if args.depth_read is not None:
        try:
            fwd, bwd = ([int(v) for v in part.split("x")] for part in args.depth_read.split("/"))
            fwd, bwd = depth_read.ReadTiles(*fwd[:2]), depth_read.ReadTiles(*bwd[:3])
        except (ValueError, TypeError):
            ap.error(f"--depth_read: want RxW/RxWxS (e.g. 1x4/1x4x16), got {args.depth_read!r}")
        if args.sources < 1:
            ap.error(f"--sources: a read has at least one source, got {args.sources}")
        with tempfile.TemporaryDirectory() as tmp:
            found = dump_depth_read_ttir(tmp, fwd, bwd, D=args.dim or 2048, n=args.sources)
            for name, path in sorted(found.items()):
                warps = fwd.warps if name.endswith("fwd") else bwd.warps
                print(f"{name}: {report(path, warps, 1, **extra)}", flush=True)
        return
    args.dim = args.dim or 128
    tuning = KernelTuning.parse(args.tune, source="--tune")
    print(f"tuning: {tuning}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        found = dump_ttir(tmp, tuning, D=args.dim, lower_bound=None if args.safe else -5.0,
                          segments=args.segments, gate_in_kernel=args.gate_in_kernel)
        for name, path in sorted(found.items()):
            print(f"{name}: {report(path, *launch_params(name, tuning), **extra)}", flush=True)


if __name__ == "__main__":
    main()
