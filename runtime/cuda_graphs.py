"""Decode steps on CUDA replayed from CUDA graphs, one captured per batch size.

A decode step of a small model is hundreds of short kernels (every layer's
projections, norms, rotary embedding, KV write and attention), each a few
microseconds of GPU work behind a few microseconds of Python and launch on the
CPU: launched one by one, the GPU mostly waits. Captured once into a graph, the
whole step is one launch. A graph replays fixed shapes at fixed addresses, so
each captured size has its inputs in static buffers (token ids, positions, KV
slots, block tables as wide as the longest context, context lengths); a step of
b sequences copies its inputs into the first b rows and replays the smallest
captured size >= b. The rows past b are padding: they write their K/V into the
pool's scratch slot (kv_cache.py), attend to one position, and their outputs
are dropped. Attention must be the Triton kernel, whose launch does not depend
on the lengths (triton_attention.py). Steps with a prefill chunk, or more
sequences than the largest size, run eagerly.
"""

from __future__ import annotations

import torch

from runtime.attention import AttentionMetadata
from runtime.kv_cache import KVCache


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to max_batch (which is always one)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, kv: KVCache, max_batch: int, max_model_len: int):
        """model: a LlamaModel on CUDA whose decode attention is the Triton kernel; kv: its pool, with a
        scratch slot. Captures every size of capture_sizes(max_batch)."""
        if kv.scratch_slot is None:
            raise ValueError("DecodeGraphs: the KV pool needs a scratch slot (KVCache(..., scratch=True))")
        self.model = model
        self.kv = kv
        self.sizes = capture_sizes(max_batch)
        largest = self.sizes[-1]
        width = -(-max_model_len // kv.block_size)
        device = model.device
        self.ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slots = torch.full((largest,), kv.scratch_slot, dtype=torch.int64, device=device)
        self.tables = torch.zeros(largest, width, dtype=torch.int64, device=device)
        self.lens = torch.ones(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the memory the largest one's capture reserved
        for size in reversed(self.sizes):
            meta = self._meta(size)
            side = torch.cuda.Stream()  # warm up (Triton's compile, cuBLAS's handles) off the capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model.forward(self.ids[:size], self.positions[:size], meta, kv)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = model.forward(self.ids[:size], self.positions[:size], meta, kv)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode=size,
            decode_block_tables=self.tables[:size],
            decode_context_lens=self.lens[:size],
            decode_backend="triton",
        )

    def size_for(self, batch: int) -> int | None:
        """The captured size a step of `batch` decodes replays (None: none is that large)."""
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decode step of ids.shape[0] sequences (meta as the runner built it): hidden states [b,
        hidden], valid until the next replay."""
        b = ids.shape[0]
        size = self.size_for(b)
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.lens[:b].copy_(meta.decode_context_lens)
        tables = meta.decode_block_tables
        self.tables[:b, : tables.shape[1]].copy_(tables)
        if size > b:  # rows left by a larger step: back to the scratch slot and one position
            self.slots[b:size].fill_(self.kv.scratch_slot)
            self.lens[b:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:b]
