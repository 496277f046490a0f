"""How a run ends and what it leaves behind when things go wrong: a save that fails, a checkpoint
corrupted on disk, a second trainer on the same run folder, Ctrl-C, a resume's metrics, a run
refused on its checks, the progress bar.

The subprocess cases share one trained run (``trained``: 6 steps, saved at 3 and 6), each on a
copy of it, and the test session's compilation cache; every subprocess has a timeout, so a hang
fails a test rather than block the suite.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import config_files, metrics, run_dir, train_lib
from kimi_k3.runtime import EXIT_FAILED, EXIT_INTERRUPTED
from tests.helpers import REPO, TINY, ckpt_steps, env, load_config, losses

SAVES = ["--config.checkpoint.every_steps=3"]
TIMEOUT = 120  # seconds: far above any of these runs; reached only by a hang


def train_cmd(workdir, *extra) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *TINY, f"--workdir={workdir}", *extra]


def run(cmd, cache, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    """``cmd`` to its end; a run still going after ``timeout`` seconds is a hang (the test
    fails)."""
    return subprocess.run(cmd, cwd=REPO, env=env(cache), capture_output=True, text=True,
                          timeout=timeout)


def messages(stderr: str) -> list[str]:
    """What stderr says about how a run ended: the entry point's lines, tracebacks, and absl's
    warning and error lines (not the run's summary or its report lines)."""
    return [line for line in stderr.splitlines()
            if line.startswith(("train.py:", "Traceback")) or re.match(r"[WEF]\d{4} ", line)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, jax_cache) -> Path:
    """A run of 6 steps, saved at steps 3 and 6."""
    workdir = tmp_path_factory.mktemp("trained") / "run"
    p = run(train_cmd(workdir, "--config.train.steps=6", *SAVES), jax_cache)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ckpt_steps(workdir) == [3, 6] and sorted(losses(workdir)) == list(range(1, 7))
    return workdir


def copy_of(run_folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_folder, tmp_path / "run"))


def corrupt(step_dir: Path) -> Path:
    """Flips 4 KB in the middle of the largest data file of a step, its size unchanged."""
    data = max((step_dir / "state").rglob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)
    b = bytearray(data.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 4096] = bytes(x ^ 0xFF for x in b[mid:mid + 4096])
    data.write_bytes(bytes(b))
    return data


# ---------------------------------------------------------------------------------------------
# A save that fails
# ---------------------------------------------------------------------------------------------

# train.py with every new folder of a step's save refused, as a read-only checkpoints folder
# refuses them (a permission check that binds root too): argv = folder, train.py, its flags.
FAILING_SAVES = """
import os, runpy, sys
folder = sys.argv.pop(1)
real_mkdir = os.mkdir
def mkdir(path, *args, **kwargs):
    if os.path.dirname(os.fspath(path)) == folder and "orbax-checkpoint-tmp" in os.fspath(path):
        raise PermissionError(13, "Permission denied", os.fspath(path))
    return real_mkdir(path, *args, **kwargs)
os.mkdir = mkdir
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_failed_save_ends_the_run_at_once_in_one_line_and_keeps_the_last_step(
        trained, tmp_path, jax_cache):
    """The save of step 8 fails: once that left Orbax's threads waiting forever (the process
    never exited) after pages of tracebacks."""
    workdir = copy_of(trained, tmp_path)
    cmd = [sys.executable, "-c", FAILING_SAVES, str(workdir / "checkpoints"),
           *train_cmd(workdir, "--config.train.steps=8", *SAVES)[1:]]
    p = run(cmd, jax_cache, timeout=90)
    assert p.returncode == EXIT_FAILED, p.stderr[-3000:]
    said = messages(p.stderr)
    assert len(said) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert said[0].startswith(f"train.py: error: checkpoint.dir '{workdir / 'checkpoints'}': "
                              f"saving step 8 failed (PermissionError"), said
    assert "the latest saved step, 6, is kept: a rerun resumes from it" in said[0]
    assert ckpt_steps(workdir) == [3, 6]
    assert ckpt_lib.verify_checksums(workdir / "checkpoints" / "6") is None
    assert not (workdir / run_dir.LOCK_FILE).exists()


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_training(tmp_path,
                                                                                monkeypatch):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):  # a read-only folder, for root too
        if os.path.dirname(os.fspath(path)) == str(folder):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    cfg = load_config("tiny.py").checkpoint
    with pytest.raises(ckpt_lib.CheckpointSaveError,
                       match=rf"checkpoint.dir '{folder}' is not a folder this process can write "
                             rf"\(Permission denied\)"):
        ckpt_lib.Checkpointer(str(folder), cfg)
    assert list(folder.iterdir()) == []


def test_a_process_whose_threads_hang_after_an_error_still_exits():
    """``exit_if_stuck``, the entry points' last resort against a library thread that never
    ends (``kimi_k3.cli`` starts it on every error)."""
    code = ("import threading, sys\n"
            "from kimi_k3 import runtime\n"
            "threading.Thread(target=threading.Event().wait).start()  # never ends, not a daemon\n"
            "runtime.exit_if_stuck(1, seconds=1.0)\n"
            "sys.exit(1)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 1
    assert "still running 1 s after the error above" in p.stderr


# ---------------------------------------------------------------------------------------------
# A corrupted checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fallback(trained, tmp_path_factory, jax_cache) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of ``trained`` whose step 6 had 4 KB flipped, resumed to step 8."""
    workdir = copy_of(trained, tmp_path_factory.mktemp("fallback"))
    corrupt(workdir / "checkpoints" / "6")
    p = run(train_cmd(workdir, "--config.train.steps=8", *SAVES), jax_cache)
    assert p.returncode == 0, p.stderr[-3000:]
    return workdir, p


def test_a_corrupted_step_is_moved_aside_and_the_run_resumes_from_the_previous(trained,
                                                                                fallback):
    workdir, p = fallback
    assert "resumed from step 3 " in p.stderr
    moved = workdir / "checkpoints" / "6.unreadable"
    assert ("not from step 6, which is unreadable (state/ocdbt.process_0/d/" in p.stderr
            and f"does not match its checksum (its bytes changed after the save)): moved to "
                f"{moved}" in p.stderr), p.stderr[-3000:]
    assert moved.is_dir() and ckpt_steps(workdir) == [3, 6, 8]
    before, after = losses(trained), losses(workdir)
    for step in (4, 5, 6):  # the same steps again, from the same checkpoint and data
        assert after[step] == pytest.approx(before[step], rel=1e-6), step


def test_metrics_hold_each_step_once_after_a_resume(fallback):
    workdir, _ = fallback
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, 9))
    superseded = [json.loads(line) for line in open(workdir / metrics.SUPERSEDED)]
    assert [r["step"] for r in superseded] == [4, 5, 6]  # the first run's, past step 3


def test_reading_a_corrupted_step_names_the_file(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    changed = corrupt(workdir / "checkpoints" / "6")
    config = config_files.load_config(str(workdir / "config.py"))
    with pytest.raises(ValueError, match=rf"step 6 .* is corrupted: "
                                         rf"state/ocdbt.process_0/d/{changed.name} does not match"):
        ckpt_lib.load_model(config, str(workdir))


# ---------------------------------------------------------------------------------------------
# One trainer per run folder
# ---------------------------------------------------------------------------------------------

HOLD_LOCK = ("import sys, time\n"
             "from kimi_k3.run_dir import RunLock\n"
             "RunLock(sys.argv[1])\n"
             "print('locked', flush=True)\n"
             "time.sleep(600)\n")


def test_a_second_trainer_is_refused_naming_the_holder_and_a_killed_one_blocks_nothing(
        trained, tmp_path, jax_cache):
    workdir = copy_of(trained, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(workdir)], cwd=REPO,
                              env=env(jax_cache), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
        p = run(train_cmd(workdir, "--config.train.steps=8", *SAVES), jax_cache)
        assert p.returncode == EXIT_FAILED, p.stderr[-3000:]
        assert (f"train.py: error: --workdir: '{workdir}' is in use by another trainer (host "
                f"{socket.gethostname()}, pid {holder.pid}, since ") in p.stderr, p.stderr
        assert "compiling" not in p.stderr  # refused before anything ran
        assert sorted(str(q.relative_to(workdir)) for q in workdir.rglob("*")) == before
    finally:
        holder.kill()  # SIGKILL: its lock file stays, its lock goes with it
        holder.wait(timeout=30)
    assert (workdir / run_dir.LOCK_FILE).exists()
    lock = run_dir.RunLock(str(workdir))
    record = json.loads((workdir / run_dir.LOCK_FILE).read_text())
    assert record["pid"] == os.getpid()
    lock.release()
    assert not (workdir / run_dir.LOCK_FILE).exists()


# ---------------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------------


def test_ctrl_c_saves_the_step_it_reached_and_exits_with_the_interrupted_code(tmp_path,
                                                                              jax_cache):
    workdir = tmp_path / "run"
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(
            train_cmd(workdir, "--config.train.steps=400", "--config.checkpoint.every_steps=1000"),
            cwd=REPO, env=env(jax_cache), stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.time() + TIMEOUT
            while time.time() < deadline and proc.poll() is None and max(losses(workdir),
                                                                         default=0) < 3:
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = (tmp_path / "run.log").read_text()
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    saved = ckpt_steps(workdir)
    assert len(saved) == 1 and 3 <= saved[0] < 400 and saved[0] >= max(losses(workdir))
    assert (f"train.py: stopped at step {saved[0]} of 400 on SIGINT (Ctrl-C); saved step "
            f"{saved[0]} in {workdir / 'checkpoints'}/{saved[0]}; run the same command again to "
            f"resume from it") in err, err[-3000:]
    assert "KeyboardInterrupt" not in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# A run refused on its checks; the progress bar
# ---------------------------------------------------------------------------------------------


def test_a_run_refused_on_its_checks_creates_no_workdir(tmp_path):
    config = load_config("tiny.py")
    config.data.source, config.data.paths = "text", str(tmp_path / "nothing_*.txt")
    workdir = tmp_path / "new" / "run"
    with pytest.raises(FileNotFoundError, match="nothing_"):
        train_lib.train(config, str(workdir))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="cannot be created .*a_file' is a file"):
        train_lib.train(config, str(tmp_path / "a_file" / "run"))


def test_the_progress_bar_shows_the_loss_of_the_step_it_counts(monkeypatch):
    out = io.StringIO()
    out.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", out)
    bar = metrics.ProgressBar(10, enabled=True)
    bar.start(0)
    for step, loss in [(1, 5.0), (2, 4.0), (3, 3.0)]:
        time.sleep(0.12)  # past tqdm's shortest redraw interval
        bar.update(1, loss=loss)
        shown = out.getvalue().rsplit("\r", 1)[-1]
        assert f"{step}/10" in shown and f"loss={loss:.4f}" in shown, shown
    bar.close()
