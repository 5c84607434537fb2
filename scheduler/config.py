"""Scheduler limits and policy choice, in tokens, blocks and sequences."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("vtc", "fcfs", "priority")


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Most tokens computed in one step (prefill chunks + one per decode)."""
    max_model_len: int = 8192
    policy: str = "vtc"
    enable_prefix_caching: bool = True
    prompt_token_weight: float = 1.0
    """VTC's w_p: service charged per prompt token."""
    output_token_weight: float = 2.0
    """VTC's w_q: service charged per generated token."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("prompt_token_weight", "output_token_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)!r}")
