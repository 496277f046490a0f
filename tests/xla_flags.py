"""XLA flags of the test processes and the subprocesses they start. No imports: conftest.py
sets them before anything imports JAX.

The tests compile far more than they run: XLA's LLVM optimisations (backend level 0) and its
MLIR fusion emitters (the older elemental ones compile far faster) cost more time than they
save. LLVM's "expensive passes" stay on: turning them off as well made the suite slower, not
faster. A subprocess whose time goes to running many steps (a training loop) takes
STEPS_XLA_FLAGS: the LLVM optimisations on. One XLA:CPU thread pool per process, not one per
core, under xdist.
"""

STEPS_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false --xla_cpu_use_fusion_emitters=false"
SUBPROCESS_XLA_FLAGS = f"{STEPS_XLA_FLAGS} --xla_backend_optimization_level=0"
