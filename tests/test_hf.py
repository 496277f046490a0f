"""Kimi Linear import and export (the package kimi_k3/hf/) held to transformers' numbers without torch.

The fixtures in tests/fixtures/kimi_linear/<case>/ were written by ``benchmarks/hf_parity.py
--write_fixtures``: a random tiny ``KimiLinearForCausalLM`` saved with ``save_pretrained``
(config.json, model.safetensors) and its float32 logits on random tokens (logits.npz; eager
attention, the plain-torch KDA). Import must give those logits; export must write the same
tensors and config; the module layout (transformers' ``state_dict()`` names, built here from the
released one as transformers' conversion mapping does) must import to the same weights.
"""

import json
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3.config import model_spec
from kimi_k3.data import TextTokenizer
from kimi_k3.generate import generate
from kimi_k3.hf import (
    SafetensorsFolder,
    files,
    hf_config_from_model,
    import_to_workdir,
    load_hf_checkpoint,
    model_config_from_hf,
    save_hf_checkpoint,
)
from kimi_k3.hf import main as hf_main
from kimi_k3.layers.moe import ExpertBias

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "kimi_linear"
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
TOL = 1e-4
BASE = FIXTURES / "qlora_shared1_grouped"  # experts, grouped routing, q-LoRA: the error tests' base


def rel_err(ours, theirs) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - theirs)) / np.max(np.abs(theirs)))


def tensors(folder) -> dict[str, np.ndarray]:
    f = SafetensorsFolder(folder)
    return {k: np.array(f[k]) for k in f.names()}


def weights(model) -> dict:
    """Every parameter and routing bias of a HybridLM, by path, as NumPy."""
    _, params, biases, _ = nnx.split(model, nnx.Param, ExpertBias, ...)
    return {jax.tree_util.keystr(k): np.asarray(x) for tree in (params, biases)
            for k, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(tree))}


def to_module_layout(src: pathlib.Path, dst: pathlib.Path) -> None:
    """The released layout -> KimiLinearForCausalLM's module names (its conversion mapping):
    q/k/v convolutions stacked, the forget gate's tensors under forget_gate, experts merged
    into gate_up_proj [E, 2F, D] / down_proj [E, D, F], block_sparse_moe -> mlp."""
    t = tensors(src)
    out, experts = {}, {}
    for name, x in t.items():
        m = re.match(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$", name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = x
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = re.sub(r"self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)", r"self_attn.forget_gate.\1", name)
        if name.endswith("self_attn.q_conv1d.weight"):
            p = name[: -len("q_conv1d.weight")]
            out[p + "conv1d.weight"] = np.concatenate(
                [t[name.replace(".block_sparse_moe.", ".mlp.").replace("q_conv1d", c + "_conv1d")]
                 for c in "qkv"])
            continue
        if re.search(r"self_attn\.[kv]_conv1d\.weight$", name):
            continue
        out[name] = x
    for layer, w in experts.items():
        E = len(w["w1"])
        out[f"{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([w["w1"][e], w["w3"][e]]) for e in range(E)])
        out[f"{layer}.mlp.experts.down_proj"] = np.stack([w["w2"][e] for e in range(E)])
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")


@pytest.mark.parametrize("case", CASES)
def test_import_export_against_transformers(case, tmp_path):
    """Import gives transformers' logits; export writes save_pretrained's tensors and config;
    the export and the module layout import to the same weights."""
    src = FIXTURES / case
    ref = np.load(src / "logits.npz")
    model_config, model = load_hf_checkpoint(src)
    # Jitted: one compilation instead of one per operation (the eager call gives the same).
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ref["tokens"], jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == ref["logits"].shape
    assert rel_err(logits, ref["logits"]) < TOL, case

    save_hf_checkpoint(model, model_config, tmp_path / "export",
                       extra_config={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    want, got = tensors(src), tensors(tmp_path / "export")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    hf_src = json.loads((src / "config.json").read_text())
    hf_out = json.loads((tmp_path / "export" / "config.json").read_text())
    differ = {k: (v, hf_src.get(k)) for k, v in hf_out.items() if hf_src.get(k) != v}
    assert differ == {}, differ
    assert model_config_from_hf(hf_out).to_dict() == model_config.to_dict()

    before = weights(model)
    for folder in (tmp_path / "export", tmp_path / "modules"):
        if folder.name == "modules":
            to_module_layout(src, folder)
        _, again = load_hf_checkpoint(folder)
        after = weights(again)
        assert sorted(after) == sorted(before)
        for k in before:
            np.testing.assert_array_equal(after[k], before[k], err_msg=f"{folder.name}: {k}")


def test_sharded_export_reads_back(tmp_path):
    """Several files with model.safetensors.index.json, written and read back unchanged."""
    src = FIXTURES / CASES[0]
    model_config, model = load_hf_checkpoint(src)
    files = save_hf_checkpoint(model, model_config, tmp_path, max_shard_bytes=8_000)
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors(src))
    _, again = load_hf_checkpoint(tmp_path)
    before, after = weights(model), weights(again)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_import_command_gives_a_run_that_exports_back(tmp_path, capsys):
    """``python -m kimi_k3.hf import``'s step 0 holds the weights and routing biases (as eval
    and generate restore them); ``export`` of that run writes the original tensors again. A
    tokenizers JSON in the folder becomes the run's ``data.tokenizer`` (text prompts)."""
    from tokenizers import Tokenizer, models

    src = tmp_path / "hf"
    shutil.copytree(BASE, src)
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(src / "tokenizer.json"))
    _, model = load_hf_checkpoint(src)
    run = tmp_path / "run"
    step_dir = import_to_workdir(src, run)
    assert (run / "config.py").is_file() and (run / "hf_config.json").is_file()
    from tests.helpers import load_config

    config = load_config(str(run / "config.py"))
    assert config.data.tokenizer == str(run / "tokenizer.json")
    assert TextTokenizer(config.data.tokenizer).vocab_size == 2
    restored, step = ckpt_lib.restore_model_for_eval(config, str(run))
    assert step == 0 and step_dir.endswith("0")
    before, after = weights(model), weights(restored)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    # Export never mixes with a folder's old files (the user's config.json, a stale shard): a
    # folder that is not empty is refused, named with what it holds and a free name to use.
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    (out / "model-00002-of-00002.safetensors").write_bytes(b"old")
    with pytest.raises(SystemExit) as info:  # the command: one line, exit 1
        hf_main(["export", f"--workdir={run}", f"--hf_dir={out}"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert (f"--hf_dir: '{out}' is not empty (it holds config.json, "
            f"model-00002-of-00002.safetensors); export writes a new folder" in err), err
    assert (out / "config.json").read_text() == "mine" and len(list(out.iterdir())) == 2
    advised = re.search(r"e\.g\. --hf_dir=(\S+),", err).group(1)
    assert advised == f"{out}-2"
    # A config of another model: the error advises the run's own, in export's flag.
    other = tmp_path / "other.py"
    other.write_text(f"from kimi_k3.config_files import load_config\n\n\ndef get_config(arg=None):\n"
                     f"    c = load_config({str(run / 'config.py')!r})\n"
                     f"    c.model.mlp_dim = 8\n    return c\n")
    with pytest.raises(SystemExit) as info:
        hf_main(["export", f"--workdir={run}", f"--hf_dir={advised}", f"--config={other}"])
    err = capsys.readouterr().err  # the one line a user sees, advice included
    assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"config.model came from {other}" in err, err
    own = f"--config={run}"
    assert re.search(rf"{re.escape(own)}(?=[\s;.,)]|$)", err), err
    old = os.umask(0o022)
    try:  # the advice works
        hf_main(["export", f"--workdir={run}", f"--hf_dir={advised}", own])
    finally:
        os.umask(old)
    out = pathlib.Path(advised)
    want, got = tensors(src), tensors(out)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (out / "tokenizer.json").is_file()
    # Ordinary permissions (safetensors writes 0600 temporary files), nothing left beside.
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in [out, *out.iterdir()]}
    assert modes == {out.name: "0o755", **{f: "0o644" for f in modes if f != out.name}}, modes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "other.py", "out", "out-2", "run"]
    with pytest.raises(ValueError, match=rf"--workdir: '{run}' already holds checkpoints; import "
                                         rf"into a new folder, e.g. --workdir={run}-2"):
        import_to_workdir(src, run)


def test_greedy_decoding_matches_transformers_generate():
    """kimi_k3.generate (prefill, then cached steps: KDA state and conv tails, MLA latents)
    continues the first row as transformers' generate() did (greedy, 8 tokens)."""
    ref = np.load(BASE / "logits.npz")
    _, model = load_hf_checkpoint(BASE)
    out = generate(model, [ref["tokens"][0].tolist()], len(ref["greedy"]))
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref["greedy"])


def test_bfloat16_import_and_export(tmp_path):
    """dtype="bfloat16": parameters rounded once from the file's float32 (those the model keeps
    in float32 whatever param_dtype says, A_log, dt_bias and the routing biases, stay exact);
    the export writes them in their dtypes and they read back unchanged."""
    _, f32 = load_hf_checkpoint(BASE)
    model_config, bf16 = load_hf_checkpoint(BASE, dtype="bfloat16")
    assert model_config.dtype == model_config.param_dtype == "bfloat16"
    a, b = weights(f32), weights(bf16)
    for k in a:
        assert b[k].dtype in (jnp.bfloat16, np.float32), k
        np.testing.assert_array_equal(b[k], a[k].astype(b[k].dtype), err_msg=k)
    save_hf_checkpoint(bf16, model_config, tmp_path)
    folder = SafetensorsFolder(tmp_path)
    assert folder.entries["lm_head.weight"][1] == "BF16"
    _, again = load_hf_checkpoint(tmp_path, dtype="bfloat16")
    c = weights(again)
    for k in b:
        np.testing.assert_array_equal(c[k], b[k], err_msg=k)


def _broken(tmp_path, edit_tensors=None, edit_config=None) -> pathlib.Path:
    src = BASE
    dst = tmp_path / "broken"
    dst.mkdir()
    t = tensors(src)
    if edit_tensors:
        edit_tensors(t)
    save_file(t, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


NAME = "model.layers.0.self_attn.q_conv1d.weight"
DENSE = "model.layers.0.block_sparse_moe.gate_proj.weight"  # save_pretrained's name of an "mlp."


@pytest.mark.parametrize("edit_tensors, edit_config, match", [
    (lambda t: t.pop(NAME), None, r"1 missing .*q_conv1d"),
    (lambda t: t.update(extra_tensor=np.zeros(3, np.float32)), None, "not in the model.*extra_tensor"),
    (lambda t: t.update({NAME: t[NAME][:, :, :2].copy()}), None, r"q_conv1d.weight \(in model.safetensors\) "
                                                                 r"is \[24, 1, 2\], expected \[24, 1, 4\]"),
    (lambda t: t.update({"model.layers.0.self_attn.conv1d.weight": t[NAME]}), None,
     "mixes the two weight layouts"),
    (None, lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings=True is not supported"),
    (None, lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (None, lambda c: c.update(num_key_value_heads=1), "num_key_value_heads=1 must equal"),
    (None, lambda c: c.update(some_new_switch=3), "some_new_switch=3 is a field kimi_k3.hf does not know"),
    (None, lambda c: c.update(mlp_layer_types=["sparse", "dense", "sparse"]),
     "must be dense layers first"),
    (None, lambda c: c.update(layer_types=["linear_attention", "sliding_attention", "full_attention"]),
     "layer_types=.* each 'linear_attention'"),
    (None, lambda c: c.update(num_experts=5), "n_group: 3 must divide num_experts=5"),
    # Named as the file names it (it was reported as model.layers.0.mlp.gate_proj.weight).
    (lambda t: t.update({DENSE: t[DENSE][:, :-1].copy()}), None,
     r"wrong shapes: model\.layers\.0\.block_sparse_moe\.gate_proj\.weight \(in model\.safetensors\) "
     r"is \[40, 23\], expected \[40, 24\]"),
    (lambda t: t.update({DENSE.replace("block_sparse_moe", "mlp"): t[DENSE]}), None,
     r"holds the same weight twice: 'model\.layers\.0\.block_sparse_moe\.gate_proj\.weight' and "
     r"'model\.layers\.0\.mlp\.gate_proj\.weight'; keep one of them"),
])
def test_bad_checkpoints_name_the_field_or_tensor(tmp_path, edit_tensors, edit_config, match):
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(_broken(tmp_path, edit_tensors, edit_config))


def test_published_dense_names(tmp_path):
    """The published checkpoints name a dense FFN "mlp." beside "block_sparse_moe." experts
    (save_pretrained writes "block_sparse_moe." for both): the same weights."""
    dst = _broken(tmp_path, edit_tensors=lambda t: t.update(
        {k.replace(".block_sparse_moe.", ".mlp."): t.pop(k) for k in list(t)
         if re.search(r"block_sparse_moe\.(gate|up|down)_proj", k)}))
    assert any(".mlp.gate_proj" in k for k in tensors(dst))
    before, after = weights(load_hf_checkpoint(BASE)[1]), weights(load_hf_checkpoint(dst)[1])
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_defaults_are_configs_kimi_linear_48b():
    """KimiLinearConfig's defaults with the published layer lists give configs/kimi_linear_48b.py
    (but for the numerics that config chooses: float32 parameters, remat)."""
    from tests.helpers import load_config

    hf = {"model_type": "kimi_linear", "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [n for n in range(1, 28) if n not in (4, 8, 12, 16, 20, 24, 27)]}}
    ours = model_config_from_hf(hf, dtype="bfloat16")
    want = load_config("kimi_linear_48b.py").model
    ours.param_dtype, ours.remat = want.param_dtype, want.remat
    assert model_spec(ours) == model_spec(want)


@pytest.mark.parametrize("field, value, match", [
    ("attn_res", "block", "attn_res: 'block' must be 'none'"),
    ("tie_embeddings", True, "tie_embeddings: True must be False"),
    ("kda.gate", "bounded", "kda.gate: 'bounded' must be 'softplus'"),
    ("mla.output_gate", True, "mla.output_gate: True must be False"),
    ("moe.capacity_factor", 1.25, "moe.capacity_factor: 1.25 must be 0"),
    ("moe.latent_dim", 8, "moe.latent_dim: 8 must be 0"),
])
def test_export_refuses_what_transformers_cannot_run(field, value, match):
    model_config = model_config_from_hf(json.loads((BASE / "config.json").read_text()))
    section, _, name = field.rpartition(".")
    setattr(model_config[section] if section else model_config, name, value)
    with pytest.raises(ValueError, match=match):
        hf_config_from_model(model_config)
    with pytest.raises(ValueError, match=r"extra_config: \['hidden_size'\]"):
        hf_config_from_model(model_config_from_hf(json.loads((BASE / "config.json").read_text())),
                             {"hidden_size": 8})


def test_released_config_form():
    """The published config.json's form: linear_attn_config's 1-based layer lists,
    first_k_dense_replace, the aliased MoE names and the fields only it has."""
    hf = json.loads((BASE / "config.json").read_text())
    ours = model_config_from_hf(hf)
    released = {k: v for k, v in hf.items() if k not in (
        "layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
        "linear_conv_kernel_dim")}
    types = hf["layer_types"]
    released["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "num_heads": hf["linear_num_heads"], "head_dim": hf["linear_head_dim"],
        "short_conv_kernel_size": hf["linear_conv_kernel_dim"]}
    released["first_k_dense_replace"] = hf["mlp_layer_types"].count("dense")
    released.update(mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1,
                    num_nextn_predict_layers=0, use_grouped_topk=True, rope_theta=10000.0)
    assert model_config_from_hf(released).to_dict() == ours.to_dict()
    for field, value in (("mla_use_nope", False), ("moe_layer_freq", 2)):
        with pytest.raises(ValueError, match=f"{field}={value} is not supported"):
            model_config_from_hf({**released, field: value})


def test_damaged_files_are_named(tmp_path, capsys):
    """A truncated safetensors file (it failed with "TypeError: buffer is too small" when read,
    naming nothing) and a config.json that is not JSON are named, with where they break, before
    anything is read or written; the command says it in one line and exits 1."""
    src = tmp_path / "hf"
    shutil.copytree(BASE, src)
    weights_file = src / "model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(SystemExit) as info:
        hf_main(["import", f"--hf_dir={src}", f"--workdir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"error: file '{weights_file}' is truncated: it has {len(data) // 2} bytes, "
                     rf"but tensor '[\w.]+' \(F32 \[[\d, ]+\]\) ends at byte \d+; copy or download "
                     rf"the file again", err), err
    assert not (tmp_path / "run").exists()
    weights_file.write_bytes(data[:5])
    with pytest.raises(ValueError, match=rf"file '{weights_file}' \(5 bytes\) is truncated or not a "
                                         rf"safetensors file: its header length \(missing\)"):
        load_hf_checkpoint(src)
    weights_file.write_bytes(data[:100])
    with pytest.raises(ValueError, match=r"\(100 bytes\) is truncated or not a safetensors file: "
                                         r"its header length \(\d+\) runs past the end"):
        load_hf_checkpoint(src)

    weights_file.write_bytes(data)
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text.replace('"hidden_size": 24,', '"hidden_size": 24'))
    with pytest.raises(ValueError, match=rf"file '{src}/config.json' is not valid JSON: Expecting "
                                         rf"',' delimiter at line \d+ column \d+"):
        load_hf_checkpoint(src)
    (src / "config.json").write_text(text.replace('"silu"', '"gelu"'))
    with pytest.raises(ValueError, match=rf"file '{src}/config.json': hidden_act='gelu' is not "
                                         rf"supported"):
        import_to_workdir(src, tmp_path / "run")
    with pytest.raises(SystemExit) as info:  # argparse's own errors: its usage line, exit 2
        hf_main(["import", f"--hf_dir={src}"])
    assert info.value.code == 2 and "--workdir" in capsys.readouterr().err


def test_a_failed_export_leaves_no_folder(tmp_path, monkeypatch):
    """The files are staged and become the folder only when complete: an export that fails
    midway (here at its second shard) leaves neither the folder nor anything beside it, and an
    empty folder given to it stays empty."""
    model_config, model = load_hf_checkpoint(BASE)
    write = files._write_safetensors
    calls = []

    def fail_second(tensors_, file):
        calls.append(file)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        write(tensors_, file)

    monkeypatch.setattr(files, "_write_safetensors", fail_second)
    for target in (tmp_path / "new" / "out", tmp_path / "empty"):
        if target.name == "empty":
            target.mkdir()
        calls.clear()
        with pytest.raises(OSError, match="No space left"):
            save_hf_checkpoint(model, model_config, target, max_shard_bytes=8_000)
        assert len(calls) == 2
        assert (list(target.iterdir()) == [] if target.name == "empty" else not target.exists())
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == []
    monkeypatch.setattr(files, "_write_safetensors", write)
    written = save_hf_checkpoint(model, model_config, tmp_path / "empty", max_shard_bytes=8_000)
    assert sorted(written) == sorted(p.name for p in (tmp_path / "empty").iterdir())


@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer", "no-tokenizer"])
def test_the_commands_import_prints_work_as_printed(tmp_path, jax_cache, with_tokenizer):
    """``import`` prints what to run next; each printed command runs as printed (from the
    folder the import ran in) on the run's own config. Without a tokenizer.json the run reads
    no text: generate takes ids, and eval.py says what it needs instead of reading bytes as
    this model's ids (a 61-token vocabulary here)."""
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.helpers import REPO, env

    src = tmp_path / "hf"
    shutil.copytree(BASE, src)
    if with_tokenizer:  # words of Python source, the rest unknown: ids below the vocabulary
        words = ["def", "return", "import", "self", "if", "for", "in", "(", ")", ":", "=", "."]
        vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(src / "tokenizer.json"))
    cmd = [sys.executable, "-m", "kimi_k3.hf", "import", "--hf_dir=hf", "--workdir=run"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(jax_cache), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    printed = [ln.strip() for ln in p.stdout.splitlines() if ln.strip().startswith("python ")]
    assert [c.split()[1] for c in printed] == (["generate.py", "eval.py"] if with_tokenizer
                                               else ["generate.py"]), p.stdout
    for command in printed:
        args = command.split()[1:]
        args = [str(REPO / args[0])] + [a.replace("'", "") for a in args[1:]]
        run = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env(jax_cache),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (command, run.stderr[-3000:])
    if not with_tokenizer:
        assert "give token files" in p.stdout
        refused = subprocess.run(
            [sys.executable, str(REPO / "eval.py"), "--checkpoint=run", "--workdir=ev",
             "--context_lengths=64"], cwd=tmp_path, env=env(jax_cache), capture_output=True,
            text=True, timeout=300)
        assert refused.returncode != 0 and "config.data.tokenizer='none'" in refused.stderr
        assert "first bad id" not in refused.stderr and not (tmp_path / "ev").exists()
