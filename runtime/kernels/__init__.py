"""The C kernels (csrc/), built per instruction-set level, and a Python wrapper for each."""
