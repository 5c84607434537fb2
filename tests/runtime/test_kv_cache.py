"""The KV pool's memory: zeroed, and on Linux backed by huge pages where transparent huge pages allow it."""

from __future__ import annotations

import re

import torch

from runtime.attention.kv_cache import KVCache
from runtime.model_config import ModelConfig


def _config() -> ModelConfig:
    return ModelConfig(
        name="tiny",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_model_len=512,
        tie_word_embeddings=True,
    )


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return None


def _mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address."""
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                if fields is not None:
                    return fields
                if int(head.group(1), 16) <= address < int(head.group(2), 16):
                    fields = {}
            elif fields is not None and ":" in line:
                key, value = line.split(":", 1)
                fields[key] = value.strip()
    if fields is None:
        raise AssertionError("no mapping holds the pool")
    return fields


def test_pool_is_zeroed_and_sized():
    kv = KVCache(_config(), num_blocks=512, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert kv.pool.shape == (4, 2, 512, 16, 2, 16)
    assert kv.nbytes == 4 * 2 * 512 * 16 * 2 * 16 * 2
    assert not kv.pool.any()


def test_pool_is_advised_onto_huge_pages_where_the_kernel_allows():
    """Whether the kernel finds free 2 MiB pages depends on the machine's memory (fragmentation, defrag
    setting), so the test checks what the pool asks for: the advice on its mapping (VmFlags 'hg')."""
    kv = KVCache(_config(), num_blocks=8192, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    fields = _mapping_fields(kv.pool.data_ptr() + kv.nbytes // 2)
    flags = fields["VmFlags"].split()
    if _thp_mode() in ("always", "madvise"):
        assert "hg" in flags, f"THP is {_thp_mode()!r} but the 64 MiB pool is not advised: VmFlags {flags}"
    else:
        assert fields["AnonHugePages"].split()[0] == "0"
