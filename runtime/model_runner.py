"""Turn a scheduler plan into tensors, run the model, sample: one engine step's tensor work.

The runner reads only the plan's narrow view (scheduler/plan.py) and keeps its
own state per sequence: token ids, block table, sampling params, and a seeded
generator that lives as long as the request (a preempted request keeps it).

Rows of the flattened batch: first one token for each decoding sequence, then
each prefill chunk. Only the rows whose sequence reaches its end this step
(a decode, or the last chunk of a prefill) go through the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime import native_attention
from runtime.attention import AttentionMetadata, PrefillChunk
from runtime.kv_cache import KVCache
from runtime.model import LlamaModel
from runtime.sampler import sample
from scheduler import SamplingParams, SchedulerOutput


@dataclass
class _Sequence:
    """What the runner knows of one resident request."""
    token_ids: list[int]
    """Prompt then generated tokens, including those this runner sampled."""
    num_prompt_tokens: int
    block_table: list[int]
    params: SamplingParams
    num_computed_tokens: int = 0
    """As of the current plan: tokens whose K/V are in the cache before this step."""


@dataclass
class _Work:
    """One scheduled sequence this step."""
    request_id: str
    seq: _Sequence
    num_tokens: int

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_tokens

    @property
    def samples(self) -> bool:
        """It reaches its last token this step, so it gets a new one."""
        return self.end == len(self.seq.token_ids)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self._seqs: dict[str, _Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        # The decode attention backend, chosen once: the C kernel where it runs, else PyTorch.
        probe = torch.empty(1, model.config.num_heads, 1, dtype=model.dtype, device=self.device)
        self.native_decode = native_attention.usable(probe, kv.layer(0)[0])

    @property
    def num_sequences(self) -> int:
        """Requests whose state the runner holds."""
        return len(self._seqs)

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns {request_id: sampled token} for sequences that reached their end."""
        self.update_states(plan)
        work = [_Work(rid, self._seqs[rid], n) for rid, n in plan.num_scheduled_tokens.items()]
        decodes = [w for w in work if w.num_tokens == 1 and w.samples]
        prefills = [w for w in work if not (w.num_tokens == 1 and w.samples)]
        ids, positions, slots = [], [], []
        meta = AttentionMetadata(slot_mapping=None, num_decode=len(decodes), native_decode=self.native_decode)
        self.prepare_decode(decodes, ids, positions, slots, meta)
        sample_rows = list(range(len(decodes)))
        sample_rows += self.prepare_prefill(prefills, ids, positions, slots, meta)
        meta.slot_mapping = torch.tensor(slots, device=self.device)
        hidden = self.run(ids, positions, meta)
        to_sample = decodes + [w for w in prefills if w.samples]
        if not to_sample:
            return {}
        logits = self.model.logits(hidden[sample_rows])
        tokens = sample(logits, *self.prepare_sampling(to_sample))
        for w, token in zip(to_sample, tokens):
            w.seq.token_ids.append(token)
        return {w.request_id: token for w, token in zip(to_sample, tokens)}

    def update_states(self, plan: SchedulerOutput) -> None:
        """Bring the per-sequence state up to this plan: forget what left, add what is new, grow tables."""
        for rid in plan.finished_request_ids:
            self._seqs.pop(rid, None)
            self._generators.pop(rid, None)
        for rid in plan.preempted_request_ids:   # recomputed later from its tokens; its generator stays
            self._seqs.pop(rid, None)
        for new in plan.new_requests:
            self._seqs[new.request_id] = _Sequence(
                new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids), list(new.block_ids),
                new.sampling_params, new.num_computed_tokens)
            seed = new.sampling_params.seed
            if seed is not None and new.request_id not in self._generators:
                self._generators[new.request_id] = torch.Generator(self.device).manual_seed(seed)
        for cached in plan.cached_requests:
            seq = self._seqs[cached.request_id]
            seq.block_table.extend(cached.new_block_ids)
            seq.num_computed_tokens = cached.num_computed_tokens

    def prepare_decode(self, decodes: list[_Work], ids: list[int], positions: list[int], slots: list[int],
                       meta: AttentionMetadata) -> None:
        """One row per decoding sequence (its last token); their padded block tables and lengths."""
        if not decodes:
            return
        bs = self.block_size
        for w in decodes:
            pos = w.seq.num_computed_tokens
            ids.append(w.seq.token_ids[pos])
            positions.append(pos)
            slots.append(w.seq.block_table[pos // bs] * bs + pos % bs)
        lengths = [w.end for w in decodes]
        width = (max(lengths) + bs - 1) // bs
        tables = [w.seq.block_table[:width] + [0] * (width - len(w.seq.block_table[:width])) for w in decodes]
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64, device=self.device)
        meta.decode_context_lens = torch.tensor(lengths, dtype=torch.int64, device=self.device)
        if not self.native_decode:   # PyTorch's decode masks the padding with an additive bias
            span = torch.arange(width * bs, device=self.device).unsqueeze(0)
            visible = span < meta.decode_context_lens.unsqueeze(1)
            meta.decode_bias = torch.zeros(visible.shape, dtype=torch.float32, device=self.device) \
                .masked_fill_(~visible, float("-inf")).view(len(decodes), 1, 1, -1)

    def prepare_prefill(self, prefills: list[_Work], ids: list[int], positions: list[int], slots: list[int],
                        meta: AttentionMetadata) -> list[int]:
        """A chunk of rows per prefilling sequence; returns the rows to sample (chunks that end a prompt)."""
        bs = self.block_size
        sample_rows = []
        for w in prefills:
            start, end, table = w.seq.num_computed_tokens, w.end, w.seq.block_table
            row = len(ids)
            ids.extend(w.seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            meta.prefills.append(PrefillChunk(row, row + w.num_tokens, end,
                                              torch.tensor(table[:(end + bs - 1) // bs], device=self.device)))
            if w.samples:
                sample_rows.append(row + w.num_tokens - 1)
        return sample_rows

    def prepare_sampling(self, rows: list[_Work]) -> tuple[list[SamplingParams], list, list | None]:
        """Per sampled row: its params, its generator (None: the global one), and, when a penalty
        needs them, its (prompt ids, output ids)."""
        params = [w.seq.params for w in rows]
        generators = [self._generators.get(w.request_id) for w in rows]
        histories = None
        if any(p.penalized for p in params):
            histories = [(w.seq.token_ids[:w.seq.num_prompt_tokens],
                          w.seq.token_ids[w.seq.num_prompt_tokens:]) for w in rows]
        return params, generators, histories

    def run(self, ids: list[int], positions: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """The model over the flattened batch: hidden states [rows, hidden]."""
        return self.model.forward(torch.tensor(ids, device=self.device),
                                  torch.tensor(positions, device=self.device), meta, self.kv)
