"""Every config, flag and data mistake is one line a user can act on, and the advice works.

The entry points run through ``kimi_k3.cli``: a bad flag, config file or config field prints
one line naming it (the nearest field names for a misspelling) and exits 2, without a
traceback unless ``--debug`` asks for it; a run folder is a config (``--config=RUN``).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest

from kimi_k3 import cli, run_dir
from kimi_k3 import config as config_lib
from kimi_k3 import data as data_lib
from kimi_k3.config_files import load_config as load_by_path
from kimi_k3.runtime import EXIT_USAGE
from tests.helpers import REPO, TINY, env, load_config

TINY_ANYWHERE = [f"--config={REPO / 'configs' / 'tiny.py'}", *TINY[1:]]


def train_py(cwd, cache, *args, devices=1, timeout=300):
    cmd = [sys.executable, str(REPO / "train.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=env(cache, devices), capture_output=True, text=True,
                          timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    """The lines a user reads: everything but absl's prefixed log lines."""
    return [ln for ln in stderr.splitlines()
            if ln.strip() and not (ln[:1] in "IWE" and ln[1:5].isdigit())]


@pytest.mark.parametrize("args, says", [
    (["--config.train.stepz=5"],
     "--config.train.stepz: config.train has no field 'stepz'; did you mean --config.train.steps?"),
    (["--config.opt.lr=inf"], "config.opt.lr: inf is not a finite number; allowed: a finite "
                              "number >= 0"),
    (["--config.modle.d_model=64"], "config has no field 'modle'; did you mean --config.model?"),
    (["--config.data.eos_id=300"], "config.data.eos_id: 300 is outside the vocabulary "
                                   "(config.model.vocab_size=256)"),
])
def test_a_config_mistake_is_one_line_and_exit_2(tmp_path, jax_cache, args, says):
    p = train_py(tmp_path, jax_cache, *TINY_ANYWHERE, "--workdir=w", *args)
    assert p.returncode == EXIT_USAGE, p.stderr[-3000:]
    lines = error_lines(p.stderr)
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and says in lines[0], lines
    assert "Traceback" not in p.stderr and not (tmp_path / "w").exists()


def test_debug_shows_the_traceback(tmp_path, jax_cache):
    p = train_py(tmp_path, jax_cache, *TINY_ANYWHERE, "--workdir=w", "--config.train.stepz=5",
                 "--debug")
    assert p.returncode != 0 and "Traceback" in p.stderr and "stepz" in p.stderr


def test_a_missing_config_file_or_a_folder_without_one_is_named(tmp_path, jax_cache):
    p = train_py(tmp_path, jax_cache, "--config=configs/nope.py", "--workdir=w")
    lines = error_lines(p.stderr)
    assert p.returncode == EXIT_USAGE and len(lines) == 1, p.stderr[-2000:]
    assert "--config: no config file 'configs/nope.py'" in lines[0] and "config_config" not in p.stderr
    (tmp_path / "empty").mkdir()
    p = train_py(tmp_path, jax_cache, "--config=empty", "--workdir=w")
    assert p.returncode == EXIT_USAGE and "--config: 'empty' holds no config.py" in p.stderr


def test_a_batch_that_does_not_split_over_the_devices_names_the_field(tmp_path, jax_cache):
    p = train_py(tmp_path, jax_cache, *TINY_ANYWHERE, "--workdir=w", devices=3)
    lines = error_lines(p.stderr)
    assert p.returncode == EXIT_USAGE and len(lines) == 1, p.stderr[-3000:]
    assert ("config.data.global_batch_size: 4 rows do not split over the mesh's 3 data-parallel "
            "devices" in lines[0]) and "allowed: a multiple of 3" in lines[0]
    assert "IndivisibleError" not in p.stderr


def test_a_run_folder_is_its_own_config(tmp_path):
    """What train.py writes into a run folder loads back as the same run (config.py beside its
    JSON record), by the folder, its config.py or its config.json."""
    config = load_config("ablate_ratio.py:ratio=1,layers=4,base=tiny")
    config.data.seq_len = 96  # an override, as on a command line
    run = tmp_path / "run"
    run.mkdir()
    run_dir.write_config(config, str(run), start=0)
    want = config_lib.run_spec(config, backend="cpu")
    for given in (run, run / "config.py", run / "config.json"):
        assert config_lib.run_spec(load_by_path(given), backend="cpu") == want, given
    assert cli.resolve_config_path(str(run)) == str(run / "config.py")
    assert cli.resolve_config_path(f"{run}/config.json") == str(run / "config.py")
    with pytest.raises(config_lib.ConfigError, match="holds no config.py"):
        cli.resolve_config_path(str(tmp_path))


def test_override_names_are_checked_against_the_loaded_config(tmp_path):
    spec = str(REPO / "configs" / "tiny.py")
    args = [f"--config={spec}", "--config.model.kda.chunk_size=32", "--workdir=w"]
    assert cli.check_config_args(args) == args
    with pytest.raises(config_lib.ConfigError, match=r"--config.model.kda.chunk: config.model.kda"
                                                      r" has no field 'chunk'; did you mean "
                                                      r"--config.model.kda.chunk_size\?"):
        cli.check_config_args([f"--config={spec}", "--config.model.kda.chunk=32"])
    with pytest.raises(config_lib.ConfigError, match="config.seed is a value"):
        cli.check_config_args([f"--config={spec}", "--config.seed.x=1"])


def text_config(paths: str):
    c = load_config("tiny.py")
    c.data.source, c.data.paths, c.data.eval_fraction = "text", paths, 0.0
    return c.data


def test_a_binary_file_given_as_text_is_named(tmp_path):
    (tmp_path / "a.txt").write_text("plain words " * 50)
    blob = np.random.default_rng().integers(0, 256, 4096, np.uint8).tobytes()
    (tmp_path / "b.txt").write_bytes(b"a text start " + b"\0" + blob)
    with pytest.raises(ValueError, match=r"data.paths: '.*b.txt' is not UTF-8 text \(byte 13 of "
                                         r"\d+.*--config.data.source=tokens"):
        data_lib.load_split_streams(text_config(str(tmp_path / "*.txt")), 256)
    (tmp_path / "b.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 10)  # no NUL, not UTF-8
    with pytest.raises(ValueError, match=r"b.txt' is not UTF-8 text \(byte 3 "):
        data_lib.load_split_streams(text_config(str(tmp_path / "*.txt")), 256)
    (tmp_path / "b.txt").write_text("caf\u00e9 " * 10)  # UTF-8: fine
    train, _ = data_lib.load_split_streams(text_config(str(tmp_path / "*.txt")), 256)
    assert train.num_tokens > 600


def test_a_data_file_that_cannot_be_read_is_named(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("plain words " * 50)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(data_lib, "open", refuse, raising=False)
    with pytest.raises(OSError, match=r"data.paths: cannot read '.*a.txt' \(Permission denied\)"):
        data_lib.load_split_streams(text_config(str(tmp_path / "*.txt")), 256)


def test_a_warmup_longer_than_the_run_is_said_once(caplog):
    config = load_config("tiny.py")
    config.train.steps, config.opt.warmup_steps = 7, 1234  # numbers no other test uses
    with caplog.at_level(logging.WARNING):
        config_lib.run_spec(config, backend="cpu")
        config_lib.run_spec(config, backend="cpu")
    said = [r for r in caplog.records if "config.opt.warmup_steps=1234" in r.getMessage()]
    assert len(said) == 1 and "stops at 1% of config.opt.lr" in said[0].getMessage()


def test_eval_prints_no_library_info_lines(tmp_path, jax_cache):
    cmd = [sys.executable, str(REPO / "eval.py"), f"--config={REPO / 'configs' / 'tiny.py'}",
           "--workdir=ev", "--checkpoint=init", "--context_lengths=64", "--max_windows=1",
           "--config.model.num_layers=2", "--config.model.kda_per_mla=1"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(jax_cache), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    info = [ln for ln in p.stderr.splitlines() if ln[:1] == "I" and ln[1:5].isdigit()]
    assert not info, info[:5]


def test_an_evaluation_that_fails_leaves_no_workdir(tmp_path):
    """eval.py's folder is made when the results are written: a checkpoint of another model,
    found only when it is loaded, leaves nothing behind."""
    from kimi_k3 import checkpoint, evaluation, model_state
    from tests.helpers import build, tiny_config

    config, other = tiny_config("KKM", vocab=256), tiny_config("KM", vocab=256)
    _, params, _ = model_state.split_model(build(other.model, 0))
    ck = checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints"), other.checkpoint)
    ck.save(2, {"params": params, "step": np.int32(2)}, {"position": 0})
    ck.close()
    with pytest.raises(ValueError, match="does not match config.model"):
        evaluation.main(config, str(tmp_path / "ev"), [str(tmp_path / "run")], [32],
                        max_windows=1, progress=False)
    assert not (tmp_path / "ev").exists()


def test_only_a_whole_process_gets_the_watchdog():
    """``cli.guarded`` ends a process that a library thread would keep alive
    (``runtime.exit_if_stuck``), but only when told the function is the whole process: a test
    or a notebook calling an entry point's ``main`` goes on."""
    import threading

    def bad(_):
        raise ValueError("a bad input, named")

    watchdogs = lambda: [t for t in threading.enumerate() if t.name == "kimi_k3_exit_if_stuck"]
    before = len(watchdogs())
    with pytest.raises(SystemExit) as info:
        cli.guarded(bad, debug=lambda: False)(None)
    assert info.value.code == 1 and len(watchdogs()) == before
    code = ("import sys, threading\n"
            "from kimi_k3 import cli\n"
            "def bad(_): raise ValueError('named')\n"
            "try:\n"
            "    cli.guarded(bad, debug=lambda: False, process=True)(None)\n"
            "except SystemExit as e:\n"
            "    print(e.code, [t.name for t in threading.enumerate()])\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.startswith("1 ") and "kimi_k3_exit_if_stuck" in p.stdout, p.stdout + p.stderr


def test_a_finished_entry_point_skips_the_interpreters_teardown(tmp_path):
    """``skip_teardown``: once ``main`` returns, the atexit handlers run and the printed lines
    reach the pipe, then the process ends with 0 before the interpreter's teardown (an object
    that would say goodbye while modules are unloaded never does). Without it, or in a
    process that goes on (a test calling the guarded ``main``), nothing changes."""
    marker = tmp_path / "atexit_ran"
    code = ("import atexit, sys\n"
            "from kimi_k3 import cli\n"
            "class Goodbye:\n"
            "    def __del__(self): print('teardown ran', flush=True)\n"
            "keep = Goodbye()\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').close())\n"
            "def main(_): print('done', end='')\n"
            "cli.guarded(main, process=True, skip_teardown=sys.argv[1] == 'skip')(None)\n"
            "print(' after main')\n")
    for mode in ("skip", "keep"):
        marker.unlink(missing_ok=True)
        p = subprocess.run([sys.executable, "-c", code, mode], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0 and marker.exists(), p.stdout + p.stderr
        if mode == "skip":
            assert p.stdout == "done", p.stdout + p.stderr
        else:
            assert p.stdout == "done after main\nteardown ran\n", p.stdout + p.stderr
    assert cli.guarded(lambda _: None, skip_teardown=True)(None) is None  # not a process: returns
