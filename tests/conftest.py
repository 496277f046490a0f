import os

# Tests run on the CPU in float32; keep XLA from grabbing every core per process under xdist.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh random generator per test, seeded from the OS, and the seed printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"numpy seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory) -> str:
    """A compilation cache shared by this session's subprocesses (and its xdist workers)."""
    path = tmp_path_factory.getbasetemp().parent / "kimi_k3_jax_cache"
    path.mkdir(exist_ok=True)
    return str(path)
