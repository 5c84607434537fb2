"""The attention backend interface: one object per way of computing paged attention (PyTorch, the C
kernels, Triton), chosen once by the runner (selector.py). Each builds the metadata its kernels read from
the step's scheduled rows, and computes a layer's attention from it, with the layer's sliding window and
logit soft-cap.

The rule every backend follows: a query at position p sees the keys at positions j with p - window < j <= p
(window None: every j <= p; transformers' sliding_window, the query's own key counted), and each scaled
score s becomes softcap * tanh(s / softcap) before the softmax (softcap None: unchanged).
"""

from __future__ import annotations

import torch

from runtime.attention.metadata import AttentionMetadata, PrefillChunk, ScheduledRows


class AttentionBackend:
    name = "?"
    """For logs and tests; nothing branches on it."""
    native = False
    """Decodes run in the C kernel, which takes float32 queries as they are, as the C layer loop
    (runtime/model/decode_layers.py) calls it."""
    rows_carry_tables = False
    """Its metadata gives every row its own table and length (PrefillChunk.block_table stays None)."""
    capturable = False
    """Its launches' shapes do not depend on the rows' lengths: a step can be captured in a CUDA graph
    (runtime/runner/cuda_graphs.py)."""
    metadata_type: type[AttentionMetadata] = AttentionMetadata
    """The metadata it builds: AttentionMetadata with this backend's own fields."""

    @staticmethod
    def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether it computes attention for queries like q ([T, heads, D]) over this pool."""
        raise NotImplementedError

    def build(
        self,
        decodes: list[ScheduledRows],
        prefills: list[ScheduledRows],
        slot_mapping: torch.Tensor | None,
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """The metadata of a step whose rows are one per decode, then each prefill's chunk, in order."""
        meta = self.metadata(slot_mapping=slot_mapping, num_decode=len(decodes))
        if decodes and not self.rows_carry_tables:
            width = (max(d.end for d in decodes) + block_size - 1) // block_size
            tables = [d.block_table[:width] + [0] * (width - len(d.block_table[:width])) for d in decodes]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64, device=device)
            meta.decode_context_lens = torch.tensor(
                [d.end for d in decodes], dtype=torch.int64, device=device
            )
        row = len(decodes)
        for p in prefills:
            n = p.end - p.start
            table = None
            if not self.rows_carry_tables:
                table = torch.tensor(p.block_table[: (p.end + block_size - 1) // block_size], device=device)
            meta.prefills.append(PrefillChunk(row, row + n, p.end, table))
            row += n
        self.complete(meta, decodes, prefills, block_size, device)
        return meta

    def complete(
        self,
        meta: AttentionMetadata,
        decodes: list[ScheduledRows],
        prefills: list[ScheduledRows],
        block_size: int,
        device: torch.device,
    ) -> None:
        """Fills this backend's own fields of a step's metadata (build); none here."""

    def metadata(self, **fields) -> AttentionMetadata:
        """An empty metadata of this backend's kind, itself as its backend."""
        return self.metadata_type(backend=self, **fields)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [T, heads, D]; k, v [T, kv_heads, D] the new tokens' (already written to the cache; None: read
        back from it). Returns [T, heads, D] in q's dtype."""
        raise NotImplementedError
