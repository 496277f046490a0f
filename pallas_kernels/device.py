"""The one place that asks what the card is and which compiled kernels apply to it.

    dev = probe()            # the target platform's first device (below)
    dev = probe("gpu")       # a GPU as this JAX would compile for it (also on a CPU machine)
    target_platform()        # "tpu" while tracing under a TPU topology's mesh on a CPU machine
    memory_bytes(dev)        # a device's memory, a TPU topology's devices included
    dev.platform, dev.kind, dev.compute_capability      # "gpu", "NVIDIA H200", "9.0"
    dev.triton, dev.mosaic_gpu, dev.mosaic_tpu, dev.cudnn_lse
    dev.why_not("mosaic_gpu")                           # None, or one line saying why not
    dev.fp8_why_not()                                   # FP8 matrix units (sm_89+), or why not

Everything that depends on the card (``kimi_k3.dispatch``'s "auto", the KDA kernel's default
tuning, the Mosaic GPU kernels, the experts' grouped matmul, the MFU's peak) asks here and
nowhere else. Importing this module imports no kernel and no Pallas module; ``probe`` imports
Pallas lazily, to lower a one-dot kernel for the platform, and remembers its answer for the
process.

``probe(platform)`` for a platform other than the default backend's describes that platform
without a device: its kernels are those this JAX lowers for it (so a CPU machine can ask about
the GPU path, as the tests and the TPU compile checks do), but its ``kind`` is unknown and no
card-specific kernel (Mosaic GPU) applies.

The target platform is the platform a program is traced for: the platform of the devices of the
mesh in context (``jax.set_mesh``), else JAX's default backend. A program compiled ahead of
time for a TPU topology on a CPU machine (``kimi_k3.aot``) is traced under a mesh of that
topology's devices, so every choice made here (and in ``kimi_k3.dispatch``) is the TPU's, not
the host's.

A CPU machine with ``libtpu`` installed (the test extra installs it, to compile for TPUs ahead
of time) starts libtpu whenever JAX looks for its backends, and libtpu, finding no TPU and no
cloud metadata, prints a screen of warnings about its missing settings and takes a lock file
that no second process can then take. Importing this module gives it the settings of a single
host with no chip to guard (``settle_libtpu_without_a_tpu``), only where JAX found no TPU chip
on the machine, so commands on a CPU print only their own lines.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

PLATFORMS = ("cpu", "gpu", "tpu")
KERNEL_FAMILIES = ("triton", "mosaic_gpu", "mosaic_tpu", "cudnn_lse")


@dataclasses.dataclass(frozen=True)
class Device:
    """What one platform's device is, and which kernel families compile on it.

    platform: "cpu" | "gpu" | "tpu" (JAX's backend name). kind: ``jax.Device.device_kind``
    ("" when the platform was asked about without its device). compute_capability: CUDA's
    "major.minor" ("" off CUDA or without the device). lowering: the name
    ``lowering_platforms`` takes ("cuda", "rocm", "tpu", "cpu"). The booleans say which
    families compile here; ``why_not`` says why one does not.
    """

    platform: str
    kind: str
    compute_capability: str
    lowering: str
    triton: bool  # Pallas-Triton kernels lower for this GPU with this JAX
    mosaic_gpu: bool  # Pallas Mosaic GPU (wgmma, TMA) kernels: an sm_90 card, and this JAX's API
    mosaic_tpu: bool  # Pallas Mosaic TPU kernels lower with this JAX
    cudnn_lse: bool  # JAX's cuDNN attention entry that returns the float32 log-sum-exp
    reasons: tuple[tuple[str, str], ...] = ()  # (family, why it does not apply)

    @property
    def hopper(self) -> bool:
        """An NVIDIA card of compute capability 9.x (Hopper): wgmma and TMA exist on sm_90a
        only (Blackwell's sm_100 has tcgen05 instead, another kernel)."""
        return self.compute_capability.split(".")[0] == "9"

    def fp8_why_not(self) -> str | None:
        """None when this device multiplies FP8 (e4m3fn, e5m2) matrices on its matrix units, or
        may: an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell), or a
        CUDA GPU asked about without its device (the card is known when the program runs);
        else why not (one line)."""
        if self.platform != "gpu":
            return f"the backend is {self.platform!r}, not a GPU"
        if self.lowering != "cuda":
            return f"the GPU runs {self.lowering!r}, whose FP8 formats are not e4m3fn / e5m2"
        if not self.compute_capability:
            return None
        major, _, minor = self.compute_capability.partition(".")
        if (int(major), int(minor or 0)) < (8, 9):
            return (f"{self.kind} is sm_{self.compute_capability.replace('.', '')}; FP8 matrix "
                    f"units need sm_89 or later (Ada, Hopper)")
        return None

    def why_not(self, family: str) -> str | None:
        """None when ``family`` (one of KERNEL_FAMILIES) compiles here, else why not."""
        if family not in KERNEL_FAMILIES:
            raise ValueError(f"kernel family must be one of {KERNEL_FAMILIES}, got {family!r}")
        if getattr(self, family):
            return None
        return dict(self.reasons).get(family, f"{family} does not apply on {self.platform!r}")

    def describe(self) -> str:
        """One line: the card and the kernel families that compile on it."""
        families = [f for f in KERNEL_FAMILIES if getattr(self, f)]
        cc = f" (sm_{self.compute_capability.replace('.', '')})" if self.compute_capability else ""
        return (f"{self.platform}: {self.kind or 'no device'}{cc}; kernels: "
                f"{', '.join(families) or 'none compiled (XLA only)'}")


def target_platform() -> str:
    """The platform the program being traced is for: the platform of the devices of the mesh
    in context (its abstract device, which a TPU topology's mesh carries on a CPU machine too),
    else JAX's default backend. Callable inside ``jit`` and ``shard_map``."""
    mesh = jax.sharding.get_abstract_mesh()
    dev = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if dev is not None and dev.platform in PLATFORMS:
        return dev.platform
    return jax.default_backend()


def probe(platform: str | None = None) -> Device:
    """The ``Device`` of ``platform`` (default: ``target_platform()``), probed once per process.

    Never raises for a platform JAX knows: a family that cannot lower is reported as absent,
    with its reason in ``why_not``.
    """
    platform = platform or target_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"device: platform must be one of {PLATFORMS}, got {platform!r}")
    return _probe(platform)


@functools.cache
def _probe(platform: str) -> Device:
    return describe(platform, jax.devices(platform)[0] if platform == jax.default_backend()
                    else None)


def describe(platform: str, dev) -> Device:
    """The ``Device`` of ``platform`` given its first device ``dev`` (a ``jax.Device``, or None
    for the platform asked about without its device). ``probe`` is this on the real device,
    remembered; tests give it stand-in devices."""
    present = dev is not None
    kind = dev.device_kind if dev is not None else ""
    cc = str(getattr(dev, "compute_capability", "") or "") if platform == "gpu" else ""
    lowering = {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda"}[platform]
    if dev is not None and platform == "gpu":
        # JAX names both runtimes' backend "gpu"; the client's version string tells them apart
        version = str(getattr(dev.client, "platform_version", "")).lower()
        lowering = "rocm" if "rocm" in version or "hip" in version else "cuda"
    reasons = {}

    def family(name: str, why: str | None) -> bool:
        if why is not None:
            reasons[name] = why
        return why is None

    gpu = f"the backend is {platform!r}, not a GPU"
    triton = family("triton", gpu if platform != "gpu" else _lowering_error("triton", lowering))
    if platform != "gpu":
        why_mgpu = gpu
    elif lowering != "cuda":
        why_mgpu = f"Mosaic GPU kernels need CUDA, the GPU runs {lowering!r}"
    elif not present:
        why_mgpu = "no GPU device to ask its compute capability (a GPU asked about off the GPU)"
    elif cc.split(".")[0] != "9":
        why_mgpu = f"{kind} is sm_{cc.replace('.', '')}; the Mosaic GPU kernels need sm_90 (Hopper)"
    else:
        why_mgpu = _mosaic_gpu_api_error()
    mosaic_gpu = family("mosaic_gpu", why_mgpu)
    mosaic_tpu = family("mosaic_tpu", f"the backend is {platform!r}, not a TPU"
                        if platform != "tpu" else _lowering_error("mosaic_tpu", "tpu"))
    cudnn = family("cudnn_lse", gpu if platform != "gpu" else _cudnn_lse_error())
    return Device(platform=platform, kind=kind, compute_capability=cc, lowering=lowering,
                  triton=triton, mosaic_gpu=mosaic_gpu, mosaic_tpu=mosaic_tpu, cudnn_lse=cudnn,
                  reasons=tuple(sorted(reasons.items())))


def choices_key() -> tuple:
    """What a kernel's choices depend on besides its arguments: the target platform and the
    devices ``probe`` describes for it and for "gpu"."""
    platform = target_platform()
    return platform, probe(platform), probe("gpu")


def jit_per_choices(fn, static_argnums=(), static_argnames=()):
    """``fn`` jitted (static arguments as ``jax.jit`` takes them), its traces kept per
    ``choices_key()`` too: a program for another platform (a TPU topology's mesh) or another
    card traces it afresh rather than reusing a trace whose kernels were chosen for the last.

    Jitted, a kernel call that a program makes several times with the same shapes (one per
    layer) is traced and lowered once, where each call would otherwise lower its Mosaic GPU or
    Triton kernels again; XLA inlines the calls, so the compiled program is the same."""
    jitted = jax.jit(lambda *args, _choices, **kwargs: fn(*args, **kwargs),
                     static_argnums=static_argnums,
                     static_argnames=(*static_argnames, "_choices"))
    return lambda *args, **kwargs: jitted(*args, _choices=choices_key(), **kwargs)


def pallas_triton():
    """``jax.experimental.pallas.triton`` with its ``CompilerParams``, or None where this JAX
    has no Pallas-Triton (it is deprecated from JAX 0.11 and may go)."""
    try:
        from jax.experimental.pallas import triton as pl_triton
    except ImportError:  # pragma: no cover - depends on the installed JAX
        return None
    has_params = hasattr(pl_triton, "CompilerParams") or hasattr(pl_triton, "TritonCompilerParams")
    return pl_triton if has_params else None


def triton_compiler_params(warps: int, stages: int | None = None):
    """Triton's launch parameters under either of the names JAX has given them."""
    pl_triton = pallas_triton()
    if pl_triton is None:
        raise RuntimeError(f"this JAX ({jax.__version__}) has no Pallas-Triton")
    cls = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return cls(num_warps=warps) if stages is None else cls(num_warps=warps, num_stages=stages)


def _one_dot(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = jnp.dot(x, x, preferred_element_type=jnp.float32)


def _lowering_error(family: str, lowering: str) -> str | None:
    """None when a one-dot Pallas kernel of ``family`` lowers for ``lowering`` with this JAX."""
    try:
        from jax.experimental import pallas as pl

        if family == "triton":
            if pallas_triton() is None:
                return f"this JAX ({jax.__version__}) has no Pallas-Triton"
            params = triton_compiler_params(warps=4)
        else:
            from jax.experimental.pallas import tpu as pltpu

            cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
            params = cls(dimension_semantics=("parallel",))
        x = jax.ShapeDtypeStruct((16, 16), jnp.float32)
        fn = pl.pallas_call(_one_dot, out_shape=x, grid=(1,), compiler_params=params)
        jax.jit(fn).trace(x).lower(lowering_platforms=(lowering,))
    except Exception as err:  # any failure means "does not lower here"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return (f"a Pallas {family} kernel does not lower for {lowering!r} with JAX "
                f"{jax.__version__} ({first})")
    return None


def _mosaic_gpu_api_error() -> str | None:
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return f"this JAX ({jax.__version__}) has no Pallas Mosaic GPU"
    missing = [n for n in ("kernel", "wgmma", "SMEM", "ACC", "Barrier", "load") if not hasattr(plgpu, n)]
    return f"this JAX's Pallas Mosaic GPU lacks {missing}" if missing else None


def _cudnn_lse_error() -> str | None:
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:
        return f"this JAX ({jax.__version__}) has no cuDNN fused attention module"
    if not hasattr(fused, "MaskType"):
        return f"this JAX's ({jax.__version__}) cuDNN attention module is not the one expected"
    return None


# HBM per chip and TensorCores per chip of each TPU generation (Google's published figures),
# by a lower-case substring of ``device_kind``, first match wins: a TPU topology's devices have
# no memory statistics to ask. A device that is one of a chip's cores gets its share.
TPU_CHIPS = (("v6 lite", 32, 1), ("v6e", 32, 1), ("v5 lite", 16, 1), ("v5e", 16, 1),
             ("v5p", 95, 2), ("v5", 95, 2), ("v4", 32, 2), ("v3", 32, 2), ("v2", 16, 2))


def memory_bytes(dev) -> int | None:
    """The memory one device (a ``jax.Device``) may hold: the allocator's limit where the
    runtime keeps statistics, else for a TPU (a topology's device, compiled for ahead of time)
    its chip's HBM (``TPU_CHIPS``) over the devices per chip; None when unknown (a CPU)."""
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # a compile-only device (a TPU topology's) has no statistics to give
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if dev.platform != "tpu":
        return None
    kind = dev.device_kind.lower()
    for key, gib, cores in TPU_CHIPS:
        if key in kind:
            return gib * 2**30 * (getattr(dev, "num_cores", None) or 1) // cores
    return None


def settle_libtpu_without_a_tpu() -> None:
    """Settings for libtpu where JAX found no TPU chip on this machine (JAX then sets
    ``TPU_SKIP_MDS_QUERY`` at its import), so that starting it, as JAX's search for backends or
    a TPU topology does, neither prints a screen of warnings about the accelerator type and
    worker hostnames it could not determine (single-host values here, which name no
    accelerator: a topology asked for by name is compiled for as it is) nor takes the lock file
    that keeps a second process from a TPU's chips (there are none to share: without this, two
    processes, two test workers say, could not both compile for a topology). A setting already
    made is kept."""
    if os.environ.get("TPU_SKIP_MDS_QUERY") != "1":
        return
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


settle_libtpu_without_a_tpu()
