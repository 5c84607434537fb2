"""Draft-model proposals: a smaller model with the target's vocabulary guesses the next k tokens greedily.

The draft model has its own paged KV pool, a plain free list of blocks and a block table per request.
Each engine step it first computes, for every proposing request, the tokens the request gained since the
draft last saw it (its prompt the first time; then the accepted proposals and the target's own token),
takes the argmax of the last row as the first proposal, then runs k - 1 batched decode steps, each
feeding the previous proposal back. Slots of its own rejected proposals are simply recomputed: the draft
keeps the longest prefix of what it computed that the request's tokens still agree with.

A greedy draft's proposal distribution is a point mass, which is what the rejection sampler
(runtime/sample/rejection_sampler.py) assumes, so outputs keep the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.attention.kv_cache import KVCache, bytes_per_block
from runtime.attention.metadata import ScheduledRows
from runtime.attention.selector import select_backend
from runtime.model.checkpoint import load_checkpoint
from runtime.model.model import LlamaModel
from runtime.model.tokenizer import Tokenizer
from scheduler import Request


@dataclass
class _DraftSeq:
    blocks: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)
    """The tokens whose K/V this draft's pool holds for the request, in order."""


class DraftModel:
    def __init__(
        self, path: str, target: LlamaModel, target_tokenizer: Tokenizer, num_tokens: int, block_size: int
    ):
        """num_tokens: KV slots of the draft's pool (the target pool's capacity is enough)."""
        ckpt = load_checkpoint(path)
        check_vocabulary(path, Tokenizer(ckpt.tokenizer), ckpt.config.vocab_size, target, target_tokenizer)
        self.model = LlamaModel(ckpt.config, ckpt.weights, target.dtype, target.device)
        del ckpt
        self.block_size = block_size
        num_blocks = -(-num_tokens // block_size)
        self.kv = KVCache(self.model.config, num_blocks, block_size, self.model.dtype, self.model.device)
        self.bytes = num_blocks * bytes_per_block(self.model.config, block_size, self.model.dtype)
        probe = torch.empty(
            1,
            self.model.config.num_heads,
            self.model.config.head_dim,
            dtype=self.model.dtype,
            device=target.device,
        )
        self.attention = select_backend(probe, self.kv.layer(0)[0])
        self._free = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[str, _DraftSeq] = {}

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(seq.blocks)

    def _reserve(self, seq: _DraftSeq, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            seq.blocks.append(self._free.pop())
        return True

    @torch.inference_mode()
    def propose(self, requests: list[Request], k: int) -> dict[str, list[int]]:
        """Up to k greedy proposals for each request (fewer where its pool runs out of blocks)."""
        work: list[tuple[Request, _DraftSeq, int]] = []
        for r in requests:
            seq = self._seqs.setdefault(r.request_id, _DraftSeq())
            tokens = r.all_token_ids
            keep = 0
            limit = min(len(seq.computed), len(tokens) - 1)
            while keep < limit and seq.computed[keep] == tokens[keep]:
                keep += 1
            del seq.computed[keep:]
            if not self._reserve(seq, len(tokens) + k - 1):
                self.forget(r.request_id)  # no room: this request proposes nothing this step
                continue
            work.append((r, seq, keep))
        if not work:
            return {}
        # catch up: every request's new tokens as one chunk each; the last row gives the first proposal
        ids, positions, slots, rows, last = [], [], [], [], []
        for r, seq, keep in work:
            tokens = r.all_token_ids
            ids.extend(tokens[keep:])
            positions.extend(range(keep, len(tokens)))
            slots.extend(self._slot(seq, p) for p in range(keep, len(tokens)))
            rows.append(ScheduledRows(seq.blocks, keep, len(tokens)))
            last.append(len(ids) - 1)
            seq.computed.extend(tokens[keep:])
        proposals = self._argmax(ids, positions, slots, [], rows, last)
        out = {r.request_id: [t] for (r, _, _), t in zip(work, proposals)}
        for _ in range(k - 1):
            ids, positions, slots, rows = [], [], [], []
            for (_, seq, _), t in zip(work, proposals):
                p = len(seq.computed)
                ids.append(t)
                positions.append(p)
                slots.append(self._slot(seq, p))
                rows.append(ScheduledRows(seq.blocks, p, p + 1))
                seq.computed.append(t)
            proposals = self._argmax(ids, positions, slots, rows, [], list(range(len(ids))))
            for (r, _, _), t in zip(work, proposals):
                out[r.request_id].append(t)
        return out

    def _slot(self, seq: _DraftSeq, position: int) -> int:
        return seq.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _argmax(self, ids, positions, slots, decodes, prefills, sample_rows) -> list[int]:
        device = self.model.device
        meta = self.attention.build(
            decodes, prefills, torch.tensor(slots, device=device), self.block_size, device
        )
        hidden = self.model.forward(
            torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta, self.kv
        )
        return self.model.logits(hidden[sample_rows]).argmax(dim=-1).tolist()


def check_vocabulary(
    path: str, draft: Tokenizer, draft_vocab: int, target: LlamaModel, target_tokenizer: Tokenizer
) -> None:
    """ValueError naming both models unless the draft's tokens are the target's, id for id."""
    problem = None
    if draft_vocab != target.config.vocab_size:
        problem = f"{draft_vocab} tokens against {target.config.vocab_size}"
    else:
        for i in range(draft_vocab):
            if draft.id_to_token(i) != target_tokenizer.id_to_token(i):
                problem = f"token {i} is {draft.id_to_token(i)!r} against {target_tokenizer.id_to_token(i)!r}"
                break
    if problem:
        raise ValueError(
            f"speculative_config.model: the draft model {path} does not share the vocabulary of "
            f"{target.config.name} ({problem}); a draft model must use the target's tokenizer"
        )
