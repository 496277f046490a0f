"""A run folder (``--workdir``): checked before anything is written, and the config written into
it. The trainer writes runs; evaluation, generation, passkey and the Hugging Face commands
check and read them.

    <workdir>/config.json                  the config of the latest start
    <workdir>/config.py                    that config as a config file: --config=<workdir>
    <workdir>/config_history/<stamp>_step<start>.json   one per start
    <workdir>/checkpoints/<step>/          Orbax steps (kimi_k3.checkpoint)
    <workdir>/metrics.jsonl, tensorboard/  the trainer's metrics (kimi_k3.metrics)
    <workdir>/train.lock                   while a trainer runs here: who (``RunLock``)
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import sys
import tempfile
import time

import ml_collections


def absolute_path(path: str | os.PathLike) -> str:
    """``path`` made absolute against the current directory; URLs (``gs://...``) unchanged.
    Orbax refuses relative checkpoint paths, and a path that is absolute once stays right if
    the process changes its directory later."""
    path = os.fspath(path)
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def find_run_folder(path: str | os.PathLike) -> str | None:
    """The run folder that ``path`` names or lies in, when it holds the run's config
    (``config.py``, written by ``write_config``): the folder itself, its ``checkpoints/`` or a
    step ``checkpoints/<step>``. None for anything else (``init``, another folder)."""
    p = os.path.normpath(os.fspath(path))
    for candidate in (p, os.path.dirname(p), os.path.dirname(os.path.dirname(p))):
        if candidate and os.path.isfile(os.path.join(candidate, "config.py")):
            return candidate
    return None


def check_workdir(workdir: str | os.PathLike, create: bool = True) -> str:
    """``workdir`` made absolute; created if missing (``create=False``: only checked, so that
    a run refused later leaves nothing behind; ``make_workdir`` creates it). Raises ValueError
    naming ``--workdir`` when it is a file, or a folder this process cannot write (probed by
    writing, since permission bits say nothing to root)."""
    workdir = absolute_path(workdir)
    if "://" in workdir:
        raise ValueError(f"--workdir: {workdir!r} must be a local folder (metrics and the config "
                         f"are written there); put checkpoints elsewhere with checkpoint.dir")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir: {workdir!r} is a file, not a folder")
    # Without create: the nearest folder that exists must take the new ones.
    probe = workdir
    while not create and not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if os.path.exists(probe) or parent == probe:
            raise ValueError(f"--workdir: {workdir!r} cannot be created ({probe!r} is a file, "
                             f"not a folder)")
        probe = parent
    try:
        if create:
            os.makedirs(workdir, exist_ok=True)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ValueError(f"--workdir: {workdir!r} is not a folder this process can write "
                         f"({e.strerror or e})") from e
    return workdir


def make_workdir(workdir: str) -> None:
    """Creates ``workdir`` (checked by ``check_workdir(workdir, create=False)``) and its parents."""
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--workdir: {workdir!r} is not a folder this process can write "
                         f"({e.strerror or e})") from e


# ---------------------------------------------------------------------------------------------
# One trainer per run folder
# ---------------------------------------------------------------------------------------------

LOCK_FILE = "train.lock"


class RunFolderBusy(ValueError):
    """Another process holds a run folder's lock (``RunLock``)."""


class RunLock:
    """``<workdir>/train.lock``, held by the one process that writes a run folder.

    An exclusive ``flock`` on the file, so the operating system releases it when its holder
    ends however it ends (SIGKILL included): a lock left by a dead process never blocks a
    restart. The file says who holds it (host, pid, since when, the command) for the error a
    second process gets, and is removed on ``release``. Where the file system has no ``flock``
    (some network mounts) the run goes on unlocked, with a warning.
    """

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd = None
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunFolderBusy(
                    f"--workdir: {workdir!r} is in use by another trainer ({holder}; lock "
                    f"{self.path}); wait for it to end or stop it, or train in another "
                    f"--workdir") from None
            except OSError as e:  # no flock on this file system
                logging.warning("%s: cannot lock (%s): nothing stops a second trainer from "
                                "writing this run folder", self.path, e.strerror or e)
            # The holder before us may have removed the file between our open and our lock:
            # then we hold a lock on a file nobody else will find. Try again.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
            else:
                os.close(fd)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": now,
                  "command": " ".join(sys.argv)}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)

    def release(self) -> None:
        """Removes the file and lets the lock go (the file first: a process that opened it
        meanwhile finds it gone once it has the lock, and tries again)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def _read_holder(fd: int) -> str:
    """'host H, pid P, since T' from a lock file's record (what it can tell)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        record = {}
    if not record:
        return "holder unknown"
    return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, since "
            f"{record.get('since', '?')}")


def flat_config(config, prefix: str = "") -> list[str]:
    """``["model.d_model = 128", ...]``: one line per field, sorted, values as Python literals."""
    lines = []
    for key in sorted(config.keys()):
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict):
            lines += flat_config(value, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key} = {value!r}")
    return lines


# <workdir>/config.py: the run's config as a config file, read from the config.json beside it,
# so `--config=<workdir>` (or <workdir>/config.py) gives eval.py, generate.py and a resume the
# run's own config, every override included.
RUN_CONFIG_FILE = '''"""The config of the run in this folder, as its latest start used it (config.json beside
this file, every override applied). Written by train.py; load it with --config=<this folder>."""

import json
import pathlib

import ml_collections


def get_config(arg=None):
    if arg:
        raise ValueError(f"{__file__} takes no argument, got {arg!r}")
    text = pathlib.Path(__file__).with_name("config.json").read_text()
    return ml_collections.ConfigDict(json.loads(text))
'''


def _write(path: str, text: str) -> None:
    """``text`` into ``path`` whole or not at all (a temporary file renamed over it)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def previous_config(workdir: str) -> ml_collections.ConfigDict | None:
    """The config the previous start of the run in ``workdir`` wrote (config.json), or None
    when there is none or it cannot be read."""
    path = os.path.join(workdir, "config.json")
    try:
        with open(path) as f:
            return ml_collections.ConfigDict(json.load(f))
    except (OSError, ValueError):
        return None


def config_changes(old, new) -> list[str]:
    """``["opt.lr: 0.003 -> 0.001", ...]``: the fields whose value differs between two configs
    (a field only one of them has shows as ``(none)`` on the other side)."""
    def flat(config, prefix=""):  # as JSON records it: a tuple and a list are the same
        tree = json.loads(config.to_json_best_effort()) if not isinstance(config, dict) else config
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = json.dumps(value)
        return out

    before, after = flat(old), flat(new)
    return [f"{key}: {before.get(key, '(none)')} -> {after.get(key, '(none)')}"
            for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]


def write_config(config, workdir: str, start: int) -> str:
    """``<workdir>/config.json`` (this start's config), ``<workdir>/config.py`` (a config file
    that loads it: ``--config=<workdir>``) and a dated copy of the JSON in
    ``<workdir>/config_history/`` (one per start, so a resume never loses the config of an
    earlier one). Returns the path of config.json."""
    text = config.to_json_best_effort(indent=2)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    history = os.path.join(workdir, "config_history")
    os.makedirs(history, exist_ok=True)
    with open(os.path.join(history, f"{stamp}_step{start}.json"), "w") as f:
        f.write(text)
    path = os.path.join(workdir, "config.json")
    _write(path, text)
    _write(os.path.join(workdir, "config.py"), RUN_CONFIG_FILE)
    return path
