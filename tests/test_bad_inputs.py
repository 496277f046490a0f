"""Bad input and faults, entry point by entry point: each error names the field, flag or path,
and nothing already in the run folder changes.

train (``train_lib.train`` in process, ``train.py`` in a subprocess where flag parsing is what
is tested), eval (``evaluation.main`` / ``eval.py``), the KDA op and the model. Most train cases
fail before any compilation, so the whole file runs in well under a minute of CPU; the one that
trains (relative workdir, two saves, a resume, a finished run) shares the test session's
compilation cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import eval_scoring, evaluation, model_state, passkey, run_dir, train_lib
from kimi_k3 import generate as generate_lib
from kimi_k3.ops import kda
from tests.helpers import REPO, TINY, build, ckpt_steps, env, load_config, losses, make_inputs
from tests.kda_numpy import kda_numpy, rel_err

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A small text corpus (bytes as tokens): 3 files, about 6 KB."""
    d = tmp_path / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kda", "mla", "state", "decay"]
    for i in range(3):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 400)))
    return d


def tiny_config(corpus: Path) -> ml_collections.ConfigDict:
    """configs/tiny.py at test size on the small text corpus; no eval, no bar, no TensorBoard."""
    c = load_config("tiny.py")
    c.model.num_layers, c.model.kda_per_mla = 2, 1
    c.data.source, c.data.paths = "text", str(corpus / "*.txt")
    c.data.eval_fraction, c.data.seq_len, c.data.global_batch_size = 0.0, 32, 4
    c.train.steps, c.train.progress_bar, c.train.tensorboard = 4, False, False
    return c


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A run folder that already holds a config.json and a metrics file, to prove they survive."""
    w = tmp_path / "run"
    w.mkdir()
    (w / "config.json").write_text('{"the": "earlier run"}')
    (w / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 5.0}\n')
    return w


def snapshot(folder: Path) -> dict[str, str]:
    """path -> content hash of everything under ``folder`` (folders too, as '<dir>')."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha1(p.read_bytes()).hexdigest()
    return out


def set_field(config, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for p in parents:
        node = node[p]
    with node.ignore_type():
        node[leaf] = value


def expect_train_error(config, workdir: Path, *names: str, error=ValueError) -> str:
    """Runs train() expecting ``error`` whose message holds every one of ``names``; the run
    folder must be left exactly as it was. Returns the message."""
    before = snapshot(workdir)
    with pytest.raises(error) as info:
        train_lib.train(config, str(workdir))
    message = str(info.value)
    for name in names:
        assert name in message, (name, message)
    assert snapshot(workdir) == before, "the run folder changed"
    return message


# ---------------------------------------------------------------------------------------------
# train: config fields (each error names the field)
# ---------------------------------------------------------------------------------------------

FIELD_CASES = [
    ("model.d_model", 0, "model.d_model"),
    ("model.num_layers", -2, "model.num_layers"),
    ("model.kda.chunk_size", 48, "model.kda.chunk_size"),
    ("model.kda.gate", "exp", "model.kda.gate"),
    ("model.kda.num_v_heads", 6, "model.kda.num_v_heads"),
    ("model.kda.impl", "cuda", "model.kda.impl"),
    ("model.pattern", "KX", "model.pattern"),
    ("model.pattern", "KKM", "model.pattern"),
    ("model.dtype", "float8", "model.dtype"),
    ("model.remat", "some", "model.remat"),
    ("model.attn_res", "partial", "model.attn_res"),
    ("model.mla.attn_impl", "flash3", "model.mla.attn_impl"),
    ("seed", -1, "seed"),
    ("seed", 1.5, "seed"),
    ("data.seq_len", 1, "data.seq_len"),
    ("data.seq_len", 0, "data.seq_len"),
    ("data.global_batch_size", 0, "data.global_batch_size"),
    ("data.source", "csv", "data.source"),
    ("data.token_dtype", "int8", "data.token_dtype"),
    ("data.eval_fraction", 1.5, "data.eval_fraction"),
    ("data.eos_id", -7, "data.eos_id"),
    ("train.steps", 0, "train.steps"),
    ("train.log_every", 0, "train.log_every"),
    ("train.eval_every", -1, "train.eval_every"),
    ("train.nan_policy", "ignore", "train.nan_policy"),
    ("train.microbatch_size", -2, "train.microbatch_size"),
    ("checkpoint.enabled", "yes", "checkpoint.enabled"),
    ("mesh.axis_rules", (("embed", "pipeline"),), "mesh.axis_rules"),
    ("mesh.context", 0, "mesh.context"),
]


@pytest.mark.parametrize("field, value, name", FIELD_CASES, ids=[f"{f}={v}" for f, v, _ in FIELD_CASES])
def test_a_bad_config_field_is_named_and_nothing_is_written(corpus, workdir, field, value, name):
    config = tiny_config(corpus)
    set_field(config, field, value)
    expect_train_error(config, workdir, name, repr(value) if field != "mesh.axis_rules" else "")


@pytest.mark.parametrize("field, value, names", [
    ("opt.name", "sgd", ["opt.name", "sgd"]),
    ("opt.schedule", "linear", ["opt.schedule", "linear"]),
    ("checkpoint.every_steps", 0, ["checkpoint.every_steps"]),
    ("mesh.fsdp", 3, ["mesh", "3"]),
])
def test_fields_checked_when_the_run_is_built_are_named(corpus, workdir, field, value, names):
    config = tiny_config(corpus)
    set_field(config, field, value)
    expect_train_error(config, workdir, *names)


def test_global_batch_that_does_not_split_into_microbatches_names_both(corpus, workdir):
    config = tiny_config(corpus)
    config.train.microbatch_size = 3
    expect_train_error(config, workdir, "data.global_batch_size", "train.microbatch_size")


def test_data_paths_with_the_default_source_names_both_fields(corpus, workdir):
    config = tiny_config(corpus)
    config.data.source = "stdlib"
    expect_train_error(config, workdir, "data.paths", "data.source", str(corpus))


# ---------------------------------------------------------------------------------------------
# train: data files
# ---------------------------------------------------------------------------------------------


def test_a_missing_data_file_is_named(corpus, workdir):
    config = tiny_config(corpus)
    config.data.paths = str(corpus / "nothing_*.txt")
    expect_train_error(config, workdir, "data.paths", "nothing_*.txt", error=FileNotFoundError)


def test_a_directory_as_a_data_path_says_so_and_suggests_a_glob(corpus, workdir):
    config = tiny_config(corpus)
    config.data.paths = str(corpus)
    message = expect_train_error(config, workdir, "data.paths", str(corpus), "directory")
    assert "*" in message  # the suggested glob


def test_an_empty_data_file_is_named(corpus, workdir):
    (corpus / "empty.txt").write_text("")
    expect_train_error(tiny_config(corpus), workdir, "empty.txt", "empty")


def test_a_token_id_above_the_vocabulary_names_file_id_and_position(tmp_path, corpus, workdir):
    np.array([5, 6, 300, 7], np.uint16).tofile(tmp_path / "ids.bin")
    config = tiny_config(corpus)
    config.data.source, config.data.paths = "tokens", str(tmp_path / "ids.bin")
    config.data.seq_len = 2
    expect_train_error(config, workdir, "ids.bin", "token id 300", "token 2", "vocab_size 256")


def test_a_token_file_whose_size_does_not_fit_its_dtype_is_named(tmp_path, corpus, workdir):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    config = tiny_config(corpus)
    config.data.source, config.data.paths = "tokens", str(tmp_path / "odd.bin")
    expect_train_error(config, workdir, "odd.bin", "3 bytes", "uint16")


def test_a_missing_tokenizer_file_is_named(tmp_path, corpus, workdir):
    config = tiny_config(corpus)
    config.data.tokenizer = str(tmp_path / "tok.json")
    expect_train_error(config, workdir, "data.tokenizer", "tok.json", error=FileNotFoundError)


def test_a_missing_eval_path_is_named(corpus, workdir):
    config = tiny_config(corpus)
    config.data.eval_paths = str(corpus / "heldout_*.txt")
    expect_train_error(config, workdir, "data.eval_paths", "heldout_", error=FileNotFoundError)


def test_a_sequence_longer_than_the_data_is_named(corpus, workdir):
    config = tiny_config(corpus)
    config.data.seq_len = 1 << 20
    expect_train_error(config, workdir, "data.seq_len", str(1 << 20))


# ---------------------------------------------------------------------------------------------
# train: the run folder and its checkpoints
# ---------------------------------------------------------------------------------------------


def test_a_workdir_that_is_a_file_is_named(tmp_path, corpus):
    f = tmp_path / "not_a_folder"
    f.write_text("keep me")
    with pytest.raises(ValueError, match=r"--workdir: .*not_a_folder' is a file"):
        train_lib.train(tiny_config(corpus), str(f))
    assert f.read_text() == "keep me"


def test_a_workdir_that_cannot_be_written_is_named(tmp_path, corpus):
    if os.geteuid() == 0:  # permission bits do not stop root; sysfs refuses new files to all
        folder = Path("/sys/kernel")
    else:
        folder = tmp_path / "read_only"
        folder.mkdir()
        folder.chmod(0o555)
    with pytest.raises(ValueError, match=rf"--workdir: '{folder}' is not a folder this process "
                                         rf"can write"):
        train_lib.train(tiny_config(corpus), str(folder))


def test_a_checkpoint_of_another_model_names_the_parameters_and_changes_nothing(corpus, workdir):
    config = tiny_config(corpus)
    other = tiny_config(corpus)
    other.model.d_model = 64
    _, params, _ = model_state.split_model(build(other.model, 0))  # one jitted initialiser
    ck = ckpt_lib.Checkpointer(str(workdir / "checkpoints"), config.checkpoint)
    ck.save(3, {"params": params, "step": jnp.int32(3)}, {"position": 12})
    ck.close()
    expect_train_error(config, workdir, str(workdir / "checkpoints" / "3"), "embed/embedding",
                       "checkpoint (256, 64), config (256, 128)", "new --workdir")


def test_every_checkpoint_unreadable_is_an_error_and_nothing_is_moved(corpus, workdir):
    config = tiny_config(corpus)
    abstract = train_lib.build(config, train_lib.mesh_lib.make_mesh(config.mesh)).abstract_state
    state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    ck = ckpt_lib.Checkpointer(str(workdir / "checkpoints"), config.checkpoint)
    for step in (2, 4):
        ck.save(step, state, {"position": 4 * step})
    ck.close()
    for f in (workdir / "checkpoints").rglob("*"):
        if f.is_file() and "ocdbt" in str(f):
            f.write_bytes(f.read_bytes()[:7])  # truncated
    expect_train_error(config, workdir, str(workdir / "checkpoints"), "no step could be restored",
                       "step 4", "step 2", error=RuntimeError)


def test_a_save_killed_midway_leaves_no_step_and_the_run_resumes_from_the_last_whole_one(
        corpus, tmp_path):
    """Orbax writes a step into a temporary folder and renames it when complete; a process killed
    mid-save leaves only that folder, which the next start ignores (and removes)."""
    config = tiny_config(corpus)
    abstract = train_lib.build(config, train_lib.mesh_lib.make_mesh(config.mesh)).abstract_state
    state = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), abstract)
    directory = tmp_path / "checkpoints"
    ck = ckpt_lib.Checkpointer(str(directory), config.checkpoint)
    ck.save(2, state, {"position": 8})
    ck.close()
    half = directory / "4.orbax-checkpoint-tmp-1764580000"
    (half / "state").mkdir(parents=True)
    (half / "state" / "partial").write_bytes(b"\x00" * 10)
    restored = ckpt_lib.Checkpointer(str(directory), config.checkpoint)
    step, _, data_state = restored.restore(abstract)
    restored.close()
    assert step == 2 and data_state == {"position": 8}
    assert ckpt_steps(tmp_path) == [2]


def test_a_non_finite_step_names_the_quantity_and_the_checkpoint_to_resume_from():
    m = {"finite": False, "loss_finite": True, "grad_finite": True, "update_finite": False,
         "loss": 2.5, "grad_norm": 1.25}
    with pytest.raises(FloatingPointError) as info:
        train_lib.check_finite(17, m, "stop", lambda: "16 (/runs/x/checkpoints/16)")
    text = str(info.value)
    assert "step 17" in text and "the optimizer's update is not finite" in text
    assert "loss and gradient were finite" in text and "/runs/x/checkpoints/16" in text
    m.update(loss_finite=False, loss=float("nan"), update_finite=True)
    with pytest.raises(FloatingPointError, match="the loss is not finite.*no checkpoint has "
                                                 "been saved yet"):
        train_lib.check_finite(3, m, "stop", lambda: None)


# TINY with the config named by its absolute path: these runs start in other folders.
TINY_ANYWHERE = [f"--config={REPO / 'configs' / 'tiny.py'}", *TINY[1:]]


def run_train_py(cwd: Path, cache: str, *args: str, timeout: int = 400):
    cmd = [sys.executable, str(REPO / "train.py"), *TINY_ANYWHERE, *args]
    return subprocess.run(cmd, cwd=cwd, env=env(cache), capture_output=True, text=True,
                          timeout=timeout)


def test_relative_workdir_two_saves_a_resume_and_a_finished_run(tmp_path, jax_cache):
    """The README's command shape: a relative --workdir from the current folder. Two checkpoint
    saves, then a resume that says so, then a start at train.steps that says so and exits 0."""
    ckpt = "--config.checkpoint.every_steps=2"
    first = run_train_py(tmp_path, jax_cache, "--workdir=runs/rel", "--config.train.steps=4", ckpt)
    assert first.returncode == 0, first.stderr[-4000:]
    # The first screen: a short summary of what runs where, before anything else.
    lines = first.stderr.splitlines()
    assert lines[0].startswith("kimi_k3 train  ") and lines[0].endswith(f"->  {tmp_path}/runs/rel")
    for i, word in enumerate(("model", "data", "held out", "mesh", "steps", "checkpoints",
                              "writes"), 1):
        assert lines[i].startswith(f"  {word} "), lines[i]
    assert "!!python" not in first.stderr and "\r" not in first.stderr  # no bar in a log
    run = tmp_path / "runs" / "rel"
    assert ckpt_steps(run) == [2, 4] and sorted(losses(run)) == [1, 2, 3, 4]
    assert not list((run / "checkpoints").glob("*tmp*"))
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 4

    second = run_train_py(tmp_path, jax_cache, "--workdir=runs/rel", "--config.train.steps=6", ckpt)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from step 4" in second.stderr
    assert ckpt_steps(run) == [2, 4, 6] and sorted(losses(run)) == [1, 2, 3, 4, 5, 6]
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 6
    assert len(list((run / "config_history").glob("*.json"))) == 2  # one per start

    before = snapshot(run)
    third = run_train_py(tmp_path, jax_cache, "--workdir=runs/rel", "--config.train.steps=6", ckpt)
    assert third.returncode == 0, third.stderr[-4000:]
    assert "already at step 6 of train.steps=6" in third.stderr
    assert snapshot(run) == before


def test_compilation_cache_folder_is_made_or_named(tmp_path):
    from kimi_k3 import compile_cache
    before = jax.config.jax_compilation_cache_dir
    try:
        assert compile_cache.enable("") is None and jax.config.jax_compilation_cache_dir == before
        folder = compile_cache.enable(str(tmp_path / "a" / "cache"))
        assert folder == str(tmp_path / "a" / "cache") and os.path.isdir(folder)
        assert jax.config.jax_compilation_cache_dir == folder
        (tmp_path / "file").write_text("x")
        with pytest.raises(ValueError, match="--compilation_cache: cannot create .*file/cache"):
            compile_cache.enable(str(tmp_path / "file" / "cache"))
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_the_config_is_printed_flat():
    flat = run_dir.flat_config(load_config("tiny.py"))
    assert "model.d_model = 128" in flat and "data.source = 'stdlib'" in flat
    assert "mesh.axis_rules = (('activation_batch', ('data', 'fsdp', 'expert')), " in "\n".join(flat)
    assert all(" = " in line and "\n" not in line for line in flat)
    assert not any("!!python" in line for line in flat)


def test_a_misspelt_field_and_a_wrong_type_on_the_command_line_are_named(tmp_path, jax_cache):
    p = run_train_py(tmp_path, jax_cache, "--workdir=w", "--config.train.stepz=5")
    assert p.returncode != 0 and "stepz" in p.stderr and "steps" in p.stderr
    p = run_train_py(tmp_path, jax_cache, "--workdir=w", "--config.train.steps=many")
    assert p.returncode != 0 and "--config.train.steps=many" in p.stderr
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------------------------


def run_eval_py(cwd: Path, cache: str, *args: str):
    cmd = [sys.executable, str(REPO / "eval.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=env(cache), capture_output=True, text=True,
                          timeout=300)


def test_eval_without_config_or_with_bad_lengths_names_the_flag(tmp_path, jax_cache):
    p = run_eval_py(tmp_path, jax_cache, "--workdir=ev")
    assert p.returncode != 0 and "--config" in p.stderr
    p = run_eval_py(tmp_path, jax_cache, f"--config={REPO / 'configs' / 'tiny.py'}", "--workdir=ev",
                    "--context_lengths=512,1x")
    assert p.returncode != 0 and "--context_lengths" in p.stderr and "'1x'" in p.stderr
    assert not (tmp_path / "ev").exists()


@pytest.mark.parametrize("items, bad", [(["0"], "'0'"), (["2048", "-5"], "'-5'"),
                                        (["2.5K"], "'2.5K'"), ([""], "''")])
def test_context_lengths_parse_or_name_the_item(items, bad):
    with pytest.raises(ValueError, match=rf"--context_lengths: {bad} is not a positive"):
        eval_scoring.parse_context_lengths(items)
    assert eval_scoring.parse_context_lengths(["512", "8K", "1m"]) == (512, 8192, 1 << 20)


def test_eval_of_a_missing_checkpoint_names_it(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match=r"--checkpoint: '.*nowhere/7' does not exist"):
        evaluation.main(tiny_config(corpus), str(tmp_path / "ev"),
                        [str(tmp_path / "nowhere" / "7")], [64], progress=False)


def test_eval_token_ids_outside_the_vocabulary_name_window_and_position(tmp_path, corpus):
    config = tiny_config(corpus)
    docs = [np.arange(40) % 256, np.concatenate([np.arange(30), [-3], np.arange(9)])]
    opts = eval_scoring.EvalOptions(context_lengths=(16,), max_windows=0)
    spec = evaluation.CheckpointSpec(path="init", label="m")
    with pytest.raises(ValueError, match=r"token id -3 \(window 3 of L=16, position 14\) is "
                                         r"outside \[0, 256\)"):
        evaluation.run(config, [spec], opts, str(tmp_path / "ev"), docs=docs,
                       models={"m": object()}, progress=False)


EVAL_OPTION_CASES = [
    (dict(piece_len=0), "--piece_len", "must be a positive integer"),
    (dict(piece_len=-512), "--piece_len", "must be a positive integer"),
    (dict(batch_size=0), "--batch_size", "must be a positive integer"),
    (dict(max_windows=-1), "--max_windows", ">= 0 (0 = all)"),
    (dict(whole_check_max_len=-4), "--whole_check_max_len", ">= 0 (0 = never)"),
    (dict(short_docs="truncate"), "--short_docs", "'skip', 'concat'"),
    (dict(context_lengths=[]), "--context_lengths", "empty"),
    (dict(context_lengths=[2048, 1024, 2048]), "--context_lengths", "2048 is given more than once"),
]


@pytest.mark.parametrize("kwargs, flag, allowed", EVAL_OPTION_CASES,
                         ids=[f"{k}={v}" for kw, _, _ in EVAL_OPTION_CASES for k, v in kw.items()])
def test_eval_options_out_of_range_name_the_flag_before_anything_is_read(tmp_path, corpus, kwargs,
                                                                         flag, allowed):
    args = dict(context_lengths=[64], piece_len=32, batch_size=1, short_docs="skip",
                max_windows=4, whole_check_max_len=0) | kwargs
    lengths = args.pop("context_lengths")
    # A checkpoint that does not exist: the flag check comes first, so it is never looked for.
    with pytest.raises(ValueError) as info:
        evaluation.main(tiny_config(corpus), str(tmp_path / "ev"), [str(tmp_path / "nowhere")],
                        lengths, progress=False, **args)
    assert flag in str(info.value) and allowed in str(info.value), str(info.value)
    assert not (tmp_path / "ev").exists()


def test_eval_flags_out_of_range_stop_flag_parsing(tmp_path, jax_cache):
    p = run_eval_py(tmp_path, jax_cache, f"--config={REPO / 'configs' / 'tiny.py'}", "--workdir=ev",
                    "--piece_len=0")
    assert p.returncode != 0 and "--piece_len=0: 0 is not a positive integer" in p.stderr
    assert not (tmp_path / "ev").exists()


def test_a_context_length_past_the_cache_positions_names_the_flag():
    with pytest.raises(ValueError, match=r"--context_lengths: '4096M' = 4294967296 tokens exceeds "
                                         r"the 2147483647 positions"):
        eval_scoring.parse_context_lengths(["2048", "4096M"])


def test_eval_checkpoint_labels_and_configs_are_checked_before_any_model(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"--checkpoint: labels must be distinct, got \['a', 'a'\]"):
        evaluation.main(tiny_config(corpus), str(tmp_path / "ev"), ["a=init", "a=init"], [64],
                        progress=False)
    with pytest.raises(ValueError, match=r"--checkpoint b=init@configs/nothing.py: .*nothing.py"):
        evaluation.main(tiny_config(corpus), str(tmp_path / "ev"),
                        ["a=init", "b=init@configs/nothing.py"], [64], progress=False)
    assert not (tmp_path / "ev").exists()


def test_eval_workdir_that_is_a_file_is_named(tmp_path, corpus):
    f = tmp_path / "eval_here"
    f.write_text("keep me")
    with pytest.raises(ValueError, match=r"--workdir: .*eval_here' is a file"):
        evaluation.main(tiny_config(corpus), str(f), ["init"], [64], progress=False)
    assert f.read_text() == "keep me"


# ---------------------------------------------------------------------------------------------
# generate (every flag is checked before a model is built: none of these compiles anything)
# ---------------------------------------------------------------------------------------------

GENERATE_CASES = [
    (dict(), "--prompt / --prompt_ids", "exactly one"),
    (dict(prompts=["a"], prompt_ids=["1"]), "--prompt / --prompt_ids", "exactly one"),
    (dict(prompt_ids=["5,6", "7,300,8"]), "--prompt_ids", "token id 300 (prompt 1, position 1) is "
                                                         "outside [0, 256)"),
    (dict(prompt_ids=["-2"]), "--prompt_ids", "token id -2 (prompt 0, position 0)"),
    (dict(prompt_ids=["5,x"]), "--prompt_ids", "'x' in '5,x' is not an integer"),
    (dict(prompts=[""]), "--prompt", "prompt 0 is empty"),
    (dict(prompts=["a"], stop_ids=["10,256"]), "--stop_ids", "256 is outside [0, 256)"),
    (dict(prompts=["a"], temperature=-1.0), "--temperature", "must be a finite number >= 0"),
    (dict(prompts=["a"], top_p=1.5), "--top_p", "must lie in (0, 1]"),
    (dict(prompts=["a"], top_p=0.0), "--top_p", "must lie in (0, 1]"),
    (dict(prompts=["a"], temperature=0.0, top_p=0.9), "--top_p", "no effect with --temperature=0"),
    (dict(prompts=["a"], max_new_tokens=0), "--max_new_tokens", "must be an integer >= 1"),
    (dict(prompts=["a"], piece_len=0), "--piece_len", "must be an integer >= 1"),
    (dict(prompts=["a"], max_new_tokens=2**31), "--max_new_tokens", "exceeds the cache's"),
    (dict(prompts=["a"]), "--checkpoint", "no --workdir"),
]


@pytest.mark.parametrize("kwargs, flag, allowed", GENERATE_CASES,
                         ids=[f"case{i}" for i in range(len(GENERATE_CASES))])
def test_generate_bad_flags_are_named(corpus, kwargs, flag, allowed):
    with pytest.raises(ValueError) as info:
        generate_lib.main(tiny_config(corpus), progress=False, **kwargs)
    assert flag in str(info.value) and allowed in str(info.value), str(info.value)


def test_generate_checkpoint_paths_are_named(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match=r"--checkpoint: '.*nowhere' does not exist"):
        generate_lib.main(tiny_config(corpus), prompts=["a"], checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"--checkpoint: none given and no checkpoint "
                                                r"under --workdir's"):
        generate_lib.main(tiny_config(corpus), prompts=["a"], workdir=str(tmp_path))


def test_generate_a_text_prompt_outside_the_vocabulary_names_the_flag_and_tokenizer(corpus):
    config = tiny_config(corpus)
    config.model.vocab_size = 100  # bytes reach 255
    with pytest.raises(ValueError, match=r"--prompt \(tokenised by bytes\): token id 116 \(prompt 0, "
                                         r"position 2\) is outside \[0, 100\)"):
        generate_lib.main(config, prompts=["abt"], checkpoint="init")


def test_generate_py_refuses_a_bad_flag_while_parsing(tmp_path, jax_cache):
    cmd = [sys.executable, str(REPO / "generate.py"), f"--config={REPO / 'configs' / 'tiny.py'}",
           "--checkpoint=init", "--prompt=def ", "--max_new_tokens=0"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(jax_cache), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0 and "--max_new_tokens=0: 0 is not a positive integer" in p.stderr


# ---------------------------------------------------------------------------------------------
# passkey (benchmarks/passkey.py): checked before a model is built or --workdir is made
# ---------------------------------------------------------------------------------------------

PASSKEY_CASES = [
    (dict(context_lengths=["97"]), "--context_lengths", "the shortest allowed is 98"),
    (dict(context_lengths=["1x"]), "--context_lengths", "'1x' is not a positive integer"),
    (dict(depths=["0", "1.5"]), "--depths", "'1.5' is not a number in [0, 1]"),
    (dict(depths=["deep"]), "--depths", "'deep' is not a number in [0, 1]"),
    (dict(digits=0), "--digits", "in [1, 64]"),
    (dict(trials=0), "--trials", "must be an integer >= 1"),
    (dict(batch_size=0), "--batch_size", "must be an integer >= 1"),
    (dict(piece_len=-1), "--piece_len", "must be an integer >= 1"),
    (dict(mode="sampled"), "--mode", "not one of ('greedy', 'teacher_forced')"),
    (dict(train_steps=-1), "--train_steps", ">= 0"),
    (dict(train_steps=5, train_lengths=["64"]), "--train_lengths", "the shortest allowed is 98"),
    (dict(train_steps=5, train_lengths=["200", "120"]), "--train_lengths", "200 > 120"),
    (dict(train_steps=5, train_lengths=["100", "120"], train_batch_size=0), "--train_batch_size",
     ">= 1"),
]


@pytest.mark.parametrize("kwargs, flag, allowed", PASSKEY_CASES,
                         ids=[f"case{i}" for i in range(len(PASSKEY_CASES))])
def test_passkey_bad_flags_are_named_and_nothing_is_written(tmp_path, corpus, kwargs, flag, allowed):
    args = dict(checkpoint="init", context_lengths=["256"]) | kwargs
    with pytest.raises(ValueError) as info:
        passkey.main(tiny_config(corpus), str(tmp_path / "pk"), progress=False, **args)
    assert flag in str(info.value) and allowed in str(info.value), str(info.value)
    assert not (tmp_path / "pk").exists()


def test_passkey_with_a_vocabulary_smaller_than_the_bytes_names_both_fields(tmp_path, corpus):
    config = tiny_config(corpus)
    config.model.vocab_size = 64
    with pytest.raises(ValueError, match=r"config.data.tokenizer: bytes gives token id 121, "
                                         r"outside \[0, 64\) = model.vocab_size"):
        passkey.main(config, str(tmp_path / "pk"), checkpoint="init", context_lengths=["256"])


# ---------------------------------------------------------------------------------------------
# The KDA op
# ---------------------------------------------------------------------------------------------


def test_kda_gate_above_zero_is_refused_on_eager_calls(rng):
    q, k, v, g, beta = make_inputs(rng, B=1, T=20)
    g = g.at[0, 7, 1, 3].set(0.25)
    with pytest.raises(ValueError, match=r"kda: g must be <= 0 .* max\(g\) = 0.25"):
        kda(q, k, v, g, beta, impl="xla")


def test_kda_gate_below_the_promised_bound_is_refused(rng):
    q, k, v, g, beta = make_inputs(rng, B=1, T=20)
    g = g.at[0, 3, 0, 0].set(-7.5)
    with pytest.raises(ValueError, match=r"g must be >= lower_bound=-5 .* min\(g\) = -7.5"):
        kda(q, k, v, g, beta, lower_bound=-5.0, impl="xla")
    kda(q, k, v, g, beta, impl="xla")  # no promise, no complaint


def test_kda_check_inputs_works_under_jit(rng):
    q, k, v, g, beta = make_inputs(rng, B=1, T=20)
    bad = g.at[0, 2, 0, 0].set(1.0)
    f = jax.jit(lambda *a: kda(*a, impl="xla", check_inputs=True)[0])
    f(q, k, v, g, beta).block_until_ready()  # good gates pass
    with pytest.raises(Exception, match=r"kda: g must be <= 0"):
        f(q, k, v, bad, beta).block_until_ready()
    # Unchecked, a traced call cannot look at the values: documented, and it runs.
    jax.jit(lambda *a: kda(*a, impl="xla")[0])(q, k, v, bad, beta).block_until_ready()


@pytest.mark.parametrize("impl", ["recurrent", "xla", "pallas"])
def test_kda_zero_length_sequences_give_empty_outputs(rng, impl):
    q, k, v, g, beta = make_inputs(rng, B=2, T=0)
    S0 = jnp.asarray(rng.standard_normal((2, 4, 16, 8)).astype(np.float32))
    o, S = kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, impl=impl)
    assert o.shape == (2, 0, 4, 8) and S.shape == (2, 4, 16, 8)
    np.testing.assert_array_equal(S, S0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_kda_chunk_longer_than_the_sequence_is_cut_to_it(rng, impl):
    """chunk_size=65536 on T = 100 used to ask for a [65536, 65536] block per head."""
    q, k, v, g, beta = make_inputs(rng, B=1, T=100)
    o, S = kda(q, k, v, g, beta, chunk_size=65536, output_final_state=True, impl=impl)
    o_ref, S_ref = kda_numpy(*(np.asarray(x, np.float64) for x in (q, k, v, g, beta)))
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


def _isolation_case(rng, impl, backend=None):
    """Row 0 holds three documents [0, 17), [17, 61), [61, 90); a NaN in document 1's keys and an
    inf in its gate. Returns outputs and gradients with and without the bad values."""
    T = 90
    q, k, v, g, beta = make_inputs(rng, B=2, T=T)
    seg = np.zeros((2, T), np.int32)
    seg[0, 17:61], seg[0, 61:] = 1, 2
    seg = jnp.asarray(seg)
    S0 = jnp.asarray(rng.standard_normal((2, 4, 16, 8)).astype(np.float32))

    def run(q, k, v, g, beta, S0):
        if impl == "pallas":
            from kimi_k3.ops.kda_guards import isolate_documents
            from pallas_kernels.kda import kda_pallas

            fn = lambda *a: kda_pallas(*a[:5], scale=16 ** -0.5, initial_state=a[5],
                                       segment_ids=a[6], chunk_size=16, lower_bound=-5.0,
                                       backend=backend)
            return isolate_documents(fn, q, k, v, g, beta, S0, seg)
        # under a lower bound a -inf gate breaks its promise: a bad value, like the NaN
        # (without one it is an exact "forget everything": tests/test_kda_nonfinite.py)
        return kda(q, k, v, g, beta, initial_state=S0, segment_ids=seg, output_final_state=True,
                   chunk_size=16, lower_bound=-5.0, impl=impl)

    def loss(*args):
        o, S = run(*args)
        return jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) ** 2) + jnp.sum(S[1] ** 2)

    good = (q, k, v, g, beta, S0)
    bad = (q, k.at[0, 30, 1, 3].set(jnp.nan), v, g.at[0, 40, 0, 0].set(-jnp.inf), beta, S0)
    # Jitted (one compile each for both inputs): run eagerly, the op and its gradient dispatch
    # and compile op by op, several times slower.
    run_jit, grad_jit = jax.jit(run), jax.jit(jax.grad(loss, argnums=tuple(range(6))))
    out = {name: (run_jit(*args), grad_jit(*args)) for name, args in (("good", good), ("bad", bad))}
    return out


# The isolation is done around the kernel (kimi_k3/ops/kda_guards.py), the same for every
# backend: the GPU layout's interpreter stands for the kernel (the TPU layout's is far slower).
@pytest.mark.parametrize("impl, backend", [("recurrent", None), ("xla", None),
                                           ("pallas", "interpret")])
def test_a_nan_in_one_document_never_reaches_another(rng, impl, backend):
    out = _isolation_case(rng, impl, backend)
    (o_good, S_good), grads_good = out["good"]
    (o_bad, S_bad), grads_bad = out["bad"]
    o_good, o_bad = np.asarray(o_good), np.asarray(o_bad)
    other = np.ones((2, 90), bool)
    other[0, 17:61] = False  # every token outside the poisoned document
    np.testing.assert_allclose(o_bad[other], o_good[other], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(S_bad, S_good, rtol=1e-5, atol=1e-6)  # the last documents
    # Document 1: value heads 2, 3 (served by key head 1) are NaN from token 30 on, heads 0, 1
    # from token 40 (the inf gate); before that, exact.
    assert np.isnan(o_bad[0, 30:61, 2:]).all() and np.isnan(o_bad[0, 40:61, :1]).all()
    np.testing.assert_allclose(o_bad[0, 17:30], o_good[0, 17:30], rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), grads_bad[:5], grads_good[:5], strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a[other], b[other], rtol=1e-4, atol=1e-5, err_msg=name)
        assert np.isnan(a[0, 17:61]).any(), name  # the poisoned document says so
    np.testing.assert_allclose(grads_bad[5], grads_good[5], rtol=1e-4, atol=1e-5)  # S0


def test_kda_isolation_forward_against_float64_per_document(rng):
    """The documents that hold no bad value are the float64 recurrence's, exactly."""
    q, k, v, g, beta = make_inputs(rng, B=1, T=50)
    seg = np.repeat(np.arange(3), [20, 10, 20])[None].astype(np.int32)
    v_bad = v.at[0, 25, 2, 0].set(jnp.inf)
    o, _ = kda(q, k, v_bad, g, beta, segment_ids=jnp.asarray(seg), chunk_size=16, impl="xla")
    o_ref, _ = kda_numpy(*(np.asarray(x, np.float64) for x in (q, k, v, g, beta)),
                         segment_ids=seg)
    for s, e in ((0, 20), (30, 50)):
        assert rel_err(o[:, s:e], o_ref[:, s:e]) < 1e-5
    assert np.isnan(np.asarray(o)[0, 25:30, 2]).all()


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def test_token_ids_outside_the_vocabulary_never_wrap_inside_the_model():
    from flax import nnx

    from kimi_k3.layers.embed import Embed

    emb = Embed(16, 4, rngs=nnx.Rngs(0))
    x = np.asarray(emb(jnp.array([[3, -1, 16, 15]])))
    table = np.asarray(emb.embedding[...])
    np.testing.assert_array_equal(x[0, 0], table[3])
    np.testing.assert_array_equal(x[0, 3], table[15])
    assert np.isnan(x[0, 1]).all() and np.isnan(x[0, 2]).all()  # not table[15], not clamped
