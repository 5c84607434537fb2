"""OutputTracker: what each running sequence has handed over so far, and the delta of its next step.

The scheduler's Request holds every token a sequence generated. The tracker
keeps, per sequence, how many of them went out in deltas, its detokenizer
(text released, stop strings) and the prompt's logprobs until they are
complete, so each step turns a sequence's new tokens into one OutputDelta
(runtime/engine/outputs.py) in O(new), whatever the output's length. A request with
n > 1 is a group of sequences under the caller's id.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.engine.detokenizer import Detokenizer
from runtime.engine.outputs import OutputDelta
from runtime.model.tokenizer import Tokenizer
from runtime.sample.token_logprob import TokenLogprob
from scheduler import Request


@dataclass
class Tracked:
    request: Request
    detokenizer: Detokenizer
    group_id: str
    """The id the caller gave: that of sequence 0 of the request's n."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Gathered while the prompt is computed (in chunks), handed over once with the first delta. The
    request's n sequences share one list: the prompt is computed once, by sequence 0."""
    prompt_logprobs_sent: bool = False
    num_sent: int = 0
    """Output tokens already handed over in a delta."""

    def take_new(self) -> tuple[list[int], str]:
        """The tokens not yet handed over (those the scheduler took this step) and the text they release;
        afterwards detokenizer.stop_reason says whether a stop string was hit, and num_sent how many
        output tokens stay (those after the one completing a stop string are not handed over)."""
        req = self.request
        out = req.output_token_ids
        start = self.num_sent
        detok = self.detokenizer
        if len(out) - start > 1 and detok.stop:
            # several tokens at once (accepted proposals): a stop string ends the output at the token
            # that completes it, as it would have one token at a time
            text = []
            for end in range(start + 1, len(out) + 1):
                text.append(detok.update(out[:end], req.is_finished and end == len(out)))
                if detok.stop_reason is not None:
                    break
            self.num_sent = end
            return out[start:end], "".join(text)
        new_ids = out[start:]
        self.num_sent += len(new_ids)
        return new_ids, detok.update(out, req.is_finished)

    def delta(
        self,
        new_ids: list[int] = (),
        new_text: str = "",
        times: list[float] = (),
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> OutputDelta:
        req = self.request
        prompt_logprobs = self.prompt_logprobs
        if (
            prompt_logprobs is None
            or self.prompt_logprobs_sent
            or len(prompt_logprobs) < req.num_prompt_tokens
        ):
            prompt_logprobs = None
        else:  # complete: hand it over once
            self.prompt_logprobs_sent = True
        return OutputDelta(
            request_id=self.group_id,
            index=req.index,
            new_token_ids=list(new_ids),
            new_text=new_text,
            new_token_times=list(times),
            new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            num_preemptions=req.num_preemptions,
        )


class OutputTracker:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tracked: dict[str, Tracked] = {}
        """Every unfinished sequence by its own id (sequence j > 0 of request R is 'R#j')."""
        self._groups: dict[str, list[str]] = {}
        """Request id -> the ids of its n sequences."""

    def collides(self, request_id: str, n: int) -> bool:
        """Whether the ids of a new request's sequences 1..n-1 are in use."""
        return any(f"{request_id}#{j}" in self.tracked for j in range(1, n))

    def add(self, request: Request) -> None:
        """Track a queued request and the sequences it will fork."""
        params = request.sampling_params
        rid = request.request_id
        self._groups[rid] = [rid] + [child.request_id for child in request.forks]
        prompt_scores = [None] if params.prompt_logprobs is not None else None
        for seq in [request, *request.forks]:
            self.tracked[seq.request_id] = Tracked(
                seq, Detokenizer(self.tokenizer, params.stop), rid, prompt_scores
            )

    def add_prompt_logprobs(self, scores: dict[str, list[tuple[int, TokenLogprob]]]) -> None:
        """Book a step's prompt logprobs, (position, score) per sequence."""
        for request_id, positions in scores.items():
            kept = self.tracked[request_id].prompt_logprobs
            for pos, score in positions:
                if pos == len(kept):  # a recompute after preemption repeats positions
                    kept.append(score)

    def pop_group(self, request_id: str) -> list[Tracked]:
        """Stop tracking a request: its sequences that had not finished."""
        return [t for seq in self._groups.pop(request_id, []) if (t := self.tracked.pop(seq, None))]

    def finish(self, seq_id: str) -> None:
        """Stop tracking a finished sequence (and its request, once all its sequences finished)."""
        tracked = self.tracked.pop(seq_id, None)
        group = self._groups.get(tracked.group_id) if tracked else None
        if group is not None and not any(seq in self.tracked for seq in group):
            del self._groups[tracked.group_id]
