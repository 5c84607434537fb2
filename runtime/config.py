"""EngineConfig: every setting of the engine, and the one place where their defaults live.

It nests five plain dataclasses, by what each setting governs:

    model        which checkpoint, on which device, in which dtype
    cache        how many bytes the paged KV pool takes
    scheduler    scheduler.SchedulerConfig: blocks, batch limits, policy, context length
    parallel     CPU threads
    speculative  speculative decoding: the proposer and how many tokens it proposes

`Engine.from_pretrained` and the server's CLI (`server/cli.py` builds one flag
per field) both read it; neither restates a default. Each field's docstring
is its help text. Flat keyword names (`max_num_seqs=8`) address a nested field
through `EngineConfig.replace`, so every field name is unique across sections.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import cache, lru_cache

from loader.sizes import parse_size
from runtime.quant.quantizations import QUANTIZATIONS
from runtime.spec_decode.config import SpeculativeConfig
from scheduler import SchedulerConfig

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelSettings:
    model: str | None = None
    """A .gguf file or a Hugging Face checkpoint directory of a supported family: Llama (3.x too), Mistral,
    Qwen 2/2.5/3, Gemma 2/3, Phi-3 (None: SmolLM2-135M-Instruct)."""
    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES})
    """Weights and activations: 'auto' is bfloat16 where the hardware computes in it, else float32."""
    device: str | None = None
    """cpu or cuda (None: cuda if available)."""
    quantization: str = field(default="auto", metadata={"choices": QUANTIZATIONS})
    """auto: a GGUF's Q4_0/Q4_1/Q8_0 blocks run packed where that is fast (on CPU: bfloat16, or a float32
    that dtype 'auto' chose where the packed kernel measured faster; runtime/quant/resolve.py); none:
    dequantize; gguf: always packed; int8 / int4: quantize a float checkpoint on load. A GGUF's other types
    (K-quants, Q5_0, F16, ...) are de-quantized to the compute dtype one tensor at a time."""
    enforce_eager: bool = False
    """CUDA: run steps op by op instead of replaying the CUDA graphs captured at load for 1, 2, 4, 8, 16,
    .. 56 tokens, then every 64 up to max_num_batched_tokens or 512 (a graph is one launch for the whole step:
    small models' steps are otherwise mostly launch overhead). No effect on CPU."""
    dense_copy_bytes: int | str | None = field(default=None, metadata={"size": True})
    """Memory for dense copies of packed GGUF projections (a prefill chunk or a large batch may multiply
    faster by them, from a row count measured at load): projections get one in order, the layers' from
    the first, then the LM head's, while they fit. 0 turns them off. None: none where the C kernels' vector
    loops are built (their many-row loops take every row count, and the packed model holds about the
    file's bytes), no cap where they are not."""

    def __post_init__(self) -> None:
        self.dense_copy_bytes = parse_size(self.dense_copy_bytes, "dense_copy_bytes")


@dataclass
class CacheConfig:
    kv_cache_bytes: int | str = field(default=1 << 30, metadata={"size": True})
    """KV cache size in bytes, or a size such as 512MiB, 1GiB, 1G (= 1GiB) or 1GB (= 10^9 bytes)."""

    def __post_init__(self) -> None:
        size = parse_size(self.kv_cache_bytes, "kv_cache_bytes")
        if size is None or size <= 0:
            raise ValueError(
                f"kv_cache_bytes: must be a positive number of bytes, got {self.kv_cache_bytes!r}"
            )
        self.kv_cache_bytes = size


@dataclass
class ParallelConfig:
    num_threads: int | None = None
    """CPU compute threads, the most the engine runs (None: the cores it may use: its affinity mask, at most
    ceil(its cgroup CPU quota), at most torch's default)."""
    adaptive_threads: bool = True
    """Run fewer compute threads while other processes share the cores or a CPU quota throttles the engine,
    and more again when cores stand idle (runtime/engine/cpu_share.py)."""

    def __post_init__(self) -> None:
        value = self.num_threads
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"num_threads: must be a positive integer, got {value!r}")


@dataclass
class SpeculativeSettings:
    speculative_config: str | dict | SpeculativeConfig | None = None
    """Speculative decoding, as vLLM's JSON: {"method": "ngram", "num_speculative_tokens": 5,
    "prompt_lookup_min": 2, "prompt_lookup_max": 5}, {"method": "suffix"} or {"method": "draft_model",
    "model": PATH}. Proposed tokens are verified in the same step as the batch's other work; outputs are
    those without it (greedy: token for token; sampled: the same distribution). None: off."""

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)


@dataclass
class EngineConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)

    def replace(self, **settings) -> EngineConfig:
        """A copy with settings changed by their field names (`max_num_seqs=8`, `dtype="float32"`);
        None leaves a setting as it is. Raises ValueError naming an unknown field."""
        changes: dict[str, dict] = {}
        sections = section_of_field()
        for name, value in settings.items():
            if name not in sections:
                raise ValueError(f"{name}: not an engine setting; known: {', '.join(sorted(sections))}")
            if value is not None:
                changes.setdefault(sections[name], {})[name] = value
        return dataclasses.replace(
            self,
            **{
                section: dataclasses.replace(getattr(self, section), **values)
                for section, values in changes.items()
            },
        )

    def settings(self) -> dict[str, object]:
        """Every setting by its field name, flattened over the sections."""
        return {name: getattr(getattr(self, section), name) for name, section in section_of_field().items()}


@lru_cache(maxsize=1)
def section_of_field() -> dict[str, str]:
    """{field name: the EngineConfig section holding it}."""
    out: dict[str, str] = {}
    for section in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(section.default_factory):
            if f.name in out:
                raise AssertionError(f"{f.name}: in both {out[f.name]} and {section.name}")
            out[f.name] = section.name
    return out


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (what the CLI shows as help)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs
