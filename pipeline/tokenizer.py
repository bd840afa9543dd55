"""The CLIP tokenizer, rebuilt offline from the BPE table that ships inside open_clip's wheel.

Place in the data flow: producer → queue → worker → **pipeline** (model build) → storage → status.
Offline model builds (:mod:`pipeline.models`) need a real tokenizer but cannot download one; the
byte-pair table ``open_clip/bpe_simple_vocab_16e6.txt.gz`` (MIT) holds everything CLIP's own
tokenizer derives its vocabulary from, so we derive it here the same way and save it in the
Hugging Face layout (``vocab.json`` + ``merges.txt``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from functools import lru_cache
from pathlib import Path
from typing import cast

from transformers import CLIPTokenizer

BPE_FILENAME = "bpe_simple_vocab_16e6.txt.gz"
#: CLIP keeps merges 1 … 49152-256-2 of the table (line 0 is a header).
NUM_MERGES = 49152 - 256 - 2
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
VOCAB_SIZE = 49408
MAX_LENGTH = 77


def bpe_path() -> Path:
    """Path of the gzip BPE table inside the installed ``open_clip`` package.

    The package is located without importing it (importing open_clip pulls in torchvision).

    Raises:
        FileNotFoundError: open_clip_torch is not installed or its wheel lacks the table.
    """
    spec = importlib.util.find_spec("open_clip")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / BPE_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{BPE_FILENAME} not found: install open_clip_torch (pip install --no-deps)")


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's reversible map from the 256 byte values to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


@lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary (token → id, 49,408 entries) and its ordered BPE merges (48,894 pairs)."""
    with gzip.open(bpe_path(), "rt", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    merges = [cast("tuple[str, str]", tuple(line.split())) for line in lines[1 : NUM_MERGES + 1]]
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + [BOS, EOS]
    if len(tokens) != VOCAB_SIZE:
        raise ValueError(f"derived {len(tokens)} tokens from {bpe_path()}, expected {VOCAB_SIZE}")
    return {tok: i for i, tok in enumerate(tokens)}, merges


def write_clip_tokenizer(directory: Path, *, pad_token: str = EOS) -> Path:
    """Write a loadable CLIP tokenizer (``vocab.json``, ``merges.txt``, configs) into ``directory``.

    ``pad_token`` is ``<|endoftext|>`` for SD 1.x and ``!`` for SD 2.x (as those models ship).
    Returns ``directory``.
    """
    vocab, merges = clip_vocab_and_merges()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=MAX_LENGTH)
    tokenizer.save_pretrained(directory)
    # The classic files, so that any transformers version (slow or fast tokenizer) can load it.
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (directory / "merges.txt").write_text(merges_text, encoding="utf-8")
    return directory


def load_clip_tokenizer(directory: Path) -> CLIPTokenizer:
    """Load a tokenizer written by :func:`write_clip_tokenizer`."""
    return CLIPTokenizer.from_pretrained(directory)
