"""Iteration-level scheduling: who runs this step, and how many tokens each.

Every step first continues the running requests (one token for a decode, the
next chunk for an unfinished prefill), then admits waiting requests in the
policy's order while sequences, the token budget and KV blocks allow, and
until the step's new prompt tokens reach prefill_wave_tokens (a burst of
prompts is admitted in waves). Long prompts are chunked under the budget, so
they never stall the decodes.

Blocks are allocated lazily, only for the tokens scheduled this step, but a
request is admitted only if the blocks for its whole prompt are free beyond
those that running prefills still need: so only decodes growing into new
blocks can run the pool dry. When that happens the policy picks a victim to
preempt: its blocks are freed and it is recomputed later from its prompt and
the tokens it already generated (the prefix cache may serve part of that).
"""

from __future__ import annotations

import math
import sys
import time

from scheduler.admission import InvalidRequestError
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.dlpm import DLPMPolicy
from scheduler.fcfs import FCFSPolicy
from scheduler.lpm import LPMPolicy
from scheduler.plan import SchedulerOutput
from scheduler.policy import Policy
from scheduler.priority import PriorityPolicy
from scheduler.request import Request, RequestStatus
from scheduler.runner_view import RunnerView
from scheduler.stats import SchedulerStats
from scheduler.tenants import Tenants
from scheduler.vtc import VTCPolicy

_RUNNING = RequestStatus.RUNNING
_FLOAT_SLACK = 1e-6
"""Rounding error to ignore before a ceiling: 0.01 * 700 blocks is 7.000000000000001, which is 7."""


def make_policy(config: SchedulerConfig) -> Policy:
    if config.policy == "vtc":
        return VTCPolicy(config.prompt_token_weight, config.output_token_weight)
    if config.policy == "priority":
        return PriorityPolicy()
    if config.policy == "dlpm":
        return DLPMPolicy(config.dlpm_quantum, config.prompt_token_weight, config.output_token_weight)
    if config.policy == "lpm":
        return LPMPolicy()
    return FCFSPolicy()


class Scheduler:
    def __init__(self, config: SchedulerConfig, policy: Policy | None = None):
        if config.num_blocks is None:
            raise ValueError("num_blocks: a Scheduler needs the KV pool's size in blocks")
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.policy = policy or make_policy(config)
        self.policy.attach(self.block_manager)
        self.running: list[Request] = []
        """Admitted requests in admission order; each holds blocks for its computed tokens."""
        self.requests: dict[str, Request] = {}
        """Every unfinished request (waiting, preempted or running) by id."""
        self.num_preemptions = 0
        """Requests preempted because the KV pool ran out of blocks."""
        self.num_displacements = 0
        """Requests preempted so that the policy's choice could start (Policy.displace)."""
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # of those, tokens found there
        self.num_computed_tokens = 0  # tokens run through the model (prefill chunks and decodes)
        self.num_generated_tokens = 0  # tokens sampled
        # speculative decoding: proposals verified, their tokens, those accepted, accepted by position
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []
        self._tenants = Tenants(config.max_idle_tenants)
        self._unready: dict[str, Request] = {}
        """Requests waiting for their grammar (added with ready=False), not yet in the policy's queue."""
        self._runner_view = RunnerView()
        self._watermark_blocks = math.ceil(config.watermark * config.num_blocks - _FLOAT_SLACK)

    # ---- requests in and out --------------------------------------------------------------------

    def add_request(self, request: Request, *, admitted: bool = False, ready: bool = True) -> None:
        """Queue a new request. InvalidRequestError if its id is in use or, unless `admitted` (the
        engine ran the admission rule where the request entered), if it could never fit the KV pool.
        ready=False: it waits (counted, abortable) but is not scheduled until grammar_ready()."""
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        if not admitted:
            self.config.check_request(request.num_prompt_tokens, request.sampling_params.max_tokens)
        if 1 + len(request.forks) > self.config.max_num_seqs:
            raise InvalidRequestError(
                "n",
                f"{1 + len(request.forks)} sequences can never run at once; this "
                f"engine runs at most max_num_seqs={self.config.max_num_seqs}",
            )
        self.requests[request.request_id] = request
        self._tenants.busy(request.tenant).waiting += 1
        if ready:
            request.status = RequestStatus.WAITING
            self.policy.add(request)
        else:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._unready[request.request_id] = request

    def grammar_ready(self, request_id: str) -> None:
        """A request added with ready=False may be scheduled now (no-op if it has gone)."""
        request = self._unready.pop(request_id, None)
        if request is not None:
            request.status = RequestStatus.WAITING
            self.policy.add(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a request now, freeing its blocks; None if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def stop_request(self, request: Request, stop_reason: str) -> None:
        """End a request on a stop string (only the runtime's detokenizer sees text). A request this
        step already finished (its last token was also eos or its length limit) ends as stopped too."""
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_reason
        else:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop_reason)

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """End a request for a reason only the runtime sees (a stop string); no-op if unknown."""
        if not status.finished:
            raise ValueError(f"status: {status} is not a finished status")
        request = self.requests.get(request_id)
        if request is not None:
            request.stop_reason = stop_reason
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        tally = self._tenants[request.tenant]
        if request.status == _RUNNING:
            self.running.remove(request)
            tally.running -= 1
        elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            del self._unready[request.request_id]
            tally.waiting -= 1
        else:
            self.policy.remove(request)
            tally.waiting -= 1
        request.status = status
        request.finished_time = time.monotonic()
        self._runner_view.drop(request, finished=True)
        self.block_manager.free(request)
        self.policy.on_finish(request)
        del self.requests[request.request_id]
        forgotten = self._tenants.settle(request.tenant)
        if forgotten is not None:
            self.policy.forget_tenant(forgotten)

    @property
    def retired_service_tokens(self) -> int:
        """Service of the tenants forgotten after being idle longest (still part of the total)."""
        return self._tenants.retired_service_tokens

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self.policy.num_waiting() + len(self._unready)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Block tables cover num_computed_tokens + n tokens for every scheduled request."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        running = self.running
        planned: dict[Request, int] = {}

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget) if request.spec_token_ids else ()
            if drafts and not bm.allocate(request, n + len(drafts)):
                drafts = ()  # short of blocks: verify nothing rather than preempt anyone for proposals
            request.spec_token_ids = []
            if drafts:
                n += len(drafts)
                out.spec_token_ids[request.request_id] = drafts
            while not bm.allocate(request, n):
                victim = self.policy.victim(running)
                j = running.index(victim)
                self._preempt(victim, j)
                out.preempted.append(victim)
                if victim is request:
                    break
                if j < i:
                    i -= 1
                refund = planned.pop(victim, None)
                if refund is not None:  # it was planned earlier this step: take it out of the batch
                    budget += refund
                    out.scheduled = [(r, k) for r, k in out.scheduled if r is not victim]
                    out.spec_token_ids.pop(victim.request_id, None)
            else:
                out.scheduled.append((request, n))
                planned[request] = n
                budget -= n
                i += 1
            # if request itself was preempted, running[i] is already the next one

        if not out.preempted:
            self._admit(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        out.block_copies, bm.copies = bm.copies, []
        self._runner_view.describe(out, bm)
        return out

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The proposed tokens a decode verifies this step: as many as the budget (which counts every
        verified token), the context and max_tokens leave room for (its k accepted proposals and the
        token after them are k + 1 new tokens)."""
        if request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = budget - 1
        if self.config.max_model_len:
            room = min(room, self.config.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[: max(room, 0)]

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        running = self.running
        max_num_seqs = self.config.max_num_seqs
        seqs = len(running) + sum(len(r.forks) for r in running)  # with forks due when their prompt ends
        if running and seqs >= max_num_seqs:
            victim = self.policy.displace(running)
            if victim is not None:
                budget += self._unplan(out, victim)
                self._preempt(victim, running.index(victim), displaced=True)
                out.preempted.append(victim)
                seqs -= 1 + len(victim.forks)
        # Blocks that running requests still need to finish their prompts (or whose decode
        # was left out of this step): admission must not take them.
        reserved = 0
        for r in running:
            reserved += max(bm.blocks_needed(r.num_tokens) - len(r.block_table), 0)
        # Waves: a burst of prompts gets its first tokens step by step rather than all after one long step.
        wave = self.config.prefill_wave_tokens or sys.maxsize
        admitted = 0
        while budget > 0 and seqs < max_num_seqs and admitted < wave:
            request = self.policy.peek()
            if request is None or seqs + 1 + len(request.forks) > max_num_seqs:
                break
            # prompt logprobs and mean pooling need every prompt position's row, which cached blocks lack
            cached = [] if request.sampling_params.needs_every_prompt_row else bm.find_cached_prefix(request)
            hit = len(cached) * bm.block_size
            need = bm.num_blocks_to_allocate(request, request.num_tokens, cached)
            if need + reserved + (self._watermark_blocks if running else 0) > bm.num_free_blocks:
                break  # the policy's choice waits: admitting anyone else first would break its order
            n = min(request.num_tokens - hit, budget)
            request.num_computed_tokens = hit
            if not bm.allocate(request, n, cached):
                raise AssertionError("blocks counted free were not")
            reserved += bm.blocks_needed(request.num_tokens) - len(request.block_table)
            self.policy.remove(request)
            tally = self._tenants[request.tenant]
            tally.waiting -= 1
            tally.running += 1
            self.prefix_queries += request.num_tokens
            self.prefix_hits += hit
            tally.prefix_queries += request.num_tokens
            tally.prefix_hits += hit
            if request.num_cached_tokens < 0:  # first admission
                request.num_cached_tokens = hit
                tally.service_tokens += request.num_prompt_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.policy.charge_admission(request)
            request.status = _RUNNING
            running.append(request)
            seqs += 1 + len(request.forks)
            out.scheduled.append((request, n))
            budget -= n
            admitted += n

    @staticmethod
    def _unplan(out: SchedulerOutput, request: Request) -> int:
        """Take a request out of this step's plan; returns the tokens it had been given."""
        given = sum(n for r, n in out.scheduled if r is request)
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not request]
        out.spec_token_ids.pop(request.request_id, None)
        return given

    def _fork(self, parent: Request) -> None:
        """Start the parent's sibling sequences on its computed prompt: they share its KV blocks, are
        charged to its tenant for their own tokens (the prompt, computed once, was charged once), and
        from here on run, finish and are preempted as requests of their own."""
        tally = self._tenants[parent.tenant]
        for child in parent.forks:
            self.block_manager.fork(parent, child)
            child.status = _RUNNING
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            self.requests[child.request_id] = child
            self.running.append(child)
            tally.running += 1
            self.policy.charge_fork(parent, child)
        parent.forks = []

    def _preempt(self, request: Request, index: int, displaced: bool = False) -> None:
        del self.running[index]
        request.spec_token_ids = []
        self._runner_view.drop(request, finished=False)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        if displaced:
            self.num_displacements += 1
        else:
            self.num_preemptions += 1
        tally = self._tenants[request.tenant]
        tally.running -= 1
        tally.waiting += 1
        self.policy.add(request)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int | list[int]]
    ) -> list[Request]:
        """Book the step: computed tokens, new full blocks, sampled tokens, stops. Returns finished requests.

        sampled: per request the token it sampled, or the tokens a step with proposals gave it (the
        accepted proposals, then the token sampled after them). A stop among them ends the request
        there; the rest are dropped. The KV slots of rejected proposals count as not computed, and the
        blocks that held only those go back to the free queue.
        A request that reached its end without a sampled token is rolled back one token, so its
        last token is recomputed (and sampled) next step instead of the request stalling.
        """
        bm = self.block_manager
        self.num_computed_tokens += output.num_batched_tokens
        spec = output.spec_token_ids
        for request, n in output.scheduled:
            if request.status is _RUNNING:  # not aborted or finished since schedule()
                before = request.num_computed_tokens
                drafts = spec.get(request.request_id) if spec else None
                if drafts:  # their slots count once accepted, below
                    n -= len(drafts)
                request.num_computed_tokens = before + n
                bm.cache_full_blocks(request, before)
                if request.num_computed_tokens == request.num_tokens and request.request_id not in sampled:
                    request.num_computed_tokens -= 1
                elif request.forks and request.num_computed_tokens == request.num_tokens:
                    self._fork(request)
        finished = []
        now = time.monotonic()
        max_len = self.config.max_model_len or sys.maxsize
        for request_id, tokens in sampled.items():
            request = self.requests.get(request_id)
            if (
                request is None
                or request.status is not _RUNNING
                or request.num_computed_tokens != request.num_tokens
            ):
                continue  # gone, or not at its end: no token is due
            if type(tokens) is int:
                tokens = (tokens,)
            drafts = spec.get(request_id) if spec else None
            if drafts:
                self._count_acceptance(len(drafts), len(tokens) - 1)
            before = request.num_computed_tokens
            for i, token in enumerate(tokens):
                if i:  # the token before this one was an accepted proposal: its K/V were computed
                    request.num_computed_tokens += 1
                if self._append(request, token, now, max_len):
                    finished.append(request)
                    break
            else:
                if len(tokens) > 1:
                    bm.cache_full_blocks(request, before)
                if drafts:
                    bm.trim(request, request.num_tokens)
                    self._runner_view.trim(request)
        return finished

    def _append(self, request: Request, token: int, now: float, max_len: int) -> bool:
        """Book one generated token; True if it ended the request (which is then finished)."""
        request.append_output_token(token)
        self.num_generated_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        self.policy.charge_output(request)
        self._tenants[request.tenant].service_tokens += 1
        params = request.sampling_params
        status = None
        if not params.ignore_eos and (token == request.eos_token_id or token in request.eog_token_ids):
            status = RequestStatus.FINISHED_STOPPED
        elif params.stop_token_ids and token in params.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
        elif request.num_tokens >= max_len or (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            return False
        self._finish(request, status)
        return True

    def _count_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def truncate_output(self, request: Request, num_output_tokens: int) -> None:
        """Drop the output tokens after its first num_output_tokens (a stop string ended it inside a step
        that gave it several tokens), uncounting them; the caller then finishes it."""
        extra = request.num_output_tokens - num_output_tokens
        if extra <= 0:
            return
        del request.output_token_ids[num_output_tokens:]
        self.num_generated_tokens -= extra
        tally = self._tenants.get(request.tenant)
        if tally is not None:  # else forgotten since: nothing left to refund
            tally.service_tokens -= extra
            self.policy.charge_output(request, -extra)

    # ---- observability --------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        """Gauges and cumulative counters for metrics; O(running + tenants with requests + at most
        max_idle_tenants idle ones), cheap enough every step.

        live_token_slots / allocated_token_slots is the fraction of held KV slots that hold a
        computed token of a running request (a shared prefix block counts once).
        """
        bm = self.block_manager
        bs = bm.block_size
        live = sum(r.num_computed_tokens for r in self.running) - bm.num_shared_refs * bs
        partial = {
            r.block_table[-1]: r.num_computed_tokens % bs
            for r in self.running
            if r.num_computed_tokens % bs and bm.ref_counts[r.block_table[-1]] > 1
        }
        live += sum(
            (bm.ref_counts[b] - 1) * (bs - filled) for b, filled in partial.items()
        )  # forked, not full
        tenants = self._tenants.stats(self.policy.counters())
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_usage=bm.usage,
            num_cached_blocks=bm.num_cached_blocks,
            live_token_slots=live,
            allocated_token_slots=bm.num_used_blocks * bs,
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_displacements=self.num_displacements,
            computed_tokens=self.num_computed_tokens,
            generated_tokens=self.num_generated_tokens,
            policy=self.policy.name,
            tenants=tenants,
            retired_service_tokens=self.retired_service_tokens,
            retired_prefix_hits=self._tenants.retired_prefix_hits,
            retired_prefix_queries=self._tenants.retired_prefix_queries,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
        )
