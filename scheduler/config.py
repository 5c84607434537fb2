"""Scheduler limits and policy choice, in tokens, blocks and sequences.

These are also the engine's scheduling defaults: `runtime.EngineConfig` nests
this dataclass, and the CLI builds its flags from it, so each default is
written here and nowhere else.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from scheduler.admission import AdmissionRule

POLICIES = ("vtc", "fcfs", "priority", "dlpm", "lpm")


@dataclass
class SchedulerConfig:
    num_blocks: int | None = None
    """KV blocks in the pool. The engine sizes it from the cache's bytes when left None;
    a Scheduler needs it set."""
    block_size: int = 8
    """Tokens per KV cache block."""
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 512
    """Most tokens computed in one step (prefill chunks + one per decode)."""
    prefill_wave_tokens: int | None = None
    """Prompt tokens that newly admitted requests bring into one step: once a step's admissions reach
    this many, the rest wait for the next step, so a burst of short prompts is admitted in waves and the
    first waves get their first tokens after shorter steps. It lowers TTFT p50 only where a step's cost
    grows with its tokens far more than its fixed part (a dense matmul path); with the packed 4-bit kernel
    at every row count it raised it (bench_serve measures both). The first admission of a step may still
    take the whole budget, so one long prompt prefills in chunks of max_num_batched_tokens. None: no
    waves, admit while the budget lasts."""
    max_model_len: int | None = None
    """Longest token stream (prompt + output) a request may reach; it stops there. None: no limit
    of its own (the engine caps it at the model's context length)."""
    policy: str = field(default="vtc", metadata={"choices": POLICIES})
    """Admission order and preemption choice: one of POLICIES."""
    enable_prefix_caching: bool = True
    """Share the KV blocks of equal prompt prefixes between requests."""
    prompt_token_weight: float = 1.0
    """VTC's w_p: service charged per prompt token."""
    output_token_weight: float = 2.0
    """VTC's w_q: service charged per generated token."""
    dlpm_quantum: int | None = None
    """DLPM's quantum Q: weighted tokens each backlogged tenant may be served per round (default: one
    request's charge: the most any of the last requests can be charged). Larger keeps a tenant's cached prefix in use
    for more requests in a row; two backlogged tenants' weighted service then differs by at most
    2 (Q + U_p + U_q), U_p and U_q one prompt's and the running requests' outputs' charges
    (scheduler/dlpm.py)."""
    max_idle_tenants: int = 1024
    """Tenants without requests that are still remembered (counters, service); beyond this the longest
    idle are forgotten, so memory and stats() cost do not grow with every `user` name ever seen."""
    watermark: float = 0.01
    """Fraction of blocks that admitting a new request leaves free while others run, so running
    decodes that cross into a new block do not at once preempt the request just admitted."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in (
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "prefill_wave_tokens",
            "max_idle_tenants",
            "dlpm_quantum",
        ):
            value = getattr(self, name)
            if value is None and name in (
                "num_blocks",
                "max_model_len",
                "prefill_wave_tokens",
                "dlpm_quantum",
            ):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("prompt_token_weight", "output_token_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark: must be in [0, 1), got {self.watermark!r}")

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV pool holds: the longest request that can ever run."""
        if self.num_blocks is None:
            raise ValueError("num_blocks: not set; the KV pool's size is unknown")
        return self.num_blocks * self.block_size

    @property
    def admission(self) -> AdmissionRule:
        """The admission rule over this pool; without max_model_len, only the pool limits a request."""
        return AdmissionRule(self.max_model_len or sys.maxsize, self.kv_capacity_tokens)

    def check_request(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise InvalidRequestError unless the request can finish in this pool when running alone.
        A standalone scheduler stops a request at max_model_len (finish reason 'length') rather than
        refusing it, so max_tokens counts only up to there."""
        if self.max_model_len is not None and num_prompt_tokens < self.max_model_len:
            max_tokens = min(max_tokens or sys.maxsize, self.max_model_len - num_prompt_tokens)
        self.admission.admit(num_prompt_tokens, max_tokens)
