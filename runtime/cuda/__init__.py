"""The CUDA path: Triton kernels and CUDA graphs."""
