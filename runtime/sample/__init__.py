"""Sampling: logits processors, the sampler, logprobs and structured-output masks."""
