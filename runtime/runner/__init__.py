"""The model runner: a step's plan turned into tensors, and the CUDA graphs that replay a step."""
