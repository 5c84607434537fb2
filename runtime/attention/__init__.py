"""Paged attention: the KV cache pool, a step's metadata, and the backends that compute it (PyTorch, the C
kernels, Triton; a windowed PyTorch path for sliding windows and soft-caps)."""
