"""Offline tokenizers for the offline builds: CLIP (the real BPE) and word-level T5 / Mistral stand-ins.

Place in the data flow: :mod:`pipeline.models.build` writes one into each offline model's
``tokenizer*`` folder; the diffusers pipeline loads it like any other tokenizer.

Chinese: a ``BertTokenizer`` with one token per CJK character (the Taiyi layout) and a
ChatGLM tokenizer on a SentencePiece ``char`` model trained here in memory (Kolors).

CLIP's tokenizer is the real one (:mod:`pipeline.tokenizer`). T5 (SD3's ``tokenizer_3``, FLUX.1's
``tokenizer_2``) and ERNIE-Image's Mistral tokenizer are SentencePiece / Tekken models that cannot
be downloaded here, so the offline builds get a **word-level** tokenizer built in code with the
``tokenizers`` library: lower-cased words and punctuation, with the vocabulary taken from CLIP's
whole-word BPE tokens (in CLIP's order, so common words get small ids) and capped at the model's
embedding size, plus the special tokens and the end-of-sequence / begin-of-sequence template of
the real tokenizer. Prompts thus map to stable, distinct token ids of the right length and padding
behaviour, which is all that random-weight models need; the ids are not the real model's.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import BertTokenizer, PreTrainedTokenizerFast

from pipeline.tokenizer import clip_vocab_and_merges, write_clip_tokenizer

#: kind → (special tokens in id order, unk, pad, bos or None, eos or None, add bos, add eos, max length)
WORD_LEVEL = {
    "t5": (["<pad>", "</s>", "<unk>"], "<unk>", "<pad>", None, "</s>", False, True, 512),
    "mistral": (["<unk>", "<s>", "</s>"], "<unk>", "</s>", "<s>", "</s>", True, False, 4096),
}


def word_vocabulary(size: int, specials: list[str]) -> dict[str, int]:
    """``specials`` first, then CLIP's whole-word tokens in CLIP's order, ``size`` entries at most."""
    vocab = {tok: i for i, tok in enumerate(specials)}
    clip, _ = clip_vocab_and_merges()
    for token in clip:
        if len(vocab) >= size:
            break
        if token.endswith("</w>") and len(token) > 4:
            word = token[:-4]
            if word.isprintable() and word not in vocab:
                vocab[word] = len(vocab)
    return vocab


def word_level_tokenizer(kind: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level stand-in for a ``kind`` (``t5`` or ``mistral``) tokenizer with ``vocab_size`` ids.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in WORD_LEVEL:
        raise ValueError(f"unknown word-level tokenizer kind {kind!r}; known: {', '.join(WORD_LEVEL)}")
    specials, unk, pad, bos, eos, add_bos, add_eos, max_length = WORD_LEVEL[kind]
    vocab = word_vocabulary(vocab_size, specials)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")
    single = " ".join([*(["<s>"] if add_bos else []), "$A", *([eos] if add_eos else [])])
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, vocab[t]) for t in specials if t in single.split()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, pad_token=pad, bos_token=bos,
                                   eos_token=eos, model_max_length=max_length)


BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
#: Full-width and CJK punctuation a Chinese prompt uses.
CJK_PUNCTUATION = "，。！？、；：“”‘’（）《》【】「」…—·～"


def chinese_bert_vocabulary(size: int) -> list[str]:
    """A BERT WordPiece vocabulary for Chinese prompts, ``size`` entries: the special tokens, ASCII
    characters, CJK punctuation, every CJK Unified Ideograph of U+4E00…U+9FA5 (one token per
    character, as bert-base-chinese tokenizes Chinese), then CLIP's whole English words. The layout
    of bert-base-chinese's 21,128-entry vocab.txt (the Taiyi text encoder's), not its ids."""
    vocab = [*BERT_SPECIALS, *(chr(c) for c in range(0x21, 0x7F)), *CJK_PUNCTUATION,
             *(chr(c) for c in range(0x4E00, 0x9FA6))]
    seen = set(vocab)
    clip, _ = clip_vocab_and_merges()
    for token in clip:
        if len(vocab) >= size:
            break
        word = token[:-4] if token.endswith("</w>") else ""
        if len(word) > 1 and word.isascii() and word.isalpha() and word not in seen:
            vocab.append(word)
            seen.add(word)
    return vocab[:size]


def chatglm_tokenizer_model(pieces: int) -> bytes:
    """A SentencePiece model (bytes) for an offline ChatGLM tokenizer: a ``char`` model trained in
    memory on every CJK Unified Ideograph of U+4E00…U+9FA5 and ASCII, so a Chinese prompt is one
    piece per character; ``pieces`` caps the vocabulary. ChatGLM's own tokenizer.model (65k
    pieces) cannot be downloaded here; the ids are not the real model's."""
    import io

    import sentencepiece as spm

    chars = [chr(x) for x in range(0x4E00, 0x9FA6)]
    lines = ["".join(chars[i:i + 64]) for i in range(0, len(chars), 64)]
    lines += ["".join(chr(x) for x in range(0x21, 0x7F)) + CJK_PUNCTUATION] * 4
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=pieces,
                                   model_type="char", character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return out.getvalue()


def write_tokenizer(directory: Path, spec: dict) -> None:
    """Write the tokenizer ``spec`` describes into ``directory``: ``{"kind": "clip", "pad_token": ...}``,
    ``{"kind": "t5" | "mistral", "vocab_size": n}`` or ``{"kind": "bert", "vocab_size": n,
    "model_max_length": m}`` (a ``BertTokenizer`` for Chinese, :func:`chinese_bert_vocabulary`)."""
    kind = spec["kind"]
    if kind == "clip":
        write_clip_tokenizer(directory, pad_token=spec.get("pad_token", "<|endoftext|>"))
        return
    if kind == "chatglm":
        from diffusers.pipelines.kolors.tokenizer import ChatGLMTokenizer

        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.model").write_bytes(chatglm_tokenizer_model(spec["vocab_size"]))
        ChatGLMTokenizer(str(directory / "tokenizer.model")).save_pretrained(directory)
        return
    if kind == "bert":
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "vocab.txt").write_text("\n".join(chinese_bert_vocabulary(spec["vocab_size"])) + "\n",
                                             encoding="utf-8")
        BertTokenizer(str(directory / "vocab.txt"), do_lower_case=True, tokenize_chinese_chars=True,
                      model_max_length=spec.get("model_max_length", 512)).save_pretrained(directory)
        return
    directory.mkdir(parents=True, exist_ok=True)
    word_level_tokenizer(kind, spec["vocab_size"]).save_pretrained(directory)


def make_tokenizer(spec: dict, scratch: Path):
    """The tokenizer object ``spec`` describes (written to ``scratch`` and loaded back)."""
    write_tokenizer(scratch, spec)
    if spec["kind"] == "clip":
        from pipeline.tokenizer import load_clip_tokenizer

        return load_clip_tokenizer(scratch)
    if spec["kind"] == "bert":
        return BertTokenizer.from_pretrained(scratch)
    if spec["kind"] == "chatglm":
        from diffusers.pipelines.kolors.tokenizer import ChatGLMTokenizer

        return ChatGLMTokenizer.from_pretrained(scratch)
    return PreTrainedTokenizerFast.from_pretrained(scratch)
