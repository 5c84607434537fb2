"""The compute kernels: C (csrc/, built once per instruction-set level, a Python wrapper named after each
C file) and Triton for CUDA."""
