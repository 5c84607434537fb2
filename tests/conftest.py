"""The two lanes of the suite: `make test` runs every test, `make test-fast` (`-m "not slow"`) leaves out
the tests marked `slow`: those that load the real model, start a server, torchrun ranks, spawned
(not forked) worker processes, a program in a fresh interpreter, or a build of the C kernels.

A test that asks for one of the fixtures below is marked `slow` here, whichever file it is in; a test
that does one of the others by itself carries the mark, on its module (`pytestmark`) where every test
of the module does.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from pathlib import Path

import pytest

# The fixtures that load the real model (the engine, transformers' reference) or start a real server.
SLOW_FIXTURES = frozenset(
    {"engine_fp32", "reference", "transformers_dir", "offline_engine", "server", "client"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # the longest files first (tests/file_durations.py): with `--dist loadfile --no-loadscope-reorder` the
    # workers take them in this order, and the short ones fill in at the end
    from tests.file_durations import ordered

    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    rank = {path: i for i, path in enumerate(ordered(files))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, transformers' GGUF loading parses a file once and maps tensor names once per shape:
    it opens the file anew for the tokenizer, the config and the weights (the reader parses every vocabulary
    string in Python, ~10 CPU-s each time for the default model) and builds gguf's name table again for each
    of the model's ~400 modules. Both are read-only results of their arguments: what transformers loads is
    unchanged, only not computed again."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(lambda path, mode="r": reader(path, mode))
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@pytest.fixture(scope="session")
def transformers_dir(tmp_path_factory) -> Path:
    """transformers' own load of the default GGUF (its tokenizer, and the model in float32), saved in its own
    format once per run for every worker: the oracle of the tests that compare with transformers. Its GGUF
    loader takes ~15 CPU-s a load (it dequantizes every tensor and parses the vocabulary in Python); loading
    what it saved takes about one. The first worker to ask converts; the others wait on the lock."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's directory, shared by its workers
    out = root / "transformers-from-gguf"
    with open(root / "transformers-from-gguf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "complete").exists():
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from runtime.model.checkpoint import default_model_path

            path = default_model_path()
            where = dict(
                pretrained_model_name_or_path=os.path.dirname(path), gguf_file=os.path.basename(path)
            )
            with gguf_parsed_once():
                tokenizer = AutoTokenizer.from_pretrained(**where)
                model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
            # every weight is dequantized to float32: only the loader's GGUF bookkeeping, which refuses to
            # save, says otherwise
            model.hf_quantizer = None
            del model.config.quantization_config
            tokenizer.save_pretrained(out)
            model.save_pretrained(out)
            (out / "complete").touch()
    return out
