"""Quantized weights: GGUF blocks kept packed and the layers that multiply by them."""
