"""JAX's persistent compilation cache for the command-line entry points.

A large model's training step takes minutes to compile, a long-context evaluation part of its
time, the Mosaic GPU kernels seconds each: a second run of the same shapes reads the compiled
programs from disk instead. ``train.py``, ``eval.py`` and ``generate.py`` take
``--compilation_cache=DIR`` (default :data:`DEFAULT_DIR`; "" turns it off). A cache folder set
in the environment (``JAX_COMPILATION_CACHE_DIR``) wins over the default.
"""

from __future__ import annotations

import os

import jax
from absl import flags

DEFAULT_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                           "kimi_k3", "jax_compilation_cache")


def define_flag() -> flags.FlagHolder:
    return flags.DEFINE_string(
        "compilation_cache", os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_DIR,
        "Folder of JAX's persistent compilation cache ('' = off): a rerun with the same shapes "
        "skips compiling.")


def enable(path: str) -> str | None:
    """Points JAX's persistent cache at ``path`` (created if missing); JAX keeps the programs
    that took at least a second to compile (``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``).
    Returns the folder, or None when ``path`` is ""."""
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--compilation_cache: cannot create {path!r} ({err.strerror}); give "
                         "another folder, or '' to compile without a cache") from err
    jax.config.update("jax_compilation_cache_dir", path)
    return path
