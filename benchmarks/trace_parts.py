"""Where a profiled program's device time goes: each kernel of a ``jax.profiler`` trace matched
to the HLO instruction that launched it, and that instruction's ``op_name`` (the name stack of
the model's ``jax.named_scope`` labels) to a part of the model and a phase (forward, recompute,
backward). Shared by benchmarks/step_profile.py (the training step) and
benchmarks/decode_bench.py (the one-token step); the parts are listed in step_profile's
docstring.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

PARTS = ("kda_proj", "kda_conv", "kda_gate", "kda_core", "kda_out", "mla_proj", "mla_attention",
         "mla_out", "mlp", "moe", "norm", "attn_res", "embed", "head", "loss", "optimizer",
         "expert_bias")
PHASES = ("forward", "recompute", "backward")
_PART = re.compile(r"(?<![\w])(" + "|".join(PARTS) + r")(?![\w])")
# A mixture of experts' own stages, labelled inside its "moe" scope (the custom gradient's
# kernels carry them without the outer label).
MOE_PARTS = ("moe_router", "moe_dispatch", "moe_experts", "moe_combine", "moe_shared",
             "moe_latent")
_MOE_PART = re.compile(r"(?<![\w])(" + "|".join(MOE_PARTS) + r")(?![\w])")


# ---------------------------------------------------------------------------------------------
# HLO instruction -> (part, phase)
# ---------------------------------------------------------------------------------------------


def part_and_phase(op_name: str) -> tuple[str, str]:
    """The outermost named-scope label in ``op_name`` (so a norm inside ``kda_out`` counts as
    kda_out) and the phase the name stack says."""
    m = _MOE_PART.search(op_name) or _PART.search(op_name)  # the first (outermost) label,
    part = m.group(1) if m else "other"                      # inside transform wrappers too
    if "rematted_computation" in op_name:
        phase = "recompute"
    elif "transpose(" in op_name:
        phase = "backward"
    else:
        phase = "forward"
    return part, phase


_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ")
_COMP = re.compile(r"^%?([\w.\-]+) \(.*\) -> .* \{$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def op_names_from_hlo(hlo_text: str) -> dict[str, str]:
    """Instruction name -> op_name for every instruction of a compiled module's text; a fusion
    without metadata of its own takes its fused computation's root's."""
    own, calls, roots = {}, {}, {}
    comp = None
    for line in hlo_text.splitlines():
        m = _COMP.match(line.strip())
        if m:
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        is_root, name = m.groups()
        op_name, called = _OP_NAME.search(line), _CALLS.search(line)
        if op_name:
            own[name] = op_name.group(1)
            if is_root and comp:
                roots[comp] = op_name.group(1)
        if called:
            calls[name] = called.group(1)
    out = dict(own)
    for name, called in calls.items():
        if name not in out and called in roots:
            out[name] = roots[called]
    return out


def kernel_times(trace_dir: str) -> list[tuple[str, float]]:
    """(hlo_op, microseconds) of every device-side event of the newest trace in ``trace_dir``
    (on CPU, where there is no device timeline, the host's XLA thunks)."""
    return [(op, dur) for op, _, dur in kernel_events(trace_dir)]


def idle_before(events: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """(hlo_op, microseconds) for each kernel that started after the device had gone idle:
    the time from the end of everything before it (a running maximum, so kernels that overlap
    on several streams leave no false gap) to its start. ``events``: (hlo_op, start, duration)
    in microseconds, any order. The first kernel has none."""
    out, end = [], None
    for op, ts, dur in sorted(events, key=lambda e: e[1]):
        if end is not None and ts > end:
            out.append((op, ts - end))
        end = ts + dur if end is None else max(end, ts + dur)
    return out


def kernel_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(hlo_op, start, duration), microseconds, of every device-side event of the newest trace
    in ``trace_dir`` (on CPU, the host's XLA thunks)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")))
    if not files:
        raise FileNotFoundError(f"--trace_dir: no *.trace.json.gz under {trace_dir!r}")
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    # libtpu, when installed, adds a "/device:CUSTOM:..." track of its own even on a CPU: not
    # a device this step ran on.
    device_pids = {p for p, n in names.items() if "/device:" in n and "CUSTOM" not in n}
    out = []
    for e in events:
        if e.get("ph") != "X" or "hlo_op" not in e.get("args", {}):
            continue
        if device_pids and e["pid"] not in device_pids:
            continue
        out.append((e["args"]["hlo_op"], float(e["ts"]), float(e["dur"])))
    return out


def attribute(events: list[tuple[str, float, float]], op_names: dict[str, str],
              steps: int) -> dict:
    """Kernel time per step by (part, phase) (``parts``), by HLO instruction (``ops``, largest
    first; ``top``: the first 25), the device's idle time by the part whose kernel came next
    (``idle``: part -> (ms, gaps)) and the kernels per step (``kernels``), from the trace's
    ``events`` (``kernel_events``) of ``steps`` calls of the program whose instructions'
    ``op_names`` are given (``op_names_from_hlo``)."""
    per = collections.defaultdict(float)
    per_op = collections.defaultdict(float)
    for hlo_op, _, us in events:
        part, phase = part_and_phase(op_names.get(hlo_op, ""))
        per[(part, phase)] += us / steps / 1e3
        per_op[(hlo_op, op_names.get(hlo_op, "?"))] += us / steps / 1e3
    # Idle device time, by the part whose kernel came next (the one the device waited for);
    # waits longer than a millisecond are the host between traced calls, counted apart.
    idle = collections.defaultdict(lambda: [0.0, 0])
    for hlo_op, us in idle_before(events):
        part = "(between steps)" if us > 1e3 else part_and_phase(op_names.get(hlo_op, ""))[0]
        idle[part][0] += us / steps / 1e3
        idle[part][1] += 1
    ops = sorted(per_op.items(), key=lambda kv: -kv[1])
    return {"parts": dict(per), "ops": ops, "top": ops[:25], "kernels": len(events) / steps,
            "idle": {part: (ms, n / steps) for part, (ms, n) in idle.items()}}


# The step by stage, as a mixture-of-experts step is read: (row, the parts it sums). The
# experts' own kernels are split further by ``expert_stage``.
STAGES = (
    ("router (forward + backward)", ("moe_router",)),
    ("sort / permute", ("moe_dispatch",)),
    ("expert products: forward", ()),
    ("expert products: forward again in the backward pass (remat)", ()),
    ("expert products: data gradients", ()),
    ("expert products: weight gradients", ()),
    ("experts' other kernels", ()),
    ("unpermute / combine", ("moe_combine",)),
    ("shared experts", ("moe_shared",)),
    ("latent projections (LatentMoE)", ("moe_latent",)),
    ("the mixture's other kernels", ("moe",)),
    ("attention (MLA)", ("mla_proj", "mla_attention", "mla_out")),
    ("KDA", ("kda_proj", "kda_conv", "kda_gate", "kda_core", "kda_out")),
    ("Attention Residuals", ("attn_res",)),
    ("dense FFN (SwiGLU)", ("mlp",)),
    ("head / loss / embed", ("head", "loss", "embed")),
    ("optimizer", ("optimizer", "expert_bias")),
    ("norms", ("norm",)),
    ("other (gradient sums over micro-batches, copies, ...)", ("other",)),
)
_WGRAD = re.compile(r"(?<![\w])(gmm_wgrad|wgrad)(?![\w])")
_DATA_GRAD = re.compile(r"(?<![\w])gmm_t(?![\w])")
_PRODUCT = re.compile(r"(?<![\w])(gmm|ragged_dot|dot_general|grouped_matmul)(?![\w])")


def expert_stage(op_name: str, phase: str) -> str:
    """The STAGES row of one of the experts' kernels (part ``moe_experts``): its product by the
    kernel's name (``gmm`` forward, ``gmm_t`` data gradients, ``gmm_wgrad`` weight gradients, an
    XLA product by its phase), or the experts' other kernels."""
    if _WGRAD.search(op_name):
        return "expert products: weight gradients"
    if _DATA_GRAD.search(op_name):
        return "expert products: data gradients"
    if _PRODUCT.search(op_name):
        if phase == "forward":
            return "expert products: forward"
        if "gmm" in op_name:  # the forward's kernel inside the backward: recomputed
            return "expert products: forward again in the backward pass (remat)"
        return "expert products: data gradients"  # an XLA product's transpose (dx or dW)
    return "experts' other kernels"


def stages(ops: list[tuple[tuple[str, str], float]], min_ms: float = 0.05
           ) -> list[tuple[str, float]]:
    """Milliseconds per step by STAGES row (in its order; rows under ``min_ms`` left out), from
    ``attribute``'s ``ops`` ((hlo_op, op_name), ms)."""
    of_part = {part: row for row, parts in STAGES for part in parts}
    per = collections.defaultdict(float)
    for (_, op_name), ms in ops:
        part, phase = part_and_phase(op_name if op_name != "?" else "")
        row = expert_stage(op_name, phase) if part == "moe_experts" else of_part[part]
        per[row] += ms
    return [(row, per[row]) for row, _ in STAGES if per.get(row, 0.0) >= min_ms and row in per]


def commands_apart() -> None:
    """Asks XLA (before its GPU backend starts) to launch every kernel by itself: with CUDA
    graphs ("command buffers", on by default) a trace shows one event per graph, not per
    kernel, and nothing can be attributed. Kept where XLA_FLAGS already names the option."""
    flags_now = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags_now:
        os.environ["XLA_FLAGS"] = f"{flags_now} --xla_gpu_enable_command_buffer=".strip()
