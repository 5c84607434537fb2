"""RunnerView: what the model runner has been told, so each plan describes only what changed.

The scheduler keeps, per request the runner holds, how many block ids it has
sent; each plan then carries a new request whole and a known one as the blocks
added since (plan.py says what the runner does with them). A preempted request
is dropped here and sent whole again when it resumes; a finished one is named
once, in the next plan's finished_request_ids.
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.plan import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import Request


class RunnerView:
    def __init__(self):
        self._blocks_sent: dict[str, int] = {}
        """Block ids the model runner has been told of, per request it holds."""
        self._finished: list[str] = []
        self._trimmed: dict[str, int] = {}
        """Block-table entries the runner keeps, per request whose table was cut since the last plan."""

    def trim(self, request: Request) -> None:
        """The request's block table was cut short (blocks of rejected proposals freed): the next plan
        tells the runner how many entries it keeps."""
        rid = request.request_id
        sent = self._blocks_sent.get(rid)
        if sent is not None and len(request.block_table) < sent:
            kept = min(len(request.block_table), self._trimmed.get(rid, sent))
            self._trimmed[rid] = kept

    def drop(self, request: Request, finished: bool) -> None:
        """The runner is to forget this request (finished: for good, so the next plan names it)."""
        self._trimmed.pop(request.request_id, None)
        if self._blocks_sent.pop(request.request_id, None) is not None and finished:
            self._finished.append(request.request_id)

    def describe(self, out: SchedulerOutput, bm: BlockManager) -> None:
        """Fill the runner's narrow view of the plan `out`: what changed since the last one."""
        sent = self._blocks_sent
        for request, n in out.scheduled:
            rid = request.request_id
            table = request.block_table
            known = sent.get(rid)
            if known is None:
                out.new_requests.append(new_request_data(request))
            else:
                kept = self._trimmed.pop(rid, None)
                if kept is not None:
                    known = min(known, kept)
                replaced = [(i, table[i]) for i in bm.rewritten.get(rid, ()) if i < known]
                out.cached_requests.append(
                    CachedRequestData(rid, table[known:], request.num_computed_tokens, replaced, kept)
                )
            sent[rid] = len(table)
            out.num_scheduled_tokens[rid] = n
        out.preempted_request_ids = [r.request_id for r in out.preempted]
        bm.rewritten.clear()
        out.finished_request_ids, self._finished = self._finished, []


def new_request_data(request: Request) -> NewRequestData:
    """The whole of a request as the runner is told of it: every token so far and every block."""
    return NewRequestData(
        request.request_id,
        list(request.prompt_token_ids),
        list(request.output_token_ids),
        request.sampling_params,
        list(request.block_table),
        request.num_computed_tokens,
        request.eos_token_id,
        [(c.request_id, c.sampling_params) for c in request.forks],
        request.eog_token_ids,
    )


def plans_alone(plan: SchedulerOutput) -> list[SchedulerOutput]:
    """The plan's scheduled requests one per plan, each told whole to the runner (which rebuilds its state
    from it), the first carrying the plan's block copies: to run again, apart, a step that failed."""
    alone = []
    for request, n in plan.scheduled:
        rid = request.request_id
        drafts = plan.spec_token_ids.get(rid)
        alone.append(
            SchedulerOutput(
                scheduled=[(request, n)],
                new_requests=[new_request_data(request)],
                num_scheduled_tokens={rid: n},
                block_copies=[] if alone else plan.block_copies,
                spec_token_ids={rid: drafts} if drafts else {},
            )
        )
    return alone
