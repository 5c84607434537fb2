"""The model runner: a step's plan into tensors, the KV cache pool."""
