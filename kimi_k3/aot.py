r"""Compile a config's training step, evaluation scorer and decoding loop for a TPU topology,
ahead of time, on a machine without a TPU: what a slice would run, checked before one is had.

    python -m kimi_k3.aot --config=configs/small.py --topology=v5e:2x2
    python -m kimi_k3.aot --config=configs/1b.py --topology=v5p:2x2x2 --what=train
    python -m kimi_k3.aot --config=configs/moe_tiny.py --topology=v5e:2x4 --what=train \
        --config.mesh.data=1 --config.mesh.expert=8

The TPU compiler is ``libtpu`` (the ``tpu`` extra; the ``test`` extra pulls it in). It
describes a topology's chips without having them (``jax.experimental.topologies``), and each
program is lowered and compiled for those chips from this machine, with the kernels a TPU runs:
the Pallas KDA kernel through Mosaic, splash attention, XLA's TPU code for the rest. Nothing
runs. The programs, each on the chips its command would use:

- ``train``: train.py's step (``train_lib.make_train_step``) on the config's mesh over every
  chip of the topology, the train state sharded by the config's axis rules, the global batch in
  micro-batches of ``train.microbatch_size`` (0: the largest that XLA's estimate for these chips
  says fits, ``train_lib.choose_microbatch``: one more compile);
- ``eval``: eval.py's piece function (``eval_scoring.Scorer``): ``--eval_batch_size`` windows of
  ``--context_length`` tokens in pieces of ``--piece_len``, on ``config.mesh.context`` chips
  (eval.py splits each piece over them; the weights whole on each);
- ``decode``: generate.py's decoding loop (``generate.Decoder.decode``: greedy steps on the
  device), one token per step for each of ``--decode_batch_size`` rows against a cache of
  ``--decode_len`` tokens, on one chip.

For each it prints whether it compiled (or the compiler's error, one line), the time taken,
XLA's memory analysis per chip (arguments, outputs, temporaries, generated code; an output
written into its argument's buffer, a donated train state or cache, counted once), whether that
fits the chip's memory (``device.memory_bytes``: the generation's HBM) and the custom kernels
in the compiled program. ``--quick`` compiles at XLA's lowest optimisation level, several
times faster; its memory figures may differ a little from a full compile's.

Exit status: 0 every program compiled and fits; 1 one did not compile or does not fit (the
report says which), or libtpu is missing; 2 a bad flag or config (an unknown topology, a mesh
that does not cover its chips).

Where the host decides something for the device (which kernels "auto" means, interpret mode or
compiled), the mesh in context decides instead (``device.target_platform``): every program is
traced under a mesh of the topology's chips, and its "auto" choices resolved for "tpu".
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import re
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags
from flax import nnx, traverse_util
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_k3 import cli, eval_scoring, generate, train_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3.config import MESH_AXES, ConfigError, RunSpec, check_context, kda_chunk, run_spec
from kimi_k3.layers.moe import MoeStat
from kimi_k3.model_state import make_model
from kimi_k3.runtime import jax_setting
from kimi_k3.sharding import axis_rules
from kimi_k3.train_state import state_layout
from pallas_kernels import device

PROGRAMS = ("train", "eval", "decode")
# A few topologies, for the messages (libtpu knows every one a TPU generation has).
EXAMPLE_TOPOLOGIES = ("v5e:2x2", "v5e:2x4", "v5p:2x2x2", "v5p:2x4x4", "v6e:4x4")
# The chips of one host along each axis: what libtpu assumes for a topology unless told.
HOST_BOUNDS = (2, 2, 1)
GiB, MiB = 2**30, 2**20


# ---------------------------------------------------------------------------------------------
# The topology and its meshes
# ---------------------------------------------------------------------------------------------


def require_libtpu() -> str:
    """libtpu's version; ValueError saying how to install it where it is missing."""
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError("kimi_k3.aot needs libtpu, the TPU compiler (it runs on any x86 "
                         "machine): .venv/bin/pip install -c constraints.txt -e '.[tpu]'")
    return importlib.metadata.version("libtpu")


def topology_devices(name: str) -> list:
    """The devices of the TPU topology ``name`` ("v5e:2x2": a generation, then the chips along
    each axis), described by libtpu on any machine: compile-only devices, never run on.
    ConfigError naming ``--topology`` for a name libtpu does not know."""
    allowed = f"allowed: GENERATION:AxB[xC], e.g. {', '.join(EXAMPLE_TOPOLOGIES)}"
    match = re.fullmatch(r"v\d+[a-z]*:(\d+(?:x\d+){1,2})|tpu\d+[a-z]*:(\d+(?:x\d+){1,2})", name)
    if match is None:
        raise ConfigError(f"--topology: {name!r} is not a TPU topology; {allowed}")
    require_libtpu()
    from jax.experimental import topologies

    dims = [int(d) for d in (match.group(1) or match.group(2)).split("x")]
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as err:  # libtpu's own word on the name
        why = cli.one_line(err)
    if any(d < b for d, b in zip(dims, HOST_BOUNDS, strict=False)):
        # Fewer chips than a host has: one host holding exactly these.
        bounds = tuple(min(d, b) for d, b in zip(dims + [1], HOST_BOUNDS, strict=False))
        with contextlib.suppress(Exception):
            return list(topologies.get_topology_desc(
                platform="tpu", topology_name=name, chips_per_host_bounds=bounds).devices)
    raise ConfigError(f"--topology: libtpu does not describe {name!r} ({why}); {allowed}")


def mesh_over(mesh_cfg, devices: Sequence) -> Mesh:
    """The (data, fsdp, expert, context, tensor) mesh of ``mesh_cfg`` (``config.mesh`` or a
    MeshSpec) over ``devices``, laid out by JAX by the chips' positions (the innermost axes on
    neighbouring chips), as ``mesh.make_mesh`` lays out a real slice."""
    shape = mesh_lib.mesh_shape(mesh_cfg, len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=list(devices))
    except (ValueError, NotImplementedError):  # a part of the slice JAX cannot lay out
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def train_mesh(spec: RunSpec, devices: Sequence, topology: str) -> Mesh:
    """The config's mesh over every device of the topology; ConfigError naming ``--topology``
    and the config's mesh when they do not match."""
    try:
        return mesh_over(spec.mesh, devices)
    except ConfigError as err:
        raise ConfigError(f"--topology={topology} has {len(devices)} chips: {err}") from err


def _one_axis(axis: str, size: int) -> ml_collections.ConfigDict:
    """A ``config.mesh`` of ``size`` devices along ``axis`` alone."""
    return ml_collections.ConfigDict({a: size if a == axis else 1 for a in MESH_AXES})


def _mesh_text(mesh: Mesh) -> str:
    sizes = [f"{a} {n}" for a, n in mesh.shape.items() if n > 1]
    return "mesh " + (" x ".join(sizes) if sizes else "of one chip")


def _abstract(tree, sharding):
    """``tree``'s arrays as ShapeDtypeStructs placed by ``sharding``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


# ---------------------------------------------------------------------------------------------
# The three programs
# ---------------------------------------------------------------------------------------------


def lower_train(spec: RunSpec, mesh: Mesh) -> tuple[jax.stages.Lowered, Mesh, str]:
    """train.py's step for ``spec`` on ``mesh`` (the one ``train_lib.build`` jits), lowered
    from shapes alone: (the lowered step, its mesh, a line saying what it holds)."""
    B, T = spec.data.global_batch_size, spec.data.seq_len
    if spec.train.microbatch_size:
        mesh_lib.check_batch(B, spec.train.microbatch_size, mesh)
    check_context(T, mesh.shape[mesh_lib.CONTEXT_AXIS], kda_chunk(spec.model))
    layout = state_layout(spec, mesh)
    # The model's state that the step closes over: measurements the forward pass overwrites,
    # and constants of the model (none in HybridLM); their values do not change the program.
    # (Arrays, not NumPy's: the forward pass writes its measurements into them.)
    rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), layout.abstract_rest)
    moe_layers = ()
    if spec.model.moe is not None:
        stats = traverse_util.flatten_dict(
            nnx.to_pure_dict(nnx.state(layout.abstract_model, MoeStat)))
        moe_layers = train_lib.moe_layer_paths(spec.model, stats)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    micro = spec.train.microbatch_size or train_lib.choose_microbatch(
        B, T, mesh, layout.graphdef, rest, layout.abstract_state, batch_sharding, layout.rules,
        limit=device.memory_bytes(mesh.devices.flat[0]))
    step = train_lib.make_train_step(layout.graphdef, rest, layout.tx, layout.schedule,
                                     B // micro, mesh, spec.model, moe_layers,
                                     spec.train.grad_accum_dtype)
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sharding)
             for k in ("tokens", "segment_ids")}
    jitted = jax.jit(step, in_shardings=(layout.state_shardings, {k: batch_sharding for k in batch}),
                     out_shardings=(layout.state_shardings, mesh_lib.replicated(mesh)),
                     donate_argnums=(0,))
    with layout.context():
        lowered = jitted.lower(layout.abstract_state, batch)
    passes = f"{B // micro} micro-batches of {micro}" if micro < B else "one pass"
    return lowered, mesh, f"{_mesh_text(mesh)}; batch {B} x {T} tokens in {passes}"


def _model_shapes(spec: RunSpec, decoding: bool = False):
    """(graphdef, the model's state as ShapeDtypeStructs, the abstract model); ``decoding``: the
    model as a ``Decoder`` holds it (``generate.decoding_model``)."""
    make = lambda: make_model(spec.model, spec.seed)
    if decoding:
        make = lambda: generate.decoding_model(make_model(spec.model, spec.seed))
    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    return graphdef, state, abstract


def lower_eval(spec: RunSpec, devices: Sequence, *, batch_size: int, context_length: int,
               piece_len: int, rules) -> tuple[jax.stages.Lowered, Mesh, str]:
    """eval.py's piece function for windows of ``context_length`` tokens read in pieces of
    ``piece_len``, ``batch_size`` windows at a time, on the first ``config.mesh.context``
    devices (each piece split over them; weights and cache whole on each), as ``Scorer`` runs
    it: (the lowered function, its mesh, a line saying what it holds)."""
    n = spec.mesh.context if spec.mesh.context > 0 else len(devices)
    if n > len(devices):
        raise ConfigError(f"config.mesh.context: {n} is more than the topology's {len(devices)} "
                          f"chips; allowed: at most {len(devices)}")
    P = min(piece_len, context_length)
    check_context(P, n, kda_chunk(spec.model), field=f"--piece_len (a piece of "
                  f"--context_length={context_length})")
    mesh = mesh_over(_one_axis("context", n), devices[:n])
    graphdef, state, abstract = _model_shapes(spec)
    whole = NamedSharding(mesh, PartitionSpec())
    padded = -(-context_length // P) * P
    cache = jax.eval_shape(lambda: abstract.init_cache(batch_size, padded))
    tokens = jax.ShapeDtypeStruct((batch_size, P), jnp.int32,
                                  sharding=mesh_lib.batch_sharding(mesh))
    piece = eval_scoring.piece_function(graphdef)
    state, cache = _abstract(state, whole), _abstract(cache, whole)
    with jax.set_mesh(mesh), axis_rules(rules):
        like = jax.eval_shape(piece, state, tokens, cache, tokens)[1]
        cache = eval_scoring.align_cache(cache, like)
        lowered = piece.lower(state, tokens, cache, tokens)
    return lowered, mesh, (f"{_mesh_text(mesh)}; {batch_size} x {context_length} tokens in "
                           f"pieces of {P}")


def lower_decode(spec: RunSpec, devices: Sequence, *, batch_size: int, max_len: int,
                 rules) -> tuple[jax.stages.Lowered, Mesh, str]:
    """generate.py's decoding loop (``Decoder.decode``: greedy steps on the device), one token
    for each of ``batch_size`` rows per step against a cache of ``max_len`` tokens, on one
    device: (the lowered loop, its mesh of one device, a line saying what it holds)."""
    mesh = mesh_over(_one_axis("context", 1), devices[:1])
    graphdef, state, abstract = _model_shapes(spec, decoding=True)
    whole = NamedSharding(mesh, PartitionSpec())
    B = batch_size
    cache = _abstract(jax.eval_shape(lambda: abstract.init_cache(B, max_len)), whole)
    state = _abstract(state, whole)
    logits = jax.ShapeDtypeStruct((B, spec.model.vocab_size), jnp.float32, sharding=whole)
    book, fixed = _abstract(jax.eval_shape(lambda: (generate.start_book(B, 1, 1), generate.loop_rows(
        np.zeros((B, 1), np.int32), np.ones(B), 1, 1, (), None, generate.GREEDY))), whole)
    steps = jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)
    with jax.set_mesh(mesh), axis_rules(rules):
        step = lambda state, token, cache: nnx.merge(graphdef, state).step(token, cache)
        token = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=whole)
        cache = eval_scoring.align_cache(cache, jax.eval_shape(step, state, token, cache)[1])
        loop, weights = generate.decode_function(graphdef, state)
        lowered = loop.lower(weights, logits, cache, book, fixed, steps, greedy=True, top_k=0)
    rows = f"{batch_size} row{'s' if batch_size > 1 else ''}"
    return lowered, mesh, f"one chip; {rows}, a cache of {max_len} tokens"


# ---------------------------------------------------------------------------------------------
# What a compiled program holds
# ---------------------------------------------------------------------------------------------


def memory_per_chip(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled SPMD program: bytes each chip holds for its
    arguments, outputs, the outputs written into their arguments' buffers (``aliased``: counted
    in both), temporaries and generated code."""
    m = compiled.memory_analysis()
    return {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
            "aliased": int(m.alias_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
            "code": int(m.generated_code_size_in_bytes)}


def custom_kernels(hlo_text: str) -> dict[str, int]:
    """{kernel name: calls} of the Mosaic kernels (``tpu_custom_call``) in a compiled program's
    HLO: each call is an instruction named after its kernel (``%kda_intra_fwd.3 = ...``)."""
    counts: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if name:
            kernel = re.sub(r"\.\d+$", "", name.group(1))
            counts[kernel] = counts.get(kernel, 0) + 1
    return dict(sorted(counts.items()))


@dataclasses.dataclass(frozen=True)
class Report:
    """One program compiled for the topology (or not): what, where, how long, what it holds."""

    what: str  # "train" | "eval" | "decode"
    chips: int  # the devices it runs on
    layout: str  # the mesh and the shapes it was compiled for
    seconds: float  # tracing, lowering and compiling
    chip_bytes: int | None  # the memory of one chip (None: unknown)
    lower_seconds: float = 0.0  # tracing and lowering (and the micro-batch estimate) alone
    error: str | None = None  # the compiler's (or tracer's) error, one line
    memory: dict[str, int] | None = None  # memory_per_chip
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)  # custom_kernels

    @property
    def total_bytes(self) -> int | None:
        """What one chip holds at once: arguments, outputs not written into an argument's
        buffer, temporaries and the program."""
        m = self.memory
        if m is None:
            return None
        return m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["code"]

    @property
    def fits(self) -> bool | None:
        if self.total_bytes is None or self.chip_bytes is None:
            return None
        return self.total_bytes <= self.chip_bytes


def compile_report(what: str, lower, chip_bytes: int | None) -> Report:
    """``lower()`` -> (lowered, mesh, layout) compiled, timed and examined; an error while tracing,
    lowering or compiling becomes the report's ``error`` (a config error still raises)."""
    t0 = time.perf_counter()
    try:
        lowered, mesh, layout = lower()
    except ConfigError:
        raise
    except Exception as err:
        return Report(what, 0, "", time.perf_counter() - t0, chip_bytes, error=cli.one_line(err))
    chips, lowering = mesh.size, time.perf_counter() - t0
    try:
        with without_persistent_cache():
            compiled = lowered.compile()
    except Exception as err:
        return Report(what, chips, layout, time.perf_counter() - t0, chip_bytes, lowering,
                      error=cli.one_line(err))
    seconds = time.perf_counter() - t0
    return Report(what, chips, layout, seconds, chip_bytes, lowering,
                  memory=memory_per_chip(compiled), kernels=custom_kernels(compiled.as_text()))


@contextlib.contextmanager
def without_persistent_cache():
    """JAX's persistent compilation cache off for the compiles inside, as it was after. A program
    compiled for chips this machine does not have is never run here, and the cache cannot give
    it back: JAX reads the entry, fails to load it without those chips' client and warns on
    every later compile of the same program. So it is not written."""
    compilation_cache.reset_cache()  # JAX decides once whether the cache is on; ask again
    try:
        with jax_setting("jax_enable_compilation_cache", False):
            yield
    finally:
        compilation_cache.reset_cache()


@contextlib.contextmanager
def optimization_level(level: str | None):
    """XLA's optimisation level ("O0" ... "O3"; None: XLA's default) for the compiles inside:
    O0 compiles a large program several times faster."""
    if level is None:
        yield
        return
    with jax_setting("jax_optimization_level", level):
        yield


@dataclasses.dataclass(frozen=True)
class Options:
    """The shapes of the programs besides the config's (the command's flags of these names)."""

    what: tuple[str, ...] = PROGRAMS
    eval_batch_size: int = 1
    context_length: int = 2048
    piece_len: int = 2048
    decode_batch_size: int = 1
    decode_len: int = 2048
    quick: bool = False


def compile_config(config, topology: str, opts: Options = Options()) -> list[Report]:
    """Every program of ``opts.what`` for ``config`` (a ConfigDict) compiled for ``topology``:
    one Report each. Raises ConfigError for a bad topology, mesh or shape."""
    for w in opts.what:
        if w not in PROGRAMS:
            raise ConfigError(f"--what: {w!r} is not a program; allowed: {', '.join(PROGRAMS)}")
    devices = topology_devices(topology)
    spec = run_spec(config, backend="tpu")  # "auto" resolved for the TPU, not this machine
    chip_bytes = device.memory_bytes(devices[0])
    rules = spec.mesh.axis_rules
    lowerers = {
        "train": lambda: lower_train(spec, train_mesh(spec, devices, topology)),
        "eval": lambda: lower_eval(spec, devices, batch_size=opts.eval_batch_size,
                                   context_length=opts.context_length,
                                   piece_len=opts.piece_len, rules=rules),
        "decode": lambda: lower_decode(spec, devices, batch_size=opts.decode_batch_size,
                                       max_len=opts.decode_len, rules=rules),
    }
    if "train" in opts.what:
        train_mesh(spec, devices, topology)  # a mesh that does not fit: refused before compiling
    with optimization_level("O0" if opts.quick else None):
        return [compile_report(w, lowerers[w], chip_bytes) for w in opts.what]


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def format_report(r: Report) -> list[str]:
    """A program's lines: compiled or not, its memory per chip and its kernels."""
    pad = " " * 8
    if r.error is not None:
        where = f" ({r.layout})" if r.layout else ""
        return [f"{r.what:<7} FAILED after {r.seconds:.1f} s{where}", f"{pad}{r.error}"]
    m = r.memory
    fits = {True: "fits", False: "DOES NOT FIT", None: "chip memory unknown"}[r.fits]
    chips = f"{r.chips} chip{'s' if r.chips != 1 else ''}"
    kernels = ", ".join(f"{k} x{n}" for k, n in r.kernels.items()) or "none"
    return [f"{r.what:<7} compiled in {r.seconds:.1f} s (lowering {r.lower_seconds:.1f} s) for "
            f"{chips} ({r.layout})",
            f"{pad}per chip: arguments {_size(m['arguments'])}, outputs {_size(m['outputs'])} "
            f"({_size(m['aliased'])} in their arguments' buffers), temporaries "
            f"{_size(m['temporaries'])}, code {_size(m['code'])}",
            f"{pad}total {_size(r.total_bytes)} of {_size(r.chip_bytes)}: {fits}",
            f"{pad}Mosaic kernels: {kernels}"]


def header(config_name: str, topology: str, devices: Sequence) -> str:
    kind = device.describe("tpu", devices[0]).kind
    return (f"{config_name} for TPU {topology}: {len(devices)} x {kind} "
            f"({_size(device.memory_bytes(devices[0]))} each); JAX {jax.__version__}, libtpu "
            f"{require_libtpu()}")


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def define_flags() -> None:
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/small.py "
                                    "(with --config.FIELD=VALUE overrides).", lock_config=True)
    flags.mark_flag_as_required("config")
    flags.DEFINE_string("topology", None, "The TPU topology: GENERATION:AxB[xC], e.g. "
                        f"{', '.join(EXAMPLE_TOPOLOGIES)}.", required=True)
    flags.DEFINE_list("what", list(PROGRAMS), f"Programs to compile: {', '.join(PROGRAMS)}.")
    flags.DEFINE_integer("eval_batch_size", 1, "eval: windows scored together (eval.py's "
                         "--batch_size).", lower_bound=1)
    flags.DEFINE_integer("context_length", 2048, "eval: tokens per window (eval.py's "
                         "--context_lengths, one of them).", lower_bound=1)
    flags.DEFINE_integer("piece_len", 2048, "eval: tokens per prefill call (eval.py's "
                         "--piece_len).", lower_bound=1)
    flags.DEFINE_integer("decode_batch_size", 1, "decode: rows decoded together (prompts x "
                         "generate.py's --num_samples).", lower_bound=1)
    flags.DEFINE_integer("decode_len", 2048, "decode: tokens the cache holds (prompt plus "
                         "generate.py's --max_new_tokens).", lower_bound=1)
    flags.DEFINE_bool("quick", False, "Compile at XLA's lowest optimisation level (O0): several "
                      "times faster; the memory figures may differ a little.")


def main(argv: Sequence[str]) -> None:
    from absl import app, logging
    from ml_collections import config_flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    F = flags.FLAGS
    if not F["verbosity"].present:  # the command prints its own lines; -v 0 for library logs
        logging.set_verbosity(logging.WARNING)
    opts = Options(what=tuple(F.what), eval_batch_size=F.eval_batch_size,
                   context_length=F.context_length, piece_len=F.piece_len,
                   decode_batch_size=F.decode_batch_size, decode_len=F.decode_len,
                   quick=F.quick)
    devices = topology_devices(F.topology)
    name = config_flags.get_config_filename(F["config"])
    print(header(name, F.topology, devices), flush=True)
    reports = compile_config(F.config, F.topology, opts)
    for r in reports:
        print("\n".join(format_report(r)), flush=True)
    failed = [r.what for r in reports if r.error is not None]
    too_big = [r.what for r in reports if r.fits is False]
    if failed or too_big:
        said = ([f"{', '.join(failed)} did not compile"] if failed else []) + (
            [f"{', '.join(too_big)} does not fit the chips' memory"] if too_big else [])
        raise ValueError(f"{F.topology}: {'; '.join(said)} (above)")


# Run as a program (python -m kimi_k3.aot), or loaded by the documentation check: the flags.
# Imported as a library (``import kimi_k3.aot``): no process-wide absl flag is defined.
if __name__ != "kimi_k3.aot":
    define_flags()

if __name__ == "__main__":
    sys.argv[0] = "python -m kimi_k3.aot"  # the program its one-line errors name
    cli.run(main)
