"""One KDA forward or forward+backward inside a profiler window, for Nsight Compute's counters
per kernel (ours, fla or jla; the inputs of benchmarks/kda_kernel.py).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section LaunchStats --section Occupancy -o ours \
        python3 benchmarks/kda_profile.py --impl ours --shape 8x4096
    ncu --import ours.ncu-rep --page details          # per kernel: time, registers, occupancy
    python3 benchmarks/kda_profile.py --tune "stages_intra=2;bv_seq=128"  # a window each (*)
    python3 benchmarks/kda_profile.py --impl ours --smoke   # CPU: the window opens and closes
    python3 benchmarks/kda_profile.py --impl fla --fla_tuning fla.tgz  # fla's tuning from a .tgz

The function runs twice first (compilation, fla's autotuning), then ``--reps`` times between
cuProfilerStart and cuProfilerStop, so the report holds the kernels of those calls alone, XLA's
own (layout changes, casts, reductions) with ours. "ours" is ``impl="pallas"`` with the
default launch parameters (--tune changes them, as in kda_kernel.py).

(*) Under ncu a second window in the same process once ended in a segmentation fault, where
the same launch parameters profiled alone did not; kda_ncu.sh's sweep therefore runs one
process per --tune value.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import kda_kernel as kk
from benchmarks import timing
from pallas_kernels.tuning import KernelTuning

IMPLS = ("ours", "ours_gate", "jla", "fla")


class ProfilerWindow:
    """cuProfilerStart / cuProfilerStop of the CUDA driver, on the device's primary context
    (the one JAX and PyTorch use). Without a CUDA driver (CPU) both do nothing."""

    def __init__(self):
        try:
            self.cuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            self.cuda = None
            return
        ctx = ctypes.c_void_p()
        self.cuda.cuCtxGetCurrent(ctypes.byref(ctx))
        if not ctx.value:  # JAX leaves no context current on this thread: take the primary one
            device = ctypes.c_int()
            self._check(self.cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
            self._check(self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
                        "cuDevicePrimaryCtxRetain")
            self._check(self.cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def _check(result: int, what: str):
        if result != 0:
            raise RuntimeError(f"{what} returned CUDA error {result}")

    def __enter__(self):
        if self.cuda is not None:
            self._check(self.cuda.cuProfilerStart(), "cuProfilerStart")
        return self

    def __exit__(self, *exc):
        if self.cuda is not None:
            self._check(self.cuda.cuProfilerStop(), "cuProfilerStop")


def jax_step(impl: str, arrays, tuning, backward: bool):
    """A jitted call of ours (or jla) on ``arrays`` (kda_kernel.make_inputs): () -> outputs."""
    if impl == "jla":
        fwd = kk.jla_fwd()
        if fwd is None:
            raise SystemExit("jla is not importable here (carry jax-linear-attention's wheel)")
        args = arrays
    elif impl == "ours_gate":
        f, A_log, dt_bias = kk.gate_inputs(arrays)
        fwd = kk.ours_gate_in_kernel(tuning, A_log, dt_bias)
        args = (*arrays[:3], f, *arrays[4:])
    else:
        fwd = kk.ours_fwd(tuning)
        args = arrays
    fn_fwd, fn_fwdbwd = kk.jax_fns(fwd)
    if backward:
        return lambda: fn_fwdbwd(*args)
    return lambda: fn_fwd(*args[:5])


def fla_step(arrays, backward: bool):
    """fla's chunk_kda on the same buffers (PyTorch): (() -> outputs, sync)."""
    fwd, fwdbwd = kk.fla_fns(arrays)
    return (fwdbwd if backward else fwd), timing.torch_sync


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=IMPLS, default="ours")
    ap.add_argument("--shape", default="8x4096", choices=sorted(kk.SHAPES))
    ap.add_argument("--forward", action="store_true", help="the forward alone")
    ap.add_argument("--reps", type=int, default=1, help="calls inside the window")
    ap.add_argument("--tune", default="",
                    help="KernelTuning changes, as kda_kernel.py's; several separated by ';' "
                         "are profiled one after the other, each in its own window")
    ap.add_argument("--fla_tuning", default="",
                    help="fla's autotuning results (.tgz, kda_kernel.py's --fla_tuning): fla's "
                         "warm-up then skips autotuning, which under ncu takes minutes")
    ap.add_argument("--smoke", action="store_true",
                    help="the smoke shape (on CPU the kernels run in interpret mode)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    if args.fla_tuning:
        if not Path(args.fla_tuning).is_file():  # kda_kernel.py would create it; this only reads
            ap.error(f"--fla_tuning: no file {args.fla_tuning!r} (a .tgz of fla's autotuning "
                     "results, e.g. benchmarks/results/fla_autotune_h200.tgz)")
        kk.restore_fla_tuning(args.fla_tuning)
    shape = "smoke" if args.smoke else args.shape
    B, T, H, D = kk.SHAPES[shape]
    arrays = kk.make_inputs(B, T, H, D)
    try:
        tunings = [(spec, KernelTuning.parse(spec, source="--tune"))
                   for spec in args.tune.split(";")]
    except ValueError as err:
        ap.error(str(err))
    if args.impl == "fla" and len(tunings) > 1:
        ap.error("--tune takes one value for fla (it has no KernelTuning)")
    for window, (spec, tuning) in enumerate(tunings):
        if args.impl == "fla":
            step, sync = fla_step(arrays, not args.forward)
        else:
            step = jax_step(args.impl, arrays, tuning, not args.forward)
            sync = timing.jax_sync
        for _ in range(timing.WARMUP):  # compile, autotune, warm up (as the timer does)
            timing.first_call(step, sync=sync)
        with ProfilerWindow():
            for _ in range(args.reps):
                out = step()
            sync(out)
        print(f"window {window}: {args.reps} call(s), {args.impl}, {shape}, "
              f"{'forward' if args.forward else 'forward+backward'}, tune {spec or 'defaults'!r}",
              flush=True)


if __name__ == "__main__":
    main()
