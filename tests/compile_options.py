"""XLA compile options for the tests' small in-process programs.

They are tiny and compiled far more often than they run long: with XLA's CPU backend
optimisations off (as ``tests.test_train.SUBPROCESS_XLA_FLAGS`` for the subprocess checks) they
compile in a third to a half less time; the float32 results and every tolerance hold. Not for
programs that run many steps (training loops): those run several times slower unoptimised.
"""

from __future__ import annotations

import functools

import jax

from kimi_k3.train_lib import RUN_ONCE_COMPILER_OPTIONS

# The options the library compiles its run-once programs (initialisers) with.
FAST_COMPILE = RUN_ONCE_COMPILER_OPTIONS

# jax.jit with FAST_COMPILE (static arguments etc. as keywords, like jax.jit).
fast_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)
