"""Turn a scheduler plan into tensors, run the model, sample: one engine step's tensor work.

Rows of the flattened batch: first one token for each decoding sequence, then
each prefill chunk. Only the rows whose sequence reaches its end this step
(a decode, or the last chunk of a prefill) go through the LM head.
"""
from __future__ import annotations

import torch

from runtime import native_attention
from runtime.attention import AttentionMetadata, PrefillChunk
from runtime.kv_cache import KVCache
from runtime.model import LlamaModel
from runtime.sampler import sample
from scheduler import Request, SchedulerOutput


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

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns {request_id: sampled token} for sequences that reached their end."""
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
        if not sample_reqs:
            return {}
        logits = self.model.logits(hidden[sample_rows])
        params = [r.sampling_params for r in sample_reqs]
        histories = [(r.prompt_token_ids, r.output_token_ids) for r in sample_reqs] \
            if any(p.penalized for p in params) else None
        tokens = sample(logits, params, [self.generators.get(r.request_id) for r in sample_reqs], histories)
        return {r.request_id: t for r, t in zip(sample_reqs, tokens)}
