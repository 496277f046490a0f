"""kimi_k3: a Kimi K3-style hybrid language model (KDA + Gated MLA + Attention Residuals) in JAX."""

__version__ = "0.1.0"

# The share of a GPU's memory a training process lets JAX's allocator take (JAX's own default is
# 75%; the memory planner judges a step against what JAX may use). train.py and the benchmarks
# that run its step set XLA_PYTHON_CLIENT_MEM_FRACTION to it before JAX starts, unless it is set.
TRAINER_MEM_FRACTION = "0.95"
