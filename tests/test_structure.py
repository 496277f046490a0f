"""How the package hangs together, as ARCHITECTURE.md states it: no import loop; who may import
whom (the readers beside the trainer, not on it; the config room free of kernels; the package
free of the configs/ folder); the package standing alone outside the repository; no module-level
mutable state; the config checked once on its way to the layers; one dispatch contract; one
device probe."""

from __future__ import annotations

import ast
import configparser
import fnmatch
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_k3 import config as config_lib
from kimi_k3 import dispatch, mesh, train_lib
from kimi_k3.ops import kda
from pallas_kernels import device
from pallas_kernels.tuning import KernelTuning
from tests.helpers import REPO, fake_device, load_config, make_inputs

PACKAGES = ("kimi_k3", "pallas_kernels")


# ---------------------------------------------------------------------------------------------
# The import graph
# ---------------------------------------------------------------------------------------------


def imported_modules(path: Path, packages=PACKAGES + ("configs",)) -> set[str]:
    """Every module of ``packages`` a file imports, anywhere in it (function bodies too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if any(n == p or n.startswith(p + ".") for p in packages)}
    return out


def module_files() -> dict[str, Path]:
    """{"kimi_k3.layers.mla": path, ...} for every module of the packages."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            rel = path.relative_to(REPO).with_suffix("")
            modules[".".join(p for p in rel.parts if p != "__init__")] = path
    return modules


def package_graph() -> dict[str, set[str]]:
    """module -> the modules of the packages it imports."""
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imp in imported_modules(path, PACKAGES):
            # "from kimi_k3 import data" imports kimi_k3.data; keep only real modules.
            while imp and imp not in modules:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and imp not in PACKAGES:
                deps.add(imp)
        graph[name] = deps
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_packages_have_no_import_loop():
    graph = package_graph()
    assert "kimi_k3.config" in graph and "kimi_k3.train_lib" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    # and the test can see one
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# The rooms of ARCHITECTURE.md, bottom up, and what each may not reach (directly or through
# another module). A module's room is the first pattern that matches its name.
TRAINER = ("kimi_k3.train_lib",)
READERS = ("kimi_k3.evaluation", "kimi_k3.eval_scoring", "kimi_k3.eval_report", "kimi_k3.sweep",
           "kimi_k3.generate", "kimi_k3.passkey", "kimi_k3.mqar", "kimi_k3.hf", "kimi_k3.hf.*",
           "kimi_k3.ruler", "kimi_k3.lm_eval_adapter")
SHARED = ("kimi_k3.cli", "kimi_k3.model_state", "kimi_k3.train_state", "kimi_k3.checkpoint",
          "kimi_k3.run_dir",
          "kimi_k3.runtime", "kimi_k3.data", "kimi_k3.mesh", "kimi_k3.optim", "kimi_k3.metrics",
          "kimi_k3.plots", "kimi_k3.compile_cache", "kimi_k3.plan", "kimi_k3.internals")
MODEL = ("kimi_k3", "kimi_k3.model", "kimi_k3.layers", "kimi_k3.layers.*", "kimi_k3.sharding",
         "kimi_k3.ops", "kimi_k3.ops.*", "kimi_k3.dispatch", "kimi_k3.config",
         "kimi_k3.config_files", "kimi_k3.trees")
KERNELS = ("pallas_kernels", "pallas_kernels.*")
# Tools that put the trainer and the readers together (compiling all of their programs ahead of
# time): on top of both, and imported by neither.
TOOLS = ("kimi_k3.aot",)
ROOMS = [("kernels", KERNELS, ("kimi_k3.*",)),
         ("model", MODEL, SHARED + TRAINER + READERS + TOOLS),
         ("shared", SHARED, TRAINER + READERS + TOOLS),
         ("trainer", TRAINER, READERS + TOOLS),
         ("readers", READERS, TRAINER + TOOLS),
         ("tools", TOOLS, ())]


def room_of(module: str) -> tuple[str, tuple[str, ...]]:
    for room, members, forbidden in ROOMS:
        if any(fnmatch.fnmatchcase(module, p) for p in members):
            return room, forbidden
    raise AssertionError(f"{module} belongs to no room of ARCHITECTURE.md: add it to ROOMS")


def test_who_may_import_whom():
    """Kernels under the model under the shared rooms; the trainer and the readers are
    siblings on top (no reader reaches train_lib, and train_lib no reader)."""
    graph = package_graph()
    wrong = []
    for module in sorted(graph):
        room, forbidden = room_of(module)
        for dep in sorted(reachable(graph, module)):
            if any(fnmatch.fnmatchcase(dep, p) for p in forbidden):
                wrong.append(f"{module} ({room}) reaches {dep}")
    assert not wrong, "\n".join(wrong)
    # and the test can see a wrong arrow
    assert room_of("kimi_k3.generate")[1] == TRAINER + TOOLS


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.py")), ids=lambda p: p.name)
def test_configs_import_the_config_room_only(path):
    """A config file imports the config room and the loader (and the model, to print its
    parameter counts under ``python -m configs.x``), never the trainer or a reader."""
    allowed = {"kimi_k3.config", "kimi_k3.config_files", "kimi_k3.model"}
    used = {m.rpartition(".")[0] if m.rpartition(".")[0] in allowed else m
            for m in imported_modules(path)}
    assert used <= allowed, used - allowed


def test_the_package_never_imports_the_configs_folder():
    for name, path in module_files().items():
        assert not {m for m in imported_modules(path) if m.split(".")[0] == "configs"}, name
    assert not (REPO / "configs" / "__init__.py").exists()  # configs/ holds experiment files only


def test_the_config_room_loads_no_kernel():
    """``import kimi_k3.config`` (what every config file does) loads no kernel module and no
    Pallas: the device probe and the tuning's dataclass only."""
    code = ("import sys, kimi_k3.config, kimi_k3.config_files\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith(('pallas_kernels', "
            "'jax.experimental.pallas', 'jax._src.pallas'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = set(out.stdout.split())
    assert loaded <= {"pallas_kernels", "pallas_kernels.device", "pallas_kernels.tuning"}, loaded


def shipped_packages() -> list[str]:
    """The packages setup.cfg's ``packages = find:`` ships: folders with an __init__.py whose
    dotted name matches one of its include patterns."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    include = cfg["options.packages.find"]["include"].split()
    found = []
    for init in REPO.rglob("__init__.py"):
        name = ".".join(init.parent.relative_to(REPO).parts)
        if any(fnmatch.fnmatchcase(name, p) for p in include):
            found.append(name)
    return sorted(found)


def test_every_module_folder_is_a_shipped_package():
    """A folder of modules without an __init__.py would be left out of the wheel."""
    shipped = set(shipped_packages())
    for name in module_files():
        folder = name if (REPO / Path(*name.split("."))).is_dir() else name.rpartition(".")[0]
        assert folder in shipped, f"{name}: its folder {folder} is not shipped by setup.cfg"


def test_the_installed_package_stands_alone(tmp_path):
    """The files a wheel ships, copied to another folder, import from there without the
    repository (no configs/, no tests/): every public module, and a config file by path."""
    site = tmp_path / "site"
    for package in shipped_packages():
        src = REPO / Path(*package.split("."))
        dst = site / Path(*package.split("."))
        dst.mkdir(parents=True)
        for f in src.glob("*.py"):
            shutil.copy(f, dst / f.name)
    modules = sorted(n for n in module_files() if not n.rpartition(".")[2].startswith("_")
                     or n in PACKAGES)
    config_file = tmp_path / "cfg.py"
    shutil.copy(REPO / "configs" / "tiny.py", config_file)
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "import kimi_k3\n"
            f"assert kimi_k3.__file__.startswith({str(site)!r}), kimi_k3.__file__\n"
            "assert 'configs' not in sys.modules and not any(m.startswith('configs.') for m in sys.modules)\n"
            "from kimi_k3.config_files import load_config\n"
            f"print(load_config({str(config_file)!r}).model.num_layers)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=site, capture_output=True, text=True,
                         timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "4"


# ---------------------------------------------------------------------------------------------
# Module state
# ---------------------------------------------------------------------------------------------

MUTATING_METHODS = {"append", "extend", "update", "add", "setdefault", "pop", "popitem", "clear",
                    "insert", "remove", "discard"}


def module_state_writes(source: str) -> list[str]:
    """Where functions write module-level state: ``global`` statements, and item assignments
    or mutating method calls on a module-level name bound to a dict, list or set.
    (``functools.cache`` on a function of its arguments is how the package remembers answers
    that cannot change within a process, such as the device probe; it is not flagged.)"""
    tree = ast.parse(source)
    mutable = set()
    for node in tree.body:
        value = getattr(node, "value", None)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        is_mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                                        ast.SetComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict"))
        if is_mutable:
            mutable |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                found.append(f"line {n.lineno}: global {', '.join(n.names)}")
            targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else (
                [n.target] if isinstance(n, ast.AugAssign) else [])
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) \
                        and t.value.id in mutable:
                    found.append(f"line {n.lineno}: {t.value.id}[...] written")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and isinstance(n.func.value, ast.Name) and n.func.value.id in mutable \
                    and n.func.attr in MUTATING_METHODS:
                found.append(f"line {n.lineno}: {n.func.value.id}.{n.func.attr}()")
    return found


def test_no_module_level_mutable_state():
    writes = {name: w for name, path in module_files().items()
              if (w := module_state_writes(path.read_text()))}
    assert not writes, writes
    # and the check can see each kind
    assert len(module_state_writes("_SEEN = {}\nX = []\n\ndef f(k):\n    _SEEN[k] = 1\n"
                                   "    X.append(k)\n\ndef g():\n    global Y\n")) == 3


# ---------------------------------------------------------------------------------------------
# The config checked once; one dispatch contract; one device probe
# ---------------------------------------------------------------------------------------------


def test_the_config_is_checked_once_on_its_way_to_the_layers(monkeypatch):
    """train.py -> run_spec (pattern, scan plan, dims, impl resolved) -> build -> HybridLM ->
    layers: the model section is validated exactly once."""
    calls = []
    real = config_lib._kda_spec
    monkeypatch.setattr(config_lib, "_kda_spec", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    config = load_config("tiny.py")
    spec = config_lib.run_spec(config)
    setup = train_lib.build(spec, mesh.make_mesh(spec.mesh))
    assert calls == [1]
    assert setup.spec.model.pattern == "KKKM" and setup.spec.model.scan_unit == "K"
    assert setup.spec.model.kda.impl in ("recurrent", "xla", "pallas")  # never "auto"
    assert setup.spec.model.kda.conv_impl == "xla"  # "auto" on the CPU


def test_conv_impl_auto_takes_the_kernels_on_the_gpu(monkeypatch):
    assert dispatch.choose_conv_impl("auto", backend="gpu") == "pallas"
    assert dispatch.choose_conv_impl("xla", backend="gpu") == "xla"
    assert dispatch.choose_conv_impl("auto", backend="tpu") == "xla"
    assert dispatch.choose_conv_impl("auto", backend="cpu") == "xla"
    # scanned or unrolled, the model takes them (configs/1b.py is unrolled)
    for scan in (False, True):
        model = load_config("1b.py").model
        model.scan_layers = scan
        assert config_lib.model_spec(model, backend="gpu").kda.conv_impl == "pallas", scan
    assert dispatch.choose_conv_impl("pallas", backend="cpu") == "pallas"  # interpret mode
    fake_device(monkeypatch, "gpu", triton=False)  # a JAX without Triton
    assert dispatch.choose_conv_impl("auto", backend="gpu") == "xla"
    config = load_config("tiny.py")
    config.model.kda.conv_impl = "triton"
    with pytest.raises(ValueError, match=r"config.model.kda.conv_impl.*'triton'"):
        config_lib.run_spec(config)


@pytest.mark.parametrize("field,choose", [
    ("attn_res_impl", dispatch.choose_attn_res_impl),
    ("mlp_impl", dispatch.choose_mlp_impl),
])
def test_layer_kernels_auto_on_the_gpu(monkeypatch, field, choose):
    """model.attn_res_impl and model.mlp_impl: "auto" takes the Pallas-Triton kernels on the GPU
    only, an explicit "pallas" runs anywhere (interpret mode), a bad value is named."""
    assert choose("auto", backend="gpu") == "pallas"
    assert choose("auto", backend="tpu") == "xla"
    assert choose("auto", backend="cpu") == "xla"
    assert choose("pallas", backend="cpu") == "pallas"  # interpret mode
    assert getattr(config_lib.model_spec(load_config("1b.py").model, backend="gpu"),
                   field) == "pallas"
    fake_device(monkeypatch, "gpu", triton=False)  # a JAX without Triton
    assert choose("auto", backend="gpu") == "xla"
    config = load_config("tiny.py")
    setattr(config.model, field, "fused")
    with pytest.raises(ValueError, match=rf"config.model.{field}.*'fused'"):
        config_lib.run_spec(config)


def test_kernel_tuning_is_checked_with_the_config():
    """model.kda.kernel_tuning reaches the spec as a typed KernelTuning, and a bad key or value
    is named with the field before anything is built."""
    config = load_config("tiny.py")
    config.model.kda.kernel_tuning = "hopper=0,bk=16"
    tuning = config_lib.run_spec(config).model.kda.kernel_tuning
    assert isinstance(tuning, KernelTuning) and (tuning.hopper, tuning.bk) == (0, 16)
    assert tuning == KernelTuning(hopper=0, bk=16)
    config.model.kda.kernel_tuning = ""
    assert config_lib.run_spec(config).model.kda.kernel_tuning == KernelTuning()
    for bad, says in (("warps=8", "warps=8"), ("bk=24", "bk must be a power of two"),
                      ("hopper", "'hopper'")):
        config.model.kda.kernel_tuning = bad
        with pytest.raises(ValueError, match=rf"config.model.kda.kernel_tuning: .*{says}"):
            config_lib.run_spec(config)


def test_an_explicit_impl_never_falls_back(rng, monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "kda_kernel_error", lambda backend: "no kernel here")
    q, k, v, g, beta = make_inputs(rng, B=1, T=8)
    with pytest.raises(ValueError, match="impl='pallas' cannot run here: no kernel here"):
        kda(q, k, v, g, beta, impl="pallas")
    assert dispatch.choose_kda_impl("auto", backend="gpu") == "xla"  # auto may, and says why
    with pytest.raises(ValueError, match="attention: impl='cudnn' needs q_offset=0"):
        dispatch.choose_attention_impl("cudnn", dtype="bfloat16", T=4, S=8, packed=False,
                                       continues_cache=True, backend="gpu")
    assert dispatch.choose_attention_impl("auto", dtype="bfloat16", T=256, S=256, packed=True,
                                          continues_cache=False, backend="gpu") == "cudnn"
    assert dispatch.choose_attention_impl("auto", dtype="bfloat16", T=32768, S=32768,
                                          packed=True, continues_cache=False, batch=8,
                                          backend="gpu") == "pallas"  # the mask would be 24 GiB
    with caplog.at_level(logging.INFO):
        assert dispatch.choose_attention_impl("auto", dtype="float32", T=256, S=257,
                                              packed=False, continues_cache=False,
                                              backend="gpu") == "xla"
    assert "attention: impl='auto' -> 'xla'" in caplog.text  # each choice is logged once


def test_the_device_is_probed_in_one_place():
    """Nothing outside pallas_kernels/device.py reads a device's kind or compute capability,
    and the probe says why a kernel family does not apply."""
    readers = []
    for name, path in module_files().items():
        text = path.read_text()
        if name != "pallas_kernels.device" and ("compute_capability" in text
                                                 or ".device_kind" in text):
            readers.append(name)
    assert not readers, readers
    cpu = device.probe("cpu")
    assert cpu.platform == "cpu" and not (cpu.triton or cpu.mosaic_gpu or cpu.mosaic_tpu)
    assert "not a GPU" in cpu.why_not("mosaic_gpu")
    assert "not a TPU" in device.probe("cpu").why_not("mosaic_tpu")
    with pytest.raises(ValueError, match="kernel family must be one of"):
        cpu.why_not("cuda")
    with pytest.raises(ValueError, match="platform must be one of"):
        device.probe("metal")


# ---------------------------------------------------------------------------------------------
# Logical axes in the model; numbers in BENCHMARKS.md
# ---------------------------------------------------------------------------------------------

MESH_AXES = ("data", "fsdp", "tensor", "context")  # "expert" is a logical name as well


def mesh_axis_literals(source: str) -> list[int]:
    """Lines where a string constant names a physical mesh axis."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and n.value in MESH_AXES]


def test_the_model_names_no_mesh_axis():
    """The layers, the model and the ops name logical axes only: which mesh axis a logical
    name maps to is the config's (config.mesh.axis_rules), applied in sharding.py."""
    files = [*sorted((REPO / "kimi_k3" / "layers").glob("*.py")), REPO / "kimi_k3" / "model.py",
             *sorted((REPO / "kimi_k3" / "ops").glob("*.py"))]
    found = {f.name: lines for f in files if (lines := mesh_axis_literals(f.read_text()))}
    assert not found, found
    assert mesh_axis_literals('rules = (("embed", "fsdp"),)\n') == [1]


# A figure with a unit of time, throughput or utilisation, or a card and a ratio: what a
# comment or docstring must not hold (it goes stale; BENCHMARKS.md holds the current one).
TIMING = (r"\d+(\.\d+)?\s?(ms|µs|us|seconds)\b|\d\s?(tok|tokens)/s\b|\d+(\.\d+)?%\s?MFU"
          r"|\bsession [a-z]{1,2}\b|\b(H100|H200|A100|B200)\b[^.]*\d+(\.\d+)?\s?(x|ms|s|GiB|GB)\b")


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a module."""
    import io
    import tokenize

    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                start = node.body[0].lineno
                out += [(start + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def timings(source: str) -> list[str]:
    import re

    pattern = re.compile(TIMING)
    return [f"line {n}: {text.strip()}" for n, text in comments_and_docstrings(source)
            if pattern.search(text)]


def test_no_timings_in_the_code():
    found = {name: t for name, path in module_files().items() if (t := timings(path.read_text()))}
    found.update({p.name: t for p in sorted((REPO / "configs").glob("*.py"))
                  if (t := timings(p.read_text()))})
    assert not found, found
    # and the check can see them
    assert len(timings('"""Runs in 3.2 ms on the H200."""\nx = 1  # 41.7% MFU\n')) == 2
    assert not timings('"""Shapes [B, T, H, K]; 2 FLOPs per weight."""\n')


class _StandInClient:
    platform = "gpu"  # what JAX 0.11 reports for CUDA and ROCm alike

    def __init__(self, version):
        self.platform_version = version


class _StandInGpu:
    def __init__(self, kind, cc, version="cuda 12090"):
        self.device_kind, self.compute_capability = kind, cc
        self.client = _StandInClient(version)


@pytest.mark.parametrize("kind,cc,version,mosaic", [
    ("NVIDIA H100 80GB HBM3", "9.0", "cuda 12090", True),
    ("NVIDIA H200", "9.0", "PJRT C API\ncuda 12090", True),
    ("NVIDIA A100-SXM4-80GB", "8.0", "cuda 12090", False),
    ("NVIDIA B200", "10.0", "cuda 12090", False),
    ("AMD Instinct MI300X", "", "rocm 60342", False),
])
def test_the_probe_finds_hopper_cards_by_compute_capability(kind, cc, version, mosaic):
    """The Mosaic GPU kernels apply on an sm_90 card of a CUDA runtime, whatever the client
    calls its platform; the reason names the card otherwise."""
    dev = device.describe("gpu", _StandInGpu(kind, cc, version))
    assert dev.kind == kind and dev.mosaic_gpu is mosaic, dev
    assert dev.lowering == ("rocm" if "rocm" in version else "cuda")
    if not mosaic:
        assert kind.split()[0] in dev.why_not("mosaic_gpu") or "rocm" in dev.why_not("mosaic_gpu")
