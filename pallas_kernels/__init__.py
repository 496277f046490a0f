"""Pallas kernels for the kimi_k3 ops (one source for GPU-Triton, TPU-Mosaic and interpret mode)."""
