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
