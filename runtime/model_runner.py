"""Turn a scheduler plan into tensors, run the model, sample: one engine step's tensor work.

Rows of the flattened batch: first one token for each decoding sequence, then
each prefill chunk. Only the rows whose sequence reaches its end this step
(a decode, or the last chunk of a prefill) go through the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime import native_attention
from runtime.attention import AttentionMetadata, PrefillChunk
from runtime.kv_cache import KVCache
from runtime.logits_processors import apply_logits_processors
from runtime.logprobs import TokenLogprob, token_logprobs
from runtime.model import LlamaModel
from runtime.sampler import sample
from scheduler import Request, SchedulerOutput


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    """request id -> the token sampled for it, for sequences that reached their end this step."""
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    """request id -> the sampled token's logprob, for requests that asked (SamplingParams.logprobs)."""
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    """request id -> (prompt position, its token's logprob) for the prompt tokens this step computed."""


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self.generators: dict[str, torch.Generator] = {}
        self.native_decode = native_attention.usable(torch.empty(1, model.config.num_heads, 1, dtype=model.dtype,
                                                                 device=self.device), kv.layer(0)[0])

    def add_request(self, request: Request) -> None:
        seed = request.sampling_params.seed
        if seed is not None:
            self.generators[request.request_id] = torch.Generator(self.device).manual_seed(seed)

    def remove_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the sampled tokens of sequences that reached their end, and logprobs asked for."""
        if plan.block_copies:
            self.kv.copy_blocks(plan.block_copies)
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        for req, n in plan.scheduled:
            (decodes if n == 1 and req.num_computed_tokens + 1 == req.num_tokens else prefills).append((req, n))
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for req, _ in decodes:
            pos = req.num_computed_tokens
            ids.append(req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1])
            positions.append(pos)
            slots.append(req.block_table[pos // bs] * bs + pos % bs)
            sample_rows.append(len(ids) - 1)
            sample_reqs.append(req)
        chunks: list[PrefillChunk] = []
        scored: list[tuple[Request, int, int, int]] = []   # (request, first row, first position, rows)
        for req, n in prefills:
            start = req.num_computed_tokens
            row = len(ids)
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = req.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            context = start + n
            chunks.append(PrefillChunk(row, row + n, context,
                                       torch.tensor(table[:(context + bs - 1) // bs], device=self.device)))
            if context == req.num_tokens:
                sample_rows.append(row + n - 1)
                sample_reqs.append(req)
            last_prompt_row = min(n, req.num_prompt_tokens - 1 - start)   # rows whose next token is prompt
            if req.sampling_params.prompt_logprobs is not None and last_prompt_row > 0:
                scored.append((req, row, start, last_prompt_row))

        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=self.device),
                                 num_decode=len(decodes), prefills=chunks)
        if decodes:
            lengths = [req.num_computed_tokens + 1 for req, _ in decodes]
            width = (max(lengths) + bs - 1) // bs
            tables = [req.block_table[:width] + [0] * (width - len(req.block_table[:width])) for req, _ in decodes]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64, device=self.device)
            meta.decode_context_lens = torch.tensor(lengths, dtype=torch.int64, device=self.device)
            if not self.native_decode:
                span = torch.arange(width * bs, device=self.device).unsqueeze(0)
                visible = span < meta.decode_context_lens.unsqueeze(1)
                meta.decode_bias = torch.zeros(visible.shape, dtype=torch.float32, device=self.device) \
                    .masked_fill_(~visible, float("-inf")).view(len(decodes), 1, 1, -1)

        hidden = self.model.forward(torch.tensor(ids, device=self.device),
                                    torch.tensor(positions, device=self.device), meta, self.kv)
        out = ModelRunnerOutput()
        if scored:
            out.prompt_logprobs = self._prompt_logprobs(hidden, scored)
        if not sample_reqs:
            return out
        # sequences forked from a request whose prompt ends now draw their first token from its row
        logits = self.model.logits(hidden[sample_rows])
        source = [k for k, req in enumerate(sample_reqs) for _ in req.forks]
        if source:
            sample_reqs = sample_reqs + [child for req in sample_reqs for child in req.forks]
            logits = torch.cat([logits, logits[source]])
        params = [r.sampling_params for r in sample_reqs]
        raw = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "raw"]
        raw_logits = logits[raw].clone() if raw else None
        apply_logits_processors(logits, sample_reqs)
        histories = [(r.prompt_token_ids, r.output_token_ids) for r in sample_reqs] \
            if any(p.penalized for p in params) else None
        tokens = sample(logits, params, [self.generators.get(r.request_id) for r in sample_reqs], histories)
        out.sampled = {r.request_id: t for r, t in zip(sample_reqs, tokens)}
        if raw:
            scores = token_logprobs(raw_logits, [tokens[i] for i in raw], [params[i].logprobs for i in raw])
            out.logprobs.update((sample_reqs[i].request_id, s) for i, s in zip(raw, scores))
        processed = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "processed"]
        if processed:
            # sample() applied the penalties to `logits` in place; temperature divides what it drew from
            scale = torch.tensor([params[i].temperature or 1.0 for i in processed], device=logits.device)
            scores = token_logprobs(logits[processed] / scale.unsqueeze(1), [tokens[i] for i in processed],
                                    [params[i].logprobs for i in processed])
            out.logprobs.update((sample_reqs[i].request_id, s) for i, s in zip(processed, scores))
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, scored: list[tuple[Request, int, int, int]]) -> dict:
        """Logprobs of prompt tokens from the rows before them (raw logits: nothing edits a prompt)."""
        out = {}
        for req, row, start, n in scored:
            logits = self.model.logits(hidden[row:row + n])
            targets = req.prompt_token_ids[start + 1:start + 1 + n]
            scores = token_logprobs(logits, targets, [req.sampling_params.prompt_logprobs] * n)
            out[req.request_id] = [(start + 1 + i, s) for i, s in enumerate(scores)]
        return out
