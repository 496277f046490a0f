"""How the package hangs together: no import loop, configs that import only the config room,
the config checked once on its way to the layers, one dispatch contract."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from configs import load_config
from kimi_k3 import config as config_lib
from kimi_k3 import dispatch, mesh, train_lib
from kimi_k3.ops import kda
from tests.test_kda_ops import make_inputs

REPO = Path(__file__).resolve().parents[1]


def imported_modules(path: Path, package: str) -> set[str]:
    """Every ``package.*`` module a file imports, anywhere in it (function bodies too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n == package or n.startswith(package + ".")}
    return out


def package_graph(package: str) -> dict[str, set[str]]:
    root = REPO / package
    modules = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imp in imported_modules(path, package):
            # "from kimi_k3 import data" imports kimi_k3.data; keep only real modules.
            while imp and imp not in modules:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and imp != package:
                deps.add(imp)
        graph[name] = deps
    return graph


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


def test_the_package_has_no_import_loop():
    graph = package_graph("kimi_k3")
    assert "kimi_k3.config" in graph and "kimi_k3.train_lib" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    # and the test can see one
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.py")), ids=lambda p: p.name)
def test_configs_import_the_config_room_not_the_trainer(path):
    trainer = {"kimi_k3.train_lib", "kimi_k3.data", "kimi_k3.optim", "kimi_k3.checkpoint",
               "kimi_k3.mesh", "kimi_k3.evaluation", "kimi_k3.metrics"}
    used = imported_modules(path, "kimi_k3")
    assert not {m for m in used if any(m == t or m.startswith(t + ".") for t in trainer)}, used


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
    monkeypatch.setattr(dispatch.short_conv_kernel, "pl_triton", None)  # a JAX without Triton
    assert dispatch.choose_conv_impl("auto", backend="gpu") == "xla"
    config = load_config("tiny.py")
    config.model.kda.conv_impl = "triton"
    with pytest.raises(ValueError, match=r"config.model.kda.conv_impl.*'triton'"):
        config_lib.run_spec(config)


@pytest.mark.parametrize("field,choose,kernel", [
    ("attn_res_impl", dispatch.choose_attn_res_impl, dispatch.depth_read_kernel),
    ("mlp_impl", dispatch.choose_mlp_impl, dispatch.swiglu_kernel),
])
def test_layer_kernels_auto_on_the_gpu(monkeypatch, field, choose, kernel):
    """model.attn_res_impl and model.mlp_impl: "auto" takes the Pallas-Triton kernels on the GPU
    only, an explicit "pallas" runs anywhere (interpret mode), a bad value is named."""
    assert choose("auto", backend="gpu") == "pallas"
    assert choose("auto", backend="tpu") == "xla"
    assert choose("auto", backend="cpu") == "xla"
    assert choose("pallas", backend="cpu") == "pallas"  # interpret mode
    assert getattr(config_lib.model_spec(load_config("1b.py").model, backend="gpu"),
                   field) == "pallas"
    monkeypatch.setattr(kernel, "pl_triton", None)  # a JAX without Triton
    assert choose("auto", backend="gpu") == "xla"
    config = load_config("tiny.py")
    setattr(config.model, field, "fused")
    with pytest.raises(ValueError, match=rf"config.model.{field}.*'fused'"):
        config_lib.run_spec(config)


def test_kernel_tuning_is_checked_with_the_config():
    """model.kda.kernel_tuning reaches the spec as given, and a bad key or value is named with
    the field before anything is built."""
    config = load_config("tiny.py")
    config.model.kda.kernel_tuning = "hopper=0,bk=16"
    assert config_lib.run_spec(config).model.kda.kernel_tuning == "hopper=0,bk=16"
    for bad, says in (("warps=8", "warps=8"), ("bk=24", "bk must be a power of two"),
                      ("hopper", "'hopper'")):
        config.model.kda.kernel_tuning = bad
        with pytest.raises(ValueError, match=rf"config.model.kda.kernel_tuning: .*{says}"):
            config_lib.run_spec(config)


def test_an_explicit_impl_never_falls_back(rng, monkeypatch):
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
    assert dispatch.choose_attention_impl("auto", dtype="float32", T=256, S=256, packed=False,
                                          continues_cache=False, backend="gpu") == "xla"
    assert dispatch.choices()["attention"] == "xla"
