"""Engine steps on CUDA replayed from CUDA graphs, one captured per token count.

A step of a small model is hundreds of short kernels (every layer's projections,
norms, rotary embedding, KV write and attention), each a few microseconds of GPU
work behind tens of microseconds of Python and launch on the CPU: launched one
by one, the GPU mostly waits. Captured once into a graph, the whole step is one
launch. With the Triton attention kernel every row of a step, a decode or a
prefill chunk's, is the same computation (a query over its sequence's block
table up to its causal length), so a step's shape is only its token count: the
graphs are captured for 1, 2, 4, 8, 16, .. 56 tokens (decode batches), then
every 64 up to max_num_batched_tokens (or 512: engine.MAX_GRAPH_TOKENS), and any step of at most that many tokens
replays the smallest one that holds it. A graph replays fixed shapes at fixed
addresses, so its inputs live in static buffers: token ids, positions, KV slots,
causal lengths and each row's table index side by side in one int64 buffer, the
block tables (as wide as the longest context) in another; a step fills both from
pinned host memory, two copies. Rows past the step's are padding: they write
their K/V into the pool's scratch slot (kv_cache.py), attend to one position,
and their outputs are dropped.
"""

from __future__ import annotations

import torch

from runtime.attention.kv_cache import KVCache
from runtime.attention.metadata import AttentionMetadata
from runtime.attention.triton_backend import TritonBackend

FIELDS = 5
"""Rows of the input buffer: ids, positions, slots, lengths, table index."""


def warm_up(model, kv: KVCache) -> None:
    """Run a 2-token step eagerly once (Triton attention), so that Triton compiles its kernels at load, not
    in the first request's time to first token (a compile takes most of a second). It writes block 0, which holds
    nothing yet: a sequence writes each slot before it reads it."""
    dev = model.device
    two = torch.arange(2, device=dev)
    meta = TritonBackend().metadata(
        slot_mapping=two,
        row_tables=torch.zeros(1, 1, dtype=torch.int64, device=dev),
        row_lens=two + 1,
        row_table_index=torch.zeros(2, dtype=torch.int64, device=dev),
    )
    model.forward(two, two, meta, kv)
    torch.cuda.synchronize(dev)


def capture_sizes(max_tokens: int) -> list[int]:
    """1, 2, 4, every multiple of 8 below 64, every multiple of 64, up to max_tokens (always one)."""
    small = [s for s in (1, 2, 4) if s < max_tokens] + list(range(8, min(64, max_tokens), 8))
    return sorted(set(small + list(range(64, max_tokens, 64)) + [max_tokens]))


class StepGraphs:
    def __init__(self, model, kv: KVCache, max_tokens: int, max_seqs: int, max_model_len: int):
        """model: a LlamaModel on CUDA whose attention is the Triton kernel; kv: its pool, with a scratch slot.
        Captures every size of capture_sizes(max_tokens) for steps of at most max_seqs sequences."""
        if kv.scratch_slot is None:
            raise ValueError("StepGraphs: the KV pool needs a scratch slot (KVCache(..., scratch=True))")
        self.kv = kv
        self.sizes = capture_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = max_seqs
        width = -(-max_model_len // kv.block_size)
        device = model.device
        n = self.max_tokens
        self.inputs = torch.zeros(FIELDS, n, dtype=torch.int64, device=device)
        self.inputs[2] = kv.scratch_slot
        self.inputs[3] = 1
        self.tables = torch.zeros(max_seqs, width, dtype=torch.int64, device=device)
        self.host_inputs = torch.zeros(FIELDS, n, dtype=torch.int64).pin_memory()
        self.host_tables = torch.zeros(max_seqs, width, dtype=torch.int64).pin_memory()
        self._inputs = self.host_inputs.numpy()
        self._tables = self.host_tables.numpy()
        self.copied = torch.cuda.Event()
        """Recorded after a step's copies: the next step waits for it before refilling the host buffers (a
        step that samples nothing does not wait for the GPU otherwise)."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the memory the largest one's capture reserved
        for size in reversed(self.sizes):
            ids, positions, meta = self._step(size)
            side = torch.cuda.Stream()  # warm up (Triton's compile, cuBLAS's handles) off the capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model.forward(ids, positions, meta, kv)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = model.forward(ids, positions, meta, kv)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _step(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, positions, slots, lens, index = self.inputs[:, :size]
        meta = TritonBackend().metadata(
            slot_mapping=slots,
            row_tables=self.tables,
            row_lens=lens,
            row_table_index=index,
        )
        return ids, positions, meta

    def fits(self, tokens: int, seqs: int) -> bool:
        return tokens <= self.max_tokens and seqs <= self.max_seqs

    def size_for(self, tokens: int) -> int:
        """The captured size a step of `tokens` rows replays."""
        return next(s for s in self.sizes if s >= tokens)

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lens: list[int],
        index: list[int],
    ) -> torch.Tensor:
        """One step (as triton_backend.row_inputs lays it out; fits() must hold): hidden states [tokens,
        hidden], valid until the next replay."""
        t = len(ids)
        size = self.size_for(t)
        self.copied.synchronize()
        host = self._inputs
        for row, values in enumerate((ids, positions, slots, lens, index)):
            host[row, :t] = values
        host[2, t:size] = self.kv.scratch_slot  # padding rows: the scratch slot, one position, table 0
        host[3, t:size] = 1
        host[4, t:size] = 0
        width = max(len(row) for row in tables)
        for i, row in enumerate(tables):
            self._tables[i, : len(row)] = row
        self.inputs[:, :size].copy_(self.host_inputs[:, :size], non_blocking=True)
        self.tables[: len(tables), :width].copy_(self.host_tables[: len(tables), :width], non_blocking=True)
        self.copied.record()
        self.graphs[size].replay()
        return self.outputs[size][:t]
