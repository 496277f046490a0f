r"""The planner: per-device memory and step time of a config on a mesh, on paper.

    python -m kimi_k3.plan --config=configs/1b.py --devices=1 --device=h100
    python -m kimi_k3.plan --config=configs/moe_1b.py --devices=8 --device=h100 \
        --config.train.microbatch_size=8
    python -m kimi_k3.plan --config=configs/k3.py --devices=4096 --device=h200 --meshes=10

Nothing runs on an accelerator and nothing is compiled: the numbers come from the model's
abstract shapes, on any machine, in seconds.

Memory per device during a training step (``memory_plan``), each row with what it is made of:

- parameters, optimizer state and the routing biases: the train state's own arrays
  (``train_state.state_layout`` on an abstract mesh), each sharded as the config's axis rules
  say: exact;
- gradients: the parameters' gradient in the parameter dtype; with micro-batches also the
  float32 sums and the weights rounded once to the compute dtype (``train_lib.make_train_step``);
- activations kept for the backward pass: what JAX's remat policy saves
  (``jax.ad_checkpoint`` residuals of the loss, traced at one device's shapes: rows
  micro-batch / (data x fsdp x expert), tokens seq_len / context, heads, MLP, experts' widths and
  vocabulary / tensor) with the target card's kernels in place; grouped by the part of the
  model that keeps them (KDA, MLA, MoE dispatch, FFN, Attention Residuals, head). Linear in
  the rows: traced at 1 and 2 rows per device and extended;
- the backward's working set: the largest layer's forward values recomputed and their
  gradients alive at once (``WORKING_SET_FACTORS``: a few times one layer's values without
  remat), and the loss head's logits of one chunk (``HEAD_BUFFERS``);
- collective buffers: one scan step's weights gathered over fsdp (twice: the next one is
  fetched while this one computes), and its gradient before the reduce-scatter;
- the rest: ``RESERVE_BYTES`` for the runtime's own (cuBLAS workspaces, the program itself).

Step time (``step_time``), a stated roofline: the step's FLOPs (``model.flops_per_token``) at
the card's peak; the bytes each device must move through its memory (the state read and
written by the optimizer, the activations written and read back) at its bandwidth; and the
collectives' bytes (fsdp's gathers and reduce-scatters, data's all-reduce, tensor's
all-reduces of the residual stream, expert's all-to-alls, context's latent gathers) at the
interconnect's, with no overlap assumed. MFU = FLOP time / step time. ``DEVICES`` lists the
cards' figures; every assumption is printed with the plan.

What this does not see: XLA's own choices (fusion, rematerialisation of its own, buffer
reuse) and allocator fragmentation. BENCHMARKS.md compares the estimate with measured peaks.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src import core as jax_core
from jax._src import source_info_util
from jax.sharding import AbstractMesh

from kimi_k3.config import MESH_AXES, ConfigError, RunSpec, model_spec, run_spec, scan_plan
from kimi_k3.layers.dense import low_copies
from kimi_k3.model import HybridLM, flops_per_token
from kimi_k3.model_state import merge_model, split_for_training
from kimi_k3.train_state import state_layout

GiB = 2**30

# The backward pass holds the layer it is differentiating (recomputed, under remat) and the
# gradients of those values: this many times one layer's forward values, by platform. XLA:CPU
# reuses buffers within the layer (tests/test_plan.py holds the estimate to its compiled
# figure); on the GPU, values and their gradients are alive together (BENCHMARKS.md).
WORKING_SET_FACTORS = {"cpu": 1.0, "gpu": 2.0, "tpu": 2.0}
# The loss head's working set: one chunk's float32 logits [rows, head_chunk, V], their
# softmax and its gradient alive at once in the backward (layers.embed.chunked_nll).
HEAD_BUFFERS = 3
# What a process keeps outside the step's buffers: cuBLAS/cuDNN workspaces, the compiled
# program, the allocator's own.
RESERVE_BYTES = 1 * GiB
# The share of device memory a plan may fill (the trainer's automatic micro-batch too).
MEMORY_HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class Device:
    """A card's figures for the roofline: memory, dense bf16 peak, HBM bandwidth, and the
    bandwidth of one device's collectives inside a node (NVLink, ICI) and across nodes."""

    name: str
    platform: str  # "gpu" | "tpu" | "cpu": which kernels the model's "auto" choices take
    memory_gib: float
    tflops: float  # dense bf16
    hbm_gbps: float  # GB/s
    link_gbps: float  # GB/s per device, one direction, inside a node / slice
    net_gbps: float  # GB/s per device across nodes (GPUs); TPU slices: the same ICI
    per_node: int  # devices that share the fast link


# Vendors' data sheets. GPUs: SXM parts, NVLink 4/5 inside a node of 8, 400 Gb/s of network per
# GPU across nodes. TPUs: a slice is one ICI domain.
DEVICES = {
    "h100": Device("NVIDIA H100 SXM 80GB", "gpu", 80, 989, 3350, 450, 50, 8),
    "h200": Device("NVIDIA H200 SXM 141GB", "gpu", 141, 989, 4800, 450, 50, 8),
    "a100": Device("NVIDIA A100 SXM 80GB", "gpu", 80, 312, 2039, 300, 25, 8),
    "b200": Device("NVIDIA B200 180GB", "gpu", 180, 2250, 8000, 900, 50, 8),
    "tpu-v5e": Device("TPU v5e", "tpu", 16, 197, 819, 200, 200, 256),
    "tpu-v5p": Device("TPU v5p", "tpu", 95, 459, 2765, 600, 600, 8960),
    "tpu-v6e": Device("TPU v6e", "tpu", 32, 918, 1640, 448, 448, 256),
    "cpu": Device("CPU (host memory)", "cpu", 0, 1, 50, 10, 10, 1),
}


# ``DEVICES``' key for a card, by a substring of its kind as the probe names it; first match.
KIND_NAMES = (("h200", ("h200",)), ("h100", ("h100", "h800")), ("a100", ("a100", "a800")),
              ("b200", ("b200",)), ("tpu-v5e", ("v5 lite", "v5e")), ("tpu-v5p", ("v5p", "tpu v5")),
              ("tpu-v6e", ("v6",)))


# ---------------------------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------------------------


def mesh_sizes(config, devices: int) -> dict[str, int]:
    """{axis: size} of ``config.mesh`` over ``devices`` devices (-1 resolved)."""
    from kimi_k3.mesh import mesh_shape

    return dict(zip(MESH_AXES, mesh_shape(config.mesh, devices), strict=True))


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A mesh of the given axis sizes with no devices behind it: shardings and shard shapes only."""
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def batch_split(sizes: dict[str, int]) -> int:
    """Devices a batch's rows are split over: data x fsdp x expert."""
    return sizes["data"] * sizes["fsdp"] * sizes["expert"]


# ---------------------------------------------------------------------------------------------
# The train state
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Array:
    group: str  # "params" | "opt_state" | "model_state" | ...
    shape: tuple[int, ...]
    dtype: str
    spec: tuple  # the PartitionSpec's entries: None, an axis name, or a tuple of names


@functools.lru_cache(maxsize=16)
def _state_arrays(key) -> tuple[tuple[_Array, ...], dict]:
    """Every array of the train state with its PartitionSpec (the layout on an abstract mesh
    with every axis present), and the parameters' abstract tree (for one scan step's size)."""
    layout = state_layout(key.value, abstract_mesh(dict.fromkeys(MESH_AXES, 1)))
    out = []
    for group, tree in layout.abstract_state.items():
        for x in jax.tree.leaves(tree):
            out.append(_Array(group, tuple(x.shape), str(x.dtype), tuple(x.sharding.spec)))
    # The matrices whose gradients train.grad_accum_dtype = "bfloat16" keeps in bfloat16.
    params = layout.abstract_state["params"]
    low = jax.eval_shape(lambda p: low_copies(p, jnp.bfloat16), params)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(low), strict=True):
        if x.dtype != y.dtype:
            out.append(_Array("low_grads", tuple(x.shape), str(y.dtype), tuple(x.sharding.spec)))
    return tuple(out), params


class _Keyed:
    """``value`` hashed and compared by ``text`` (a stable rendering of what matters in it),
    so a cache can key on a ConfigDict or a RunSpec."""

    def __init__(self, value, text: str):
        self.value, self._text = value, text

    def __hash__(self):
        return hash(self._text)

    def __eq__(self, other):
        return self._text == other._text


def _spec_key(spec: RunSpec) -> _Keyed:
    """What a state's arrays and their PartitionSpecs depend on: the model, the optimizer and
    the axis rules (not the mesh's sizes, which ``state_bytes`` applies), so one layout serves
    every mesh a plan weighs."""
    return _Keyed(spec, repr((spec.model, spec.opt, spec.mesh.axis_rules)))


def _shard_shape(a: _Array, sizes: dict[str, int], where: str) -> tuple[int, ...]:
    out = []
    for d, entry in enumerate(a.spec + (None,) * (len(a.shape) - len(a.spec))):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        k = math.prod(sizes[x] for x in axes)
        if a.shape[d] % k:
            raise ConfigError(
                f"config.mesh: {where} has a dimension of {a.shape[d]} sharded over "
                f"{'x'.join(axes)} = {k}, which does not divide it; allowed: mesh sizes that "
                f"divide the model's widths")
        out.append(a.shape[d] // k)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """One device's share of the train state, and of one scan step's weights."""

    params: int
    opt_state: int
    model_state: int
    param_count: int  # parameters on this device
    opt_dtypes: str  # e.g. "float32 x 2 per parameter"
    param_dtype: str
    layer_param_count: int  # parameters of the largest unit gathered at once (whole, unsharded)
    total_param_count: int  # the model's, unsharded
    low_grad_count: int = 0  # of param_count: the matrices a bfloat16 gradient sum rounds


def state_bytes(spec: RunSpec, sizes: dict[str, int]) -> StateBytes:
    """Per-device bytes of the parameters, optimizer state and routing biases on a mesh of
    ``sizes`` (shard shapes from the config's axis rules; a width that does not divide by its
    axes is a ConfigError)."""
    return _state_bytes(_spec_key(spec), tuple(sizes[a] for a in MESH_AXES))


@functools.lru_cache(maxsize=4096)
def _state_bytes(key, mesh: tuple[int, ...]) -> StateBytes:
    sizes = dict(zip(MESH_AXES, mesh, strict=True))
    arrays, params = _state_arrays(key)
    total, count, dtypes = collections.Counter(), collections.Counter(), collections.Counter()
    for a in arrays:
        n = math.prod(_shard_shape(a, sizes, f"a {a.group} array of shape {a.shape}"))
        total[a.group] += n * jnp.dtype(a.dtype).itemsize
        count[a.group] += n
        if a.group == "opt_state" and len(a.shape):
            dtypes[a.dtype] += n
    P = max(count["params"], 1)
    opt = ", ".join(f"{d} x {c / P:.2g} per parameter" for d, c in dtypes.items()) or "none"
    param_dtype = ", ".join(sorted({a.dtype for a in arrays if a.group == "params"}))
    return StateBytes(params=total["params"], opt_state=total["opt_state"],
                      model_state=total["model_state"], param_count=count["params"],
                      opt_dtypes=opt, param_dtype=param_dtype,
                      layer_param_count=_largest_unit_params(params),
                      total_param_count=sum(math.prod(a.shape) for a in arrays
                                            if a.group == "params"),
                      low_grad_count=count["low_grads"])


def _largest_unit_params(params: dict) -> int:
    """Parameters of the biggest block the forward gathers at once: one scan step (a group,
    stacked over repeats: one repeat of it), one unrolled layer, or the embedding / head."""
    best = 0
    for key, sub in params.items():
        if key == "groups":
            leaves = jax.tree.leaves(sub)
            best = max(best, sum(math.prod(x.shape[1:]) for x in leaves))
        elif key in ("prefix", "tail"):
            for layer in (sub.values() if isinstance(sub, dict) else sub):
                best = max(best, sum(math.prod(x.shape) for x in jax.tree.leaves(layer)))
        else:
            best = max(best, sum(math.prod(x.shape) for x in jax.tree.leaves(sub)))
    return best


# ---------------------------------------------------------------------------------------------
# Activations: what the remat policy keeps, traced at one device's shapes
# ---------------------------------------------------------------------------------------------

# Which part of the model keeps a residual, by the source file that made it.
PARTS = (
    ("kda", ("kda_layer.py", "kda_chunked.py", "kda_recurrent.py", "kda_context.py",
             "kda_guards.py", "short_conv.py", "gates.py", "ops/kda.py", "kda_pallas")),
    ("mla", ("mla.py", "attention.py")),
    ("moe", ("moe.py", "grouped_matmul.py")),
    ("ffn", ("mlp.py", "swiglu.py")),
    ("attn_res", ("attn_res.py", "depth_read.py")),
    ("head", ("embed.py",)),
)
PART_NAMES = {
    "kda": "KDA: projections, q/k/v after their convolutions, gates, kernel outputs and chunk states",
    "mla": "MLA: latents, queries, keys and values, attention outputs",
    "moe": "MoE: router, dispatch buffers (tokens x top_k), expert activations",
    "ffn": "dense SwiGLU activations",
    "attn_res": "Attention Residuals: the depth reads and their weights",
    "head": "embedding and the output head's logit chunks",
    "scan": "the layer scan's carries: each step's input, stacked",
    "other": "norms and the rest",
}


def _part(where: str) -> str:
    """The part of the model whose frame is innermost in ``where`` (file names, innermost
    first)."""
    best, at = "other", len(where) + 1
    for part, keys in PARTS:
        for k in keys:
            i = where.find(k)
            if 0 <= i < at:
                best, at = part, i
    return best


def local_model_config(model_cfg, sizes: dict[str, int]):
    """``config.model`` at one device's widths under tensor parallelism: heads, the MLP's and
    the experts' widths and the vocabulary divided by ``tensor`` (a width that does not divide
    is a ConfigError naming it)."""
    tp = sizes["tensor"]
    cfg = copy.deepcopy(model_cfg)
    if tp == 1:
        return cfg
    fields = [("num_heads", cfg), ("mlp_dim", cfg), ("vocab_size", cfg)]
    fields += [("num_heads", cfg.mla)]
    if cfg.kda.get("num_v_heads"):
        fields.append(("num_v_heads", cfg.kda))
    if cfg.get("moe") and cfg.moe.get("num_experts"):
        fields += [("expert_dim", cfg.moe)]
        if cfg.moe.get("shared_dim"):
            fields.append(("shared_dim", cfg.moe))
    with cfg.unlocked():
        for name, section in fields:
            value = section.get(name)
            if not value or value < 0:
                continue
            if value % tp:
                raise ConfigError(f"config.model.{name}: {value} does not divide by "
                                  f"mesh.tensor = {tp}; allowed: a tensor size dividing it")
            with section.unlocked():
                section[name] = value // tp
    return cfg


TARGET_IMPLS = {
    # What the model's "auto" kernels are on each platform (kimi_k3.dispatch), set explicitly
    # so a plan made on a CPU traces the target card's kernels and their saved outputs.
    "gpu": {"kda.impl": "pallas", "mla.attn_impl": "pallas", "kda.conv_impl": "pallas",
            "attn_res_impl": "pallas", "mlp_impl": "pallas", "moe.expert_matmul": "blocked"},
    "tpu": {"kda.impl": "pallas", "mla.attn_impl": "pallas"},
    "cpu": {},
}


def _with_impls(model_cfg, platform: str):
    cfg = copy.deepcopy(model_cfg)
    with cfg.unlocked():
        for dotted, value in TARGET_IMPLS[platform].items():
            *path, leaf = dotted.split(".")
            section = cfg
            for p in path:
                section = section[p]
            if section.get(leaf, "auto") == "auto":
                with section.unlocked():
                    section[leaf] = value
    return cfg


@dataclasses.dataclass(frozen=True)
class Activations:
    """Bytes kept for the backward pass on one device: ``base`` plus ``per_row`` per row of
    the micro-batch on it, by part; and one layer's forward values without remat."""

    per_row: dict[str, int]
    base: dict[str, int]
    layer_values_per_row: int
    tokens_per_row: int  # seq_len / context

    def at(self, rows: int) -> dict[str, int]:
        return {p: self.base.get(p, 0) + rows * self.per_row.get(p, 0)
                for p in sorted(set(self.per_row) | set(self.base))}


def _where(eqn) -> str:
    """The files of the frames that made ``eqn``, innermost first (the layer that called a
    shared Dense names the part), or JAX's one-line summary where frames are not kept."""
    try:
        frames = source_info_util.user_frames(eqn.source_info.traceback)
        return " ".join(f.file_name.rsplit("/", 1)[-1] for f in frames)
    except Exception:  # a JAX without the frame API: the summary's innermost file
        return source_info_util.summarize(eqn.source_info)


def _residuals(f, *args) -> list[tuple[object, str]]:
    """(aval, where) of every value ``jax.vjp(f)`` keeps for the backward pass that is not an
    argument or a literal: ``jax.ad_checkpoint``'s residual list, with the frames of each."""
    in_leaves, in_tree = jax.tree.flatten(args)
    flat = lambda *leaves: f(*jax.tree.unflatten(in_tree, leaves))
    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(flat, *a), return_shape=True)(*in_leaves)
    jaxpr = closed.jaxpr
    n_res = len(jax.tree.leaves(shapes[1]))
    res = {v for v in jaxpr.outvars[len(jaxpr.outvars) - n_res:]
           if not isinstance(v, jax_core.Literal)}
    out = []
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if v in res:
                out.append((v.aval, _where(eqn)))
    return out


def _residual_bytes(model, rows: int, T: int) -> dict[str, int]:
    graphdef, params, model_state, rest = split_for_training(model)
    # The rest (constants, and the measurements a forward pass writes) is small: real zeros,
    # as the trainer holds it.
    rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), rest)

    def loss(params, model_state, tokens_BxT, segment_ids_BxT):
        m = merge_model(graphdef, params, rest, model_state)
        nll_BxT, _ = m.token_nll(tokens_BxT, tokens_BxT, segment_ids_BxT)
        return nll_BxT.sum()

    tokens = jax.ShapeDtypeStruct((rows, T), jnp.int32)
    out = collections.Counter()
    for aval, where in _residuals(loss, params, model_state, tokens, tokens):
        if getattr(aval, "shape", None):
            out[_part(where)] += math.prod(aval.shape) * aval.dtype.itemsize
    return dict(out)


# A stack of at least this many repeats of its unit is traced at two and three repeats and
# extended (``_fit``): tracing K3's whole depth takes minutes, a few repeats seconds.
DEPTH_EXTRAPOLATION_REPEATS = 8


def _fit_rows(model_cfg, T: int) -> tuple[dict[str, int], dict[str, int]]:
    """(per row, base) residual bytes by part, from traces at 1 and 2 rows."""
    model = nnx.eval_shape(lambda: HybridLM(model_spec(model_cfg), rngs=nnx.Rngs(0)))
    one, two = _residual_bytes(model, 1, T), _residual_bytes(model, 2, T)
    per_row = {p: max(two.get(p, 0) - one.get(p, 0), 0) for p in set(one) | set(two)}
    base = {p: max(one.get(p, 0) - per_row.get(p, 0), 0) for p in one}
    return per_row, base


def _with_depth(model_cfg, pattern: str):
    cfg = copy.deepcopy(model_cfg)
    with cfg.unlocked():
        cfg.pattern, cfg.num_layers = pattern, len(pattern)
    return cfg


def _fit(model_cfg, T: int) -> tuple[dict[str, int], dict[str, int]]:
    """(per row, base) residual bytes by part of the whole stack. A deep stack is traced at
    two and three repeats of its unit (scanned either way, as the model would be) and
    extended by the difference, one repeat at a time: what a layer keeps does not depend on
    how many come after it."""
    spec = model_spec(model_cfg)
    prefix = spec.scan_prefix
    unit, repeats, tail = scan_plan(spec.pattern[len(prefix):], True)
    if repeats < DEPTH_EXTRAPOLATION_REPEATS:
        return _fit_rows(model_cfg, T)
    r2 = _fit_rows(_with_depth(model_cfg, prefix + unit * 2 + tail), T)
    r3 = _fit_rows(_with_depth(model_cfg, prefix + unit * 3 + tail), T)
    out = []
    for two, three in zip(r2, r3, strict=True):
        parts = set(two) | set(three)
        out.append({p: max(two.get(p, 0) + (repeats - 2) * (three.get(p, 0) - two.get(p, 0)), 0)
                    for p in parts})
    return out[0], out[1]


@functools.lru_cache(maxsize=64)
def _activations_cached(key: _Keyed, T: int, platform: str) -> Activations:
    model_cfg = _with_impls(key.value, platform)
    per_row, base = _fit(model_cfg, T)
    if model_spec(model_cfg).scan_layers:
        # The scan's residuals are attributed to the scan itself: the parts come from the same
        # stack unrolled, and what the scan keeps beyond that (its stacked carries: each
        # step's input) is a part of its own.
        flat = copy.deepcopy(model_cfg)
        with flat.unlocked():
            flat.scan_layers = False
        flat_row, flat_base = _fit(flat, T)
        per_row = {**flat_row, "scan": max(sum(per_row.values()) - sum(flat_row.values()), 0)}
        base = {**flat_base, "scan": max(sum(base.values()) - sum(flat_base.values()), 0)}
    return Activations(per_row=per_row, base=base,
                       layer_values_per_row=_one_layer_values(model_cfg, T), tokens_per_row=T)


def _one_layer_values(model_cfg, T: int) -> int:
    """Per row: the largest layer's forward values (everything one layer computes, kept as
    with remat "none"), over the layer kinds of the pattern (KDA, MLA; dense or MoE FFN)."""
    spec = model_spec(model_cfg)
    kinds = {(k, spec.moe is not None and i >= spec.moe.first_k_dense)
             for i, k in enumerate(spec.pattern)}
    best = 0
    for kind, experts in sorted(kinds):
        cfg = copy.deepcopy(model_cfg)
        with cfg.unlocked():
            cfg.num_layers, cfg.pattern, cfg.remat = 1, kind, "none"
            if spec.moe is not None:
                if not experts:
                    cfg.moe.num_experts = 0  # a dense layer
                else:
                    cfg.moe.first_k_dense = 0
        model = nnx.eval_shape(lambda cfg=cfg: HybridLM(model_spec(cfg), rngs=nnx.Rngs(0)))
        r = _residual_bytes(model, 1, T)
        best = max(best, sum(v for p, v in r.items() if p != "head"))
    return best


def activations(config, sizes: dict[str, int], platform: str, exact: bool = True) -> Activations:
    """What one device keeps for the backward pass (module docstring), per row. ``exact``:
    traced at this mesh's local widths and tokens; else scaled from the one-device trace
    (every part by 1 / context; the layers' own parts, not the residual stream's, by
    1 / tensor), which is what ranking many meshes uses."""
    T = int(config.data.seq_len)
    cp, tp = sizes["context"], sizes["tensor"]
    if T % cp:
        raise ConfigError(f"config.data.seq_len: {T} does not divide by mesh.context = {cp}")
    if exact or (cp == 1 and tp == 1):
        local = local_model_config(config.model, sizes)
        return _activations_cached(_Keyed(local, local.to_json()), T // cp, platform)
    one = activations(config, dict.fromkeys(MESH_AXES, 1), platform)
    local_model_config(config.model, sizes)  # a width tensor does not divide: the error
    scale = lambda p: 1 / cp / (1 if p in ("attn_res", "scan", "other") else tp)
    return Activations(per_row={p: int(v * scale(p)) for p, v in one.per_row.items()},
                       base={p: int(v / tp) for p, v in one.base.items()},
                       layer_values_per_row=int(one.layer_values_per_row / cp / tp),
                       tokens_per_row=T // cp)


# ---------------------------------------------------------------------------------------------
# The plan of one mesh
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the memory table: what, bytes per device, and what it is made of."""

    name: str
    bytes: int
    formula: str


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory of a training step of ``microbatch`` rows (all data-parallel devices
    together) on a mesh of ``sizes``."""

    sizes: dict[str, int]
    microbatch: int
    rows_per_device: int
    accum_steps: int
    rows: tuple[Row, ...]
    device_bytes: int | None

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def fits(self) -> bool | None:
        return None if not self.device_bytes else self.total <= MEMORY_HEADROOM * self.device_bytes


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _dtype_bytes(name: str) -> int:
    return jnp.dtype(name).itemsize


def memory_plan(config, sizes: dict[str, int], microbatch: int, device: Device,
                device_bytes: int | None = None, exact: bool = True) -> MemoryPlan:
    """The memory table (module docstring) of ``config`` with micro-batches of ``microbatch``
    rows on a mesh of ``sizes``, for ``device``'s kernels. ``device_bytes``: the memory to
    judge it against (default the card's)."""
    spec = _run_spec(config)
    B, T = spec.data.global_batch_size, spec.data.seq_len
    split = batch_split(sizes)
    if microbatch % split or B % microbatch:
        raise ConfigError(
            f"config.train.microbatch_size: {microbatch} rows must divide the global batch "
            f"{B} and be a multiple of data x fsdp x expert = {split}")
    rows, accum = microbatch // split, B // microbatch
    m = spec.model
    st = state_bytes(spec, sizes)
    act = activations(config, sizes, device.platform, exact)
    pbytes = _dtype_bytes(st.param_dtype.split(",")[0])
    cbytes = jnp.dtype(m.compute_dtype).itemsize
    P = st.param_count
    out = [
        Row("parameters", st.params, f"{P:,} parameters on this device x {pbytes} B "
                                     f"({st.param_dtype})"),
        Row("optimizer state", st.opt_state, f"{spec.opt.name}: {st.opt_dtypes}"),
    ]
    if st.model_state:
        out.append(Row("routing biases", st.model_state, "one per expert per MoE layer"))
    if accum == 1:
        out.append(Row("gradients", P * pbytes, f"{P:,} x {pbytes} B, in the parameter dtype"))
    elif spec.train.grad_accum_dtype == "bfloat16" and cbytes == 2 and st.low_grad_count:
        # The matrices: sums, one micro-batch's gradient and the copies it is taken against,
        # in bfloat16; the rest: sums and one micro-batch's, in the parameter dtype.
        L, rest = st.low_grad_count, P - st.low_grad_count
        out.append(Row("gradients", 3 * L * 2 + 2 * rest * pbytes,
                       f"{accum} micro-batches summed in bfloat16: sums, one micro-batch's and "
                       f"the weights rounded once, 3 x {L:,} x 2 B; the other parameters' "
                       f"sums and one micro-batch's, 2 x {rest:,} x {pbytes} B"))
    else:
        copies = P * cbytes if m.compute_dtype != jnp.dtype(st.param_dtype.split(",")[0]) else 0
        out.append(Row("gradients", P * 4 + P * pbytes + copies,
                       f"{accum} micro-batches: float32 sums {P:,} x 4 B + one micro-batch's "
                       f"{P:,} x {pbytes} B" + (f" + the weights rounded once to "
                                                f"{jnp.dtype(m.compute_dtype).name}, "
                                                f"{P:,} x {cbytes} B" if copies else "")))
    kept = act.at(rows)
    if sizes["context"] > 1 and kept.get("kda"):
        # Context-parallel KDA runs the op on values widened by K columns (kda_context: the
        # shard's transition carried through the tokens beside its output), so the op keeps
        # about twice the one-device layer's values.
        kept["kda"] *= 2
    where = f"{rows} row(s) x {act.tokens_per_row} tokens on this device, remat {m.remat!r}"
    for part in [p for p in PART_NAMES if kept.get(p)]:
        out.append(Row(f"activations: {part}", kept[part], f"{PART_NAMES[part]}; {where}"))
    factor = WORKING_SET_FACTORS[device.platform]
    work = int(factor * act.layer_values_per_row * rows)
    out.append(Row("backward working set", work,
                   f"{factor:g} x the largest layer's forward values "
                   f"({_gib(act.layer_values_per_row)} per row) x {rows} row(s)"))
    chunk = min(m.head_chunk, act.tokens_per_row)
    vocab = m.vocab_size // sizes["tensor"]
    out.append(Row("loss head working set", HEAD_BUFFERS * rows * chunk * vocab * 4,
                   f"{HEAD_BUFFERS} x float32 logits of {rows} row(s) x {chunk} tokens "
                   f"(model.head_chunk) x {vocab} vocabulary entries"))
    coll, parts = 0, []
    if sizes["fsdp"] > 1:
        # One unit's weights as this device's slice of the other axes holds them (experts
        # over expert, heads over tensor), gathered over fsdp alone.
        share = min(1.0, P * sizes["fsdp"] / max(st.total_param_count, 1))
        unit = int(st.layer_param_count * share)
        coll += 2 * unit * cbytes + unit * pbytes
        parts.append(f"fsdp: 2 x {unit:,} weights of the largest layer or scan step gathered in "
                     f"{jnp.dtype(m.compute_dtype).name} + their gradient before the "
                     f"reduce-scatter")
    tokens = rows * act.tokens_per_row
    if sizes["tensor"] > 1:
        coll += 2 * tokens * m.d_model * cbytes
        parts.append("tensor: 2 x the residual stream of the micro-batch")
    if sizes["expert"] > 1 and m.moe is not None:
        coll += 2 * tokens * m.moe.top_k * m.d_model * cbytes
        parts.append(f"expert: sent and received tokens x top_k {m.moe.top_k} x d_model")
    if sizes["context"] > 1 and "M" in m.pattern:
        mla = m.mla
        coll += rows * T * (mla.kv_lora_rank + mla.shared_head_dim) * cbytes
        parts.append("context: one MLA layer's latents of the whole sequence, gathered")
    if coll:
        out.append(Row("collective buffers", coll, "; ".join(parts)))
    out.append(Row("runtime reserve", RESERVE_BYTES, "workspaces, the program, the allocator"))
    if device_bytes is None and device.memory_gib:
        device_bytes = int(device.memory_gib * GiB)
    return MemoryPlan(sizes=dict(sizes), microbatch=microbatch, rows_per_device=rows,
                      accum_steps=accum, rows=tuple(out), device_bytes=device_bytes)


def _run_spec(config) -> RunSpec:
    """``run_spec(config)``, checked once per distinct config: a plan asks for it for every
    mesh and micro-batch it weighs."""
    return _run_spec_cached(_Keyed(config, config.to_json()))


@functools.lru_cache(maxsize=256)
def _run_spec_cached(key: _Keyed) -> RunSpec:
    return run_spec(key.value)


def microbatch_sizes(global_batch: int, sizes: dict[str, int]) -> list[int]:
    """Micro-batch sizes a mesh allows: multiples of data x fsdp x expert dividing the batch."""
    n = batch_split(sizes)
    return [m for m in range(n, global_batch + 1, n) if global_batch % m == 0]


def largest_microbatch(config, sizes, device: Device, device_bytes: int | None = None,
                       exact: bool = True) -> tuple[int | None, MemoryPlan]:
    """(the largest micro-batch that fits, its plan), or (None, the smallest one's plan)."""
    allowed = microbatch_sizes(int(config.data.global_batch_size), sizes)
    if not allowed:
        raise ConfigError(
            f"config.data.global_batch_size: {config.data.global_batch_size} does not divide "
            f"by data x fsdp x expert = {batch_split(sizes)}")
    smallest = memory_plan(config, sizes, allowed[0], device, device_bytes, exact)
    if smallest.fits is None:
        return allowed[-1], memory_plan(config, sizes, allowed[-1], device, device_bytes, exact)
    if not smallest.fits:
        return None, smallest
    # Memory grows with the rows: the largest that fits, by bisection.
    lo, hi, best = 0, len(allowed) - 1, (allowed[0], smallest)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        p = memory_plan(config, sizes, allowed[mid], device, device_bytes, exact)
        if p.fits:
            lo, best = mid, (allowed[mid], p)
        else:
            hi = mid - 1
    return best


def near_miss(config, sizes, device: Device, device_bytes: int | None,
              chosen: int) -> tuple[int, MemoryPlan] | None:
    """The next micro-batch above ``chosen`` when its plan is past ``MEMORY_HEADROOM`` of
    ``device_bytes`` but within all of it: (rows, its plan), else None. The plan errs by a few
    percent either way; the trainer asks XLA's compiled figure, which is exact, about this one
    (``train_lib.build``)."""
    larger = [m for m in microbatch_sizes(int(config.data.global_batch_size), sizes)
              if m > chosen]
    if not larger or not device_bytes:
        return None
    p = memory_plan(config, sizes, larger[0], device, device_bytes)
    return (larger[0], p) if not p.fits and p.total <= device_bytes else None


# ---------------------------------------------------------------------------------------------
# Step time: a roofline
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepTime:
    flops_s: float
    memory_s: float
    comm_s: float
    comm_parts: dict[str, float]

    @property
    def total(self) -> float:
        return max(self.flops_s, self.memory_s) + self.comm_s

    @property
    def mfu(self) -> float:
        return self.flops_s / self.total if self.total else 0.0


def _axis_bw(device: Device, sizes: dict[str, int], axis: str) -> float:
    """Bytes/s of one device's collective on ``axis``: the fast link while the axis and the
    ones inside it (tensor, context, expert, fsdp, data: innermost first) fit in a node."""
    inner = 1
    for a in ("tensor", "context", "expert", "fsdp", "data"):
        inner *= sizes[a]
        if a == axis:
            break
    return (device.link_gbps if inner <= device.per_node else device.net_gbps) * 1e9


def step_time(config, plan: MemoryPlan, device: Device) -> StepTime:
    """The roofline of one training step (module docstring)."""
    spec = _run_spec(config)
    m, sizes = spec.model, plan.sizes
    B, T = spec.data.global_batch_size, spec.data.seq_len
    n = math.prod(sizes.values())
    flops = flops_per_token(m, T) * B * T / n
    flops_s = flops / (device.tflops * 1e12)
    state = sum(r.bytes for r in plan.rows if r.name in ("parameters", "optimizer state",
                                                          "gradients"))
    acts = sum(r.bytes for r in plan.rows if r.name.startswith("activations"))
    # The optimizer reads and writes the state once; every micro-batch writes its activations
    # and reads them back, and reads the weights twice (forward, backward).
    moved = 2 * state + plan.accum_steps * (2 * acts + 2 * plan.rows[0].bytes)
    memory_s = moved / (device.hbm_gbps * 1e9)
    cbytes = jnp.dtype(m.compute_dtype).itemsize
    pbytes = plan.rows[0].bytes
    comm = {}
    ring = lambda k: (k - 1) / k
    if sizes["fsdp"] > 1:  # per micro-batch: gather forward and backward, reduce-scatter grads
        k = sizes["fsdp"]
        full = pbytes * k
        comm["fsdp"] = plan.accum_steps * 3 * full * ring(k) / _axis_bw(device, sizes, "fsdp")
    if sizes["data"] > 1:
        k = sizes["data"]
        comm["data"] = 2 * pbytes * ring(k) / _axis_bw(device, sizes, "data")
    tokens = B * T / batch_split(sizes) / sizes["context"]
    if sizes["tensor"] > 1:  # two all-reduces per sublayer forward, two backward
        k = sizes["tensor"]
        per = 2 * tokens * m.d_model * cbytes * ring(k)
        comm["tensor"] = 4 * 2 * m.num_layers * per / _axis_bw(device, sizes, "tensor")
    if sizes["expert"] > 1 and m.moe is not None:  # dispatch + combine, forward and backward
        k = sizes["expert"]
        moe_layers = m.num_layers - m.moe.first_k_dense
        per = tokens * m.moe.top_k * m.d_model * cbytes * ring(k)
        comm["expert"] = 4 * moe_layers * per / _axis_bw(device, sizes, "expert")
    if sizes["context"] > 1:
        k = sizes["context"]
        lat = tokens * k * (m.mla.kv_lora_rank + m.mla.shared_head_dim) * cbytes * ring(k)
        comm["context"] = 3 * m.pattern.count("M") * lat / _axis_bw(device, sizes, "context")
    return StepTime(flops_s=flops_s, memory_s=memory_s, comm_s=sum(comm.values()),
                    comm_parts=comm)


def candidate_meshes(config, devices: int, device: Device) -> list[dict[str, int]]:
    """Every (data, fsdp, expert, context, tensor) over ``devices`` that the model's shapes
    allow: expert only with experts (dividing their number), tensor dividing the heads, the
    MLP and the vocabulary, context dividing seq_len, and the global batch split over
    data x fsdp x expert."""
    spec = run_spec(config)
    m = spec.model
    B, T = spec.data.global_batch_size, spec.data.seq_len
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    out = []
    # Tensor parallelism inside a node only (its all-reduces are per sublayer); context
    # parallelism up to 16 (beyond it the latent gathers dominate).
    tps = [d for d in divisors if d <= device.per_node]
    cps = [d for d in divisors if d <= 16]
    for tp, cp, ep in itertools.product(tps, cps, divisors):
        if devices % (tp * cp * ep):
            continue
        if ep > 1 and (m.moe is None or m.moe.num_experts % ep):
            continue
        if tp > 1 and any(x % tp for x in (m.kda.num_heads, m.mla.num_heads, m.mlp_dim,
                                            m.vocab_size)):
            continue
        if cp > 1 and T % cp:
            continue
        rest = devices // (tp * cp * ep)
        for fsdp in [d for d in divisors if rest % d == 0]:
            sizes = {"data": rest // fsdp, "fsdp": fsdp, "expert": ep, "context": cp,
                     "tensor": tp}
            if B % batch_split(sizes) == 0:
                out.append(sizes)
    return out


def rank_meshes(config, devices: int, device: Device, device_bytes: int | None = None,
                limit: int = 10) -> list[tuple[dict, int | None, MemoryPlan, StepTime | None]]:
    """(sizes, micro-batch, plan, step time) for the meshes that fit, fastest first; those
    that do not fit follow, smallest shortfall first. At most ``limit`` of each."""
    fits, short = [], []
    for sizes in candidate_meshes(config, devices, device):  # the config's own mesh is not read
        try:
            mb, plan = largest_microbatch(config, sizes, device, device_bytes, exact=False)
        except (ConfigError, ValueError):  # a shape that does not shard on this mesh
            continue
        if mb is None:
            short.append((sizes, None, plan, None))
        else:
            fits.append((sizes, mb, plan, step_time(config, plan, device)))
    fits.sort(key=lambda x: x[3].total)
    short.sort(key=lambda x: x[2].total)
    return fits[:limit] + short[:limit]


# ---------------------------------------------------------------------------------------------
# Inference
# ---------------------------------------------------------------------------------------------


def cache_bytes_per_sequence(config, context: int) -> dict[str, int]:
    """The decode cache of one sequence of ``context`` tokens, by part (``HybridLM.init_cache``):
    each KDA layer's float32 state [HV, K, V] and its convolution tails, each MLA layer's
    latents [context, kv_lora_rank + shared_head_dim] in the compute dtype."""
    m = model_spec(config.model)
    cbytes = jnp.dtype(m.compute_dtype).itemsize
    k, a = m.kda, m.mla
    kda = 4 * k.num_v_heads * k.head_dim * k.head_dim + cbytes * (k.conv_width - 1) * (
        2 * k.num_heads * k.head_dim + k.num_v_heads * k.head_dim)
    return {"kda": m.pattern.count("K") * kda,
            "mla": m.pattern.count("M") * context * (a.kv_lora_rank + a.shared_head_dim) * cbytes}


def inference_rows(config, device: Device, contexts: Sequence[int], piece_len: int,
                   device_bytes: int | None = None) -> list[dict]:
    """Per context length: cache bytes per sequence, the largest decode batch that fits one
    device with the weights in the compute dtype, and prefill's peak at ``piece_len`` tokens a
    piece (one layer's forward values of a piece on top of weights and cache)."""
    m = model_spec(config.model)
    device_bytes = device_bytes or int(device.memory_gib * GiB)
    cbytes = jnp.dtype(m.compute_dtype).itemsize
    weights = state_bytes(run_spec(config), dict.fromkeys(MESH_AXES, 1)).param_count * cbytes
    act = activations(config, dict.fromkeys(MESH_AXES, 1), device.platform)
    piece = int(act.layer_values_per_row * piece_len / act.tokens_per_row)
    out = []
    for L in contexts:
        cache = cache_bytes_per_sequence(config, L)
        per_seq = sum(cache.values())
        room = MEMORY_HEADROOM * device_bytes - weights - RESERVE_BYTES if device_bytes else 0
        out.append({"context": L, "cache_kda": cache["kda"], "cache_mla": cache["mla"],
                    "cache": per_seq, "weights": weights,
                    "max_batch": max(int(room // per_seq), 0) if device_bytes else None,
                    "prefill_peak": weights + per_seq + piece + RESERVE_BYTES})
    return out


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------


def _mesh_str(sizes: dict[str, int]) -> str:
    return " x ".join(f"{a} {sizes[a]}" for a in MESH_AXES)


def format_memory(plan: MemoryPlan) -> str:
    width = max(len(r.name) for r in plan.rows)
    lines = [f"memory per device: {_mesh_str(plan.sizes)}; micro-batch {plan.microbatch} rows "
             f"({plan.rows_per_device} per device, {plan.accum_steps} per step)"]
    for r in plan.rows:
        lines.append(f"  {r.name:<{width}}  {r.bytes / GiB:9.2f} GiB  {r.formula}")
    lines.append(f"  {'total':<{width}}  {plan.total / GiB:9.2f} GiB")
    return "\n".join(lines)


def verdict(plan: MemoryPlan) -> str:
    if plan.device_bytes is None:
        return "verdict: no device memory given (--device or --device_memory_gib)"
    limit = MEMORY_HEADROOM * plan.device_bytes
    if plan.fits:
        return (f"verdict: fits, {plan.total / GiB:.2f} of {plan.device_bytes / GiB:.2f} GiB "
                f"({(limit - plan.total) / GiB:.2f} GiB to spare below the "
                f"{MEMORY_HEADROOM:.0%} planned)")
    return (f"verdict: does not fit, {plan.total / GiB:.2f} GiB against "
            f"{MEMORY_HEADROOM:.0%} of {plan.device_bytes / GiB:.2f} GiB: "
            f"{(plan.total - limit) / GiB:.2f} GiB over")


def knobs(config, plan: MemoryPlan, device: Device) -> list[str]:
    """What would make a plan that does not fit fit, each checked on paper."""
    out = []
    sizes = plan.sizes
    smaller = [mb for mb in microbatch_sizes(int(config.data.global_batch_size), sizes)
               if mb < plan.microbatch]
    for mb in reversed(smaller):
        p = memory_plan(config, sizes, mb, device, plan.device_bytes)
        if p.fits:
            out.append(f"--config.train.microbatch_size={mb} ({p.total / GiB:.1f} GiB)")
            break
    remat = ["dots_kernels", "dots", "full"]
    cur = config.model.remat
    for r in remat[remat.index(cur) + 1:] if cur in remat else (remat if cur == "none" else []):
        cfg = copy.deepcopy(config)
        with cfg.unlocked():
            cfg.model.remat = r
        mb, p = largest_microbatch(cfg, sizes, device, plan.device_bytes)
        if mb:
            out.append(f"--config.model.remat={r} (micro-batch {mb}: {p.total / GiB:.1f} GiB)")
            break
    n = math.prod(sizes.values())
    fsdp_more = dict(sizes, fsdp=sizes["fsdp"] * sizes["data"], data=1)
    if sizes["data"] > 1:
        try:
            mb, p = largest_microbatch(config, fsdp_more, device,
                                       plan.device_bytes)
            if mb:
                out.append(f"--config.mesh.data=1 --config.mesh.fsdp={fsdp_more['fsdp']} "
                           f"(parameters sharded over all {n} devices: {p.total / GiB:.1f} GiB)")
        except ConfigError:
            pass
    state = sum(r.bytes for r in plan.rows if r.name in ("parameters", "optimizer state",
                                                          "gradients"))
    if plan.device_bytes and state > 0.5 * plan.device_bytes:
        k = math.ceil(state / (0.5 * plan.device_bytes))
        out.append(f"more devices: the train state alone is {state / GiB:.1f} GiB; sharded "
                   f"over fsdp it needs about {k * n} devices to take half of each")
    return out


def format_meshes(ranked, device: Device) -> str:
    lines = [f"meshes over {math.prod(ranked[0][0].values())} devices (roofline: "
             f"{device.tflops:g} TFLOP/s, {device.hbm_gbps:g} GB/s memory, {device.link_gbps:g} "
             f"GB/s link inside {device.per_node}, {device.net_gbps:g} GB/s across; no overlap "
             f"of collectives assumed; activations scaled from one device's trace):"]
    lines.append(f"  {'data':>5} {'fsdp':>5} {'expert':>6} {'ctx':>4} {'tensor':>6}  "
                 f"{'micro':>5} {'memory':>10}  {'step s':>8} {'MFU':>5}  collectives")
    for sizes, mb, plan, t in ranked:
        head = (f"  {sizes['data']:>5} {sizes['fsdp']:>5} {sizes['expert']:>6} "
                f"{sizes['context']:>4} {sizes['tensor']:>6}  ")
        if t is None:
            lines.append(head + f"{'-':>5} {plan.total / GiB:7.1f} GiB  does not fit")
            continue
        comm = ", ".join(f"{k} {v:.2f} s" for k, v in t.comm_parts.items()) or "-"
        lines.append(head + f"{mb:>5} {plan.total / GiB:7.1f} GiB  {t.total:8.3f} "
                            f"{t.mfu:5.0%}  {comm}")
    return "\n".join(lines)


def format_step(t: StepTime) -> str:
    comm = ", ".join(f"{k} {v:.3f} s" for k, v in t.comm_parts.items()) or "none"
    return (f"step time (roofline): {t.total:.3f} s = max(FLOPs {t.flops_s:.3f} s, memory "
            f"traffic {t.memory_s:.3f} s) + collectives {t.comm_s:.3f} s ({comm}); "
            f"MFU {t.mfu:.0%}")


def format_inference(rows: list[dict], piece_len: int) -> str:
    lines = [f"inference, one device, weights in the compute dtype "
             f"({rows[0]['weights'] / GiB:.2f} GiB):",
             f"  {'context':>9}  {'cache/seq':>10} {'(KDA':>8} {'MLA)':>9}  {'max batch':>9}  "
             f"prefill peak at {piece_len}-token pieces"]
    for r in rows:
        mb = "-" if r["max_batch"] is None else str(r["max_batch"])
        lines.append(f"  {r['context']:>9,}  {r['cache'] / GiB:7.3f} GiB {r['cache_kda'] / GiB:8.3f}"
                     f" {r['cache_mla'] / GiB:9.3f}  {mb:>9}  {r['prefill_peak'] / GiB:.2f} GiB")
    return "\n".join(lines)


def local_device(memory_bytes: int | None) -> Device:
    """The card this process runs on, as the planner knows it: ``DEVICES``' entry for its kind
    (``pallas_kernels.device.probe``), with the allocator's ``memory_bytes`` as its memory; an
    unknown card: its platform's kernels and that memory (no rates: no step time)."""
    from pallas_kernels import device as device_lib

    found = device_lib.probe()
    kind = found.kind.lower()
    for key, names in KIND_NAMES:
        if any(n in kind for n in names):
            d = DEVICES[key]
            return dataclasses.replace(d, memory_gib=(memory_bytes or 0) / GiB or d.memory_gib)
    return Device(found.kind, found.platform if found.platform in TARGET_IMPLS else "cpu",
                  (memory_bytes or 0) / GiB, 0, 0, 0, 0, 1)


def device_for(name: str, memory_gib: float = 0.0) -> Device:
    """``DEVICES[name]``, its memory replaced by ``memory_gib`` when given."""
    if name not in DEVICES:
        raise ConfigError(f"--device: {name!r} is not one of {sorted(DEVICES)}")
    d = DEVICES[name]
    return dataclasses.replace(d, memory_gib=memory_gib) if memory_gib else d


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "The config: configs/x.py[:arg] or a run "
                                    "folder; --config.FIELD=VALUE overrides.",
                                    lock_config=True)
    flags.DEFINE_integer("devices", 1, "Devices of the mesh.", lower_bound=1)
    flags.DEFINE_enum("device", "h100", sorted(DEVICES), "The card: its kernels, memory, FLOP "
                      "rate and bandwidths.")
    flags.DEFINE_float("device_memory_gib", 0.0, "Memory per device in GiB (default: the "
                       "card's).", lower_bound=0.0)
    flags.DEFINE_integer("meshes", 10, "Also rank this many meshes over --devices that fit "
                         "(0: the config's mesh only).", lower_bound=0)
    flags.DEFINE_list("inference_contexts", ["131072", "1048576"], "Context lengths of the "
                      "inference table (empty: none).")
    flags.DEFINE_integer("piece_len", 2048, "Prefill piece length of the inference table.",
                         lower_bound=1)
    flags.mark_flag_as_required("config")


def plan_text(config, devices: int, device: Device, meshes: int = 10,
              contexts: Sequence[int] = (), piece_len: int = 2048) -> str:
    """Everything the command prints."""
    sizes = mesh_sizes(config, devices)
    spec = run_spec(config)
    lines = [f"plan: {spec.model.num_layers} layers {spec.model.pattern[:24]}"
             f"{'...' if len(spec.model.pattern) > 24 else ''}, batch "
             f"{spec.data.global_batch_size} x {spec.data.seq_len}, {spec.opt.name}, remat "
             f"{spec.model.remat!r}, {jnp.dtype(spec.model.compute_dtype).name}; "
             f"{devices} x {device.name} ({device.memory_gib:g} GiB)"]
    micro = int(config.train.microbatch_size)
    if micro:
        plan = memory_plan(config, sizes, micro, device)
        chosen = f"config.train.microbatch_size = {micro}"
    else:
        mb, plan = largest_microbatch(config, sizes, device)
        chosen = (f"the largest micro-batch that fits: {mb} rows" if mb else
                  "no micro-batch fits; the smallest is shown")
    lines += ["", format_memory(plan), f"({chosen})", verdict(plan)]
    if plan.fits is False:
        fixes = knobs(config, plan, device)
        lines += ["what would fit:"] + [f"  {k}" for k in fixes] if fixes else [
            "nothing on this mesh fits: more devices, or a smaller model"]
    else:
        lines.append(format_step(step_time(config, plan, device)))
    if meshes:
        ranked = rank_meshes(config, devices, device, plan.device_bytes, meshes)
        if ranked:
            lines += ["", format_meshes(ranked, device)]
    if contexts:
        lines += ["", format_inference(inference_rows(config, device, contexts, piece_len),
                                       piece_len)]
    lines += ["", f"assumptions: activations from JAX's remat residuals traced with the "
                  f"{device.platform} kernels; backward working set "
                  f"{WORKING_SET_FACTORS[device.platform]:g} x the largest layer's values, "
                  f"{HEAD_BUFFERS} logit buffers of the loss head; runtime reserve "
                  f"{RESERVE_BYTES / GiB:g} GiB; "
                  f"plans fill at most {MEMORY_HEADROOM:.0%} of device memory; XLA's own "
                  f"fusion and buffer reuse are not modelled"]
    return "\n".join(lines)


def _tokens(text: str) -> int:
    """'128K' -> 131072, '1M' -> 1048576, '4096' -> 4096."""
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2}.get(text[-1:], 1)
    n = int(text[:-1] if scale > 1 else text) * scale
    if n < 1:
        raise ValueError(f"{text!r} is not a positive number of tokens")
    return n


def main(argv: Sequence[str]) -> None:
    from absl import app, flags, logging

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    F = flags.FLAGS
    if not F["verbosity"].present:  # the kernel choices the traces make are not the plan's
        logging.set_verbosity(logging.WARNING)
    device = device_for(F.device, F.device_memory_gib)
    try:
        contexts = tuple(_tokens(v) for v in F.inference_contexts)
    except ValueError as e:
        raise ConfigError(f"--inference_contexts: {e}; allowed: token counts such as 131072, "
                          f"128K or 1M") from e
    print(plan_text(F.config, F.devices, device, F.meshes, contexts, F.piece_len))


if __name__ != "kimi_k3.plan":
    define_flags()

if __name__ == "__main__":
    from kimi_k3 import cli

    cli.run(main)
