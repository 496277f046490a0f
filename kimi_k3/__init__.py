"""kimi_k3: a Kimi K3-style hybrid language model (KDA + Gated MLA + Attention Residuals) in JAX."""

__version__ = "0.1.0"
