"""A run folder (``--workdir``): checked before anything is written, and the config written into
it. The trainer writes runs; evaluation, generation, passkey and the Hugging Face commands
check and read them.

    <workdir>/config.json                  the config of the latest start
    <workdir>/config_history/<stamp>_step<start>.json   one per start
    <workdir>/checkpoints/<step>/          Orbax steps (kimi_k3.checkpoint)
    <workdir>/metrics.jsonl, tensorboard/  the trainer's metrics (kimi_k3.metrics)
"""

from __future__ import annotations

import os
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


def check_workdir(workdir: str | os.PathLike) -> str:
    """``workdir`` made absolute; created if missing. Raises ValueError naming ``--workdir``
    when it is a file, or a folder this process cannot write (probed by writing, since
    permission bits say nothing to root)."""
    workdir = absolute_path(workdir)
    if "://" in workdir:
        raise ValueError(f"--workdir: {workdir!r} must be a local folder (metrics and the config "
                         f"are written there); put checkpoints elsewhere with checkpoint.dir")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir: {workdir!r} is a file, not a folder")
    try:
        os.makedirs(workdir, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass
    except OSError as e:
        raise ValueError(f"--workdir: {workdir!r} is not a folder this process can write "
                         f"({e.strerror or e})") from e
    return workdir


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


def write_config(config, workdir: str, start: int) -> str:
    """``<workdir>/config.json`` (this start's config) and a dated copy of it in
    ``<workdir>/config_history/`` (one per start, so a resume never loses the config of an
    earlier one). Returns the path of config.json."""
    text = config.to_json_best_effort(indent=2)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    history = os.path.join(workdir, "config_history")
    os.makedirs(history, exist_ok=True)
    with open(os.path.join(history, f"{stamp}_step{start}.json"), "w") as f:
        f.write(text)
    path = os.path.join(workdir, "config.json")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return path
