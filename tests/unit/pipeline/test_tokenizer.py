import json

from pipeline.tokenizer import VOCAB_SIZE, clip_vocab_and_merges, load_clip_tokenizer, write_clip_tokenizer


def test_known_clip_ids(tmp_path):
    tokenizer = load_clip_tokenizer(write_clip_tokenizer(tmp_path))
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_vocab_layout(tmp_path):
    vocab, merges = clip_vocab_and_merges()
    assert len(vocab) == VOCAB_SIZE and len(merges) == 49152 - 256 - 2
    assert vocab["!"] == 0 and vocab["!</w>"] == 256
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    write_clip_tokenizer(tmp_path)
    assert json.loads((tmp_path / "vocab.json").read_text()) == vocab
    lines = (tmp_path / "merges.txt").read_text().splitlines()
    assert lines[0].startswith("#version") and lines[1:] == [" ".join(m) for m in merges]


def test_padding_to_77_and_sd2_pad_token(tmp_path):
    tokenizer = load_clip_tokenizer(write_clip_tokenizer(tmp_path, pad_token="!"))
    ids = tokenizer("a cat", padding="max_length", max_length=77, truncation=True).input_ids
    assert len(ids) == 77 and ids[:4] == [49406, 320, 2368, 49407] and set(ids[4:]) == {0}
