"""Iteration-level scheduling: who runs this step, and how many tokens each.

Every step first continues the running requests (one token for a decode, the
next chunk for an unfinished prefill), then admits waiting requests in the
policy's order while sequences, the token budget and KV blocks allow. Long
prompts are chunked under the budget, so they never stall the decodes. When a
running request needs a block and none is free, the policy picks a victim to
preempt: its blocks are freed and it is recomputed later.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.fcfs import FCFSPolicy
from scheduler.policy import Policy
from scheduler.priority import PriorityPolicy
from scheduler.request import Request, RequestStatus
from scheduler.vtc import VTCPolicy


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """(request, tokens to compute) in batch order; the tokens are
    request.all_token_ids[num_computed_tokens : num_computed_tokens + n]."""
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def make_policy(config: SchedulerConfig) -> Policy:
    if config.policy == "vtc":
        return VTCPolicy(config.prompt_token_weight, config.output_token_weight)
    if config.policy == "priority":
        return PriorityPolicy()
    return FCFSPolicy()


class Scheduler:
    def __init__(self, config: SchedulerConfig, policy: Policy | None = None):
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.policy = policy or make_policy(config)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0     # of those, tokens found there
        self.num_computed_tokens = 0   # tokens run through the model (prefill chunks and decodes)
        self.num_generated_tokens = 0  # tokens sampled
        self._service: dict[str, int] = {}   # tenant -> tokens served (prompt admitted + generated)

    # ---- requests in and out --------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        capacity = self.config.num_blocks * self.config.block_size
        if request.num_prompt_tokens + request.sampling_params.max_tokens > capacity:
            raise ValueError(f"max_tokens: the request needs up to {request.num_prompt_tokens} + "
                             f"{request.sampling_params.max_tokens} tokens of KV cache, more than the "
                             f"{capacity} the cache holds")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._service.setdefault(request.tenant, 0)
        self.policy.add(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.stop_reason = stop_reason
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.policy.remove(request)
        request.status = status
        request.finished_time = time.monotonic()
        self.block_manager.free(request)
        self.policy.on_finish(request)
        self.requests.pop(request.request_id, None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self.policy.num_waiting()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        scheduled: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not bm.allocate(request, n):
                candidates = [r for r in self.running if id(r) not in scheduled]
                victim = self.policy.victim(candidates)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, n))
                scheduled.add(id(request))
                budget -= n
                i += 1
                continue
            # request itself was preempted: running[i] is now the next request

        if out.preempted:
            return out  # memory is short: admit nobody new this step
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.policy.peek()
            if request is None:
                break
            cached = bm.find_cached_prefix(request)
            hit = len(cached) * bm.block_size
            n = min(request.num_tokens - hit, budget)
            request.num_computed_tokens = hit
            if not bm.allocate(request, n, cached):
                request.num_computed_tokens = 0
                break
            self.prefix_queries += request.num_tokens
            self.prefix_hits += hit
            self.policy.remove(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit
                self._service[request.tenant] += request.num_prompt_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.policy.charge_admission(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n
        return out

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.add(request)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Book the step: computed tokens, new full blocks, sampled tokens, stops. Returns finished requests."""
        self.num_computed_tokens += output.num_batched_tokens
        self.num_generated_tokens += len(sampled)
        for request, n in output.scheduled:
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens += n
                self.block_manager.cache_full_blocks(request)
        finished = []
        now = time.monotonic()
        max_len = self.config.max_model_len
        for request_id, token in sampled.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            self.policy.charge_output(request)
            self._service[request.tenant] += 1
            params = request.sampling_params
            status = None
            if token == request.eos_token_id and not params.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
            elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    # ---- observability --------------------------------------------------------------------------

    def stats(self) -> dict:
        bm = self.block_manager
        live = sum(r.num_computed_tokens for r in self.running)
        allocated = sum(len(r.block_table) for r in self.running) * bm.block_size
        counters = self.policy.counters()
        tenants: dict[str, dict] = {}
        for tenant, served in self._service.items():
            tenants[tenant] = {"counter": counters.get(tenant, 0.0), "service_tokens": served,
                               "waiting": 0, "running": 0}
        for r in self.policy.waiting():
            tenants[r.tenant]["waiting"] += 1
        for r in self.running:
            tenants[r.tenant]["running"] += 1
        return {
            "num_running": len(self.running), "num_waiting": self.num_waiting,
            "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks, "kv_usage": bm.usage,
            "live_token_slots": live, "allocated_token_slots": allocated,
            "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
            "num_preemptions": self.num_preemptions, "computed_tokens": self.num_computed_tokens,
            "generated_tokens": self.num_generated_tokens, "policy": self.policy.name, "tenants": tenants,
        }
