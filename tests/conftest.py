import os

from tests.xla_flags import SUBPROCESS_XLA_FLAGS

# Tests run on the CPU in float32; keep XLA from grabbing every core per process under xdist.
# Most of a test's time is compiling: the flags that compile fast (tests/xla_flags.py).
os.environ.setdefault("XLA_FLAGS", SUBPROCESS_XLA_FLAGS)
# The Mosaic GPU interpreter runs each warpgroup of a CTA as its own CPU computation, blocked
# at barriers while the other proceeds, inside the kernel's own computation: a kernel of two
# warpgroups holds three of XLA:CPU's executor threads at once. Their pool has as many threads
# as cores (NPROC overrides it), so on a 2-core machine the second warpgroup sometimes found no
# thread while the first waited for it: a hang (always, with NPROC=1).
os.environ.setdefault("NPROC", "8")

import numpy as np
import pytest

# libtpu (the test extra installs it, for tests/test_aot.py) starts with every JAX process's
# search for backends; on a machine without a TPU, pallas_kernels.device gives it settings
# under which it prints nothing and takes no lock. Imported here, before any backend starts,
# they hold for this process and every subprocess it runs.
from pallas_kernels import device  # noqa: F401

# A test's random inputs are fresh every run; the seed is printed with a failure, and
# KIMI_K3_TEST_SEED=<seed> replays it:  KIMI_K3_TEST_SEED=1234 pytest tests/x.py::test_y
SEED_ENV = "KIMI_K3_TEST_SEED"


@pytest.fixture
def rng(request):
    """A fresh random generator per test, seeded from the OS (or from $KIMI_K3_TEST_SEED)."""
    fixed = os.environ.get(SEED_ENV, "").strip()
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Puts the seed at the end of a failed test's report, with the command that replays it."""
    report = yield
    seed = dict(item.user_properties).get("seed")
    if report.failed and seed is not None:
        report.sections.append(
            ("random seed", f"{seed}: replay with {SEED_ENV}={seed} pytest '{item.nodeid}'"))
    return report


def _cache_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.getbasetemp().parent / "kimi_k3_jax_cache"
    path.mkdir(exist_ok=True)
    return str(path)


# The in-process programs that take this long to compile go to the session's cache as well:
# under xdist a module's tests are spread over both workers, and each would compile the same
# model programs (the module fixtures' shapes); the second reads them from disk instead.
IN_PROCESS_CACHE_MIN_COMPILE_SECS = 0.5


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Points this process's JAX at the session cache before anything compiles (JAX reads the
    folder once, at the first compile)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", _cache_dir(factory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      IN_PROCESS_CACHE_MIN_COMPILE_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory) -> str:
    """A compilation cache shared by this session's subprocesses (and its xdist workers)."""
    return _cache_dir(tmp_path_factory)
