"""JAX's persistent compilation cache for the command-line entry points.

A large model's training step takes minutes to compile, a long-context evaluation part of its
time, the Mosaic GPU kernels seconds each: a second run of the same shapes reads the compiled
programs from disk instead. ``train.py``, ``eval.py`` and ``generate.py`` take
``--compilation_cache=DIR`` (default :data:`DEFAULT_DIR`; "" turns it off). A cache folder set
in the environment (``JAX_COMPILATION_CACHE_DIR``) wins over the default.

``counting()`` counts what the cache did for a stretch of a process, from JAX's monitoring
events: a hit is a program read from the cache instead of compiled; a miss, a program compiled
and written to it (JAX records a miss only when it writes: a program compiled in less than
``jax_persistent_cache_min_compile_time_secs`` is neither).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

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


HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a program read from the cache
MISS_EVENT = "/jax/compilation_cache/cache_misses"  # a program compiled and written to it


@dataclasses.dataclass
class Count:
    """Persistent-cache events while ``counting()``: programs read from the cache (``hits``)
    and programs compiled and written to it (``misses``)."""

    hits: int = 0
    misses: int = 0

    def __str__(self) -> str:
        return f"{self.hits} read, {self.misses} compiled and written"

    def source(self) -> str:
        """Where a program counted alone came from, in words."""
        return ("read from the persistent cache" if self.hits else
                "compiled and written to the persistent cache" if self.misses else
                "compiled, not cached")


@contextlib.contextmanager
def counting() -> Iterator[Count]:
    """Counts the persistent cache's hits and misses (module docstring) in this process while
    open; counts may nest."""
    count = Count()

    def listener(event: str, **_) -> None:
        if event == HIT_EVENT:
            count.hits += 1
        elif event == MISS_EVENT:
            count.misses += 1

    jax.monitoring.register_event_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_listener(listener)
