"""Tokenizer against llama.cpp's token ids (shared/reference), plus small GGUF files written with gguf-py."""

from __future__ import annotations

import codecs
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from detinfer.errors import TokenizerError
from detinfer.gguf_file import ModelFile
from detinfer.tokenizer import StreamDecoder, Tokenizer, _gpt2_bytes_to_unicode


@pytest.fixture(scope="module")
def model_file(model_path: Path) -> ModelFile:
    return ModelFile(model_path)


@pytest.fixture(scope="module")
def tok(model_file: ModelFile) -> Tokenizer:
    return Tokenizer.from_model(model_file)


def first_difference(got: list[int], want: list[int]) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    lengths = f"(lengths {len(got)}, {len(want)})"
    return f"first difference at token {i}: got {got[i : i + 5]}, llama.cpp {want[i : i + 5]} {lengths}"


def test_reference_prompts_match_llamacpp(tok: Tokenizer, smollm2_reference: dict):
    for prompt in smollm2_reference["prompts"]:
        ids = tok.encode(prompt["text"], parse_special=prompt["add_special_parsed"])
        assert ids == prompt["tokens"], f"{prompt['name']}: {first_difference(ids, prompt['tokens'])}"


def test_reference_continuations_decode_to_reference_text(tok: Tokenizer, smollm2_reference: dict):
    for prompt in smollm2_reference["prompts"]:
        assert tok.decode(prompt["greedy_64"]) == prompt["greedy_text"], prompt["name"]
        assert tok.decode(prompt["tokens"]) == prompt["text"], prompt["name"]


def test_smollm2_special_ids(tok: Tokenizer):
    assert tok.n_vocab == 49152
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    # <|endoftext|>, <|im_end|> (eos) and <reponame>, which llama.cpp takes as the fill-in-the-middle repo token
    assert tok.eog_ids == frozenset({0, 2, 4})


def test_bos_only_when_asked(tok: Tokenizer):
    assert tok.encode("Hello")[0] != tok.bos_id
    assert tok.encode("Hello", add_bos=True) == [tok.bos_id, *tok.encode("Hello")]
    assert tok.encode("", add_bos=True) == [tok.bos_id]
    assert tok.encode("") == []


def test_special_text_stays_plain_unless_parsed(tok: Tokenizer):
    text = "a<|im_end|>b<|im_start|>"
    plain = tok.encode(text)
    assert 1 not in plain and 2 not in plain
    assert tok.decode(plain) == text
    parsed = tok.encode(text, parse_special=True)
    assert parsed == [*tok.encode("a"), 2, *tok.encode("b"), 1]
    assert tok.decode(parsed) == text


def test_smollm_splits_every_digit(tok: Tokenizer):
    ids = tok.encode("2024")
    assert [tok.token_bytes(i) for i in ids] == [b"2", b"0", b"2", b"4"]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading and trailing spaces  ",
        "tabs\tand\nnew\r\nlines\n\n\n",
        "def f(x):\n    return x ** 2  # comment",
        "Ünïcödé, 中文, русский, العربية, emoji 🦙🎉👍🏽",
        "numbers 3.14159 and 1,000,000",
        "it's we'll they'd I'M",
    ],
)
def test_decode_round_trips(tok: Tokenizer, text: str):
    assert tok.decode(tok.encode(text)) == text


def test_token_bytes_are_byte_level_decoded(tok: Tokenizer):
    assert tok.token_bytes(tok.encode(" Paris")[0]) == b" Paris"
    assert tok.token_bytes(2) == b"<|im_end|>"  # control tokens give their text
    assert tok.token_text(tok.encode(" Paris")[0]) == "ĠParis"


def test_token_ids_out_of_range_raise(tok: Tokenizer):
    for bad in (-1, tok.n_vocab, 10**9):
        with pytest.raises(TokenizerError, match="outside the vocabulary"):
            tok.token_bytes(bad)
    with pytest.raises(TokenizerError):
        tok.decode([5, -3])
    with pytest.raises(TokenizerError, match="not an integer"):
        tok.token_bytes("5")  # type: ignore[arg-type]
    assert tok.token_bytes(np.int64(2)) == tok.token_bytes(2)  # a sampler may hand back numpy integers


def test_unencodable_text_raises(tok: Tokenizer):
    with pytest.raises(TokenizerError):
        tok.encode("lone \ud800 surrogate")


def test_stream_decoder_holds_back_a_split_emoji(tok: Tokenizer):
    ids = tok.encode(" 🦙")
    pieces = [tok.token_bytes(i) for i in ids]
    assert len(ids) > 1 and b"".join(pieces) == " 🦙".encode()  # the emoji's 4 bytes span several tokens
    dec = tok.stream_decoder()
    outs = [dec.feed(i) for i in ids]
    assert outs[:-1] == [" "] + [""] * (len(ids) - 2)
    assert outs[-1] == "🦙"
    assert dec.flush() == ""


def test_stream_decoder_equals_decode(tok: Tokenizer):
    text = "Llamas 🦙 live in the Andes 🏔️; 東京 is far. Ünïcödé ok 👍🏽!"
    sequences = [tok.encode(text)]
    rng = np.random.default_rng(0)  # arbitrary ids, including ones that leave invalid or unfinished UTF-8
    byte_ids = [i for i in range(tok.n_vocab) if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80]
    sequences += [rng.choice(byte_ids, size=30).tolist() for _ in range(20)]
    sequences += [rng.integers(0, tok.n_vocab, size=40).tolist() for _ in range(20)]
    for ids in sequences:
        dec = tok.stream_decoder()
        streamed = "".join(dec.feed(i) for i in ids) + dec.flush()
        assert streamed == tok.decode(ids), ids


def test_stream_decoder_flush_emits_unfinished_character(tok: Tokenizer):
    dec = StreamDecoder(tok)
    first = tok.encode(" 🦙")[:2]  # " " plus part of the emoji
    assert "".join(dec.feed(i) for i in first) == " "
    assert dec.flush() == "\ufffd"
    assert dec.feed(tok.encode("ok")[0]) == "ok"  # flush resets the decoder


def test_hash_covers_tokenizer_metadata_only(tok: Tokenizer, model_file: ModelFile):
    assert len(tok.hash) == 64 and int(tok.hash, 16) >= 0
    assert Tokenizer.from_model(model_file).hash == tok.hash


def test_build_time(model_file: ModelFile):
    best = min(_timed_build(model_file) for _ in range(3))
    print(f"tokenizer build: {best * 1000:.0f} ms")
    assert best < 1.0  # target is < 0.3 s; the bound is loose because the test machine is shared


def _timed_build(mf: ModelFile) -> float:
    t = time.perf_counter()
    Tokenizer.from_model(mf)
    return time.perf_counter() - t


# --- small GGUF files: a byte-level vocabulary of the 256 bytes, a few merges and special tokens ---

BYTE_CHARS = [_gpt2_bytes_to_unicode()[b] for b in range(256)]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o"]
MERGED = ["he", "ll", "hell", "hello", "Ġw", "Ġwo"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
CONTROL, USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)


def write_gguf(path: Path, **overrides) -> ModelFile:
    """A GGUF holding only tokenizer metadata; ``overrides`` replace or (value None) drop keys."""
    tokens = SPECIALS + BYTE_CHARS + MERGED
    types = [CONTROL, CONTROL, CONTROL, USER_DEFINED] + [int(gguf.TokenType.NORMAL)] * (len(tokens) - 4)
    fields = {
        "model": "gpt2", "pre": "smollm", "tokens": tokens, "types": types, "merges": MERGES,
        "bos": 1, "eos": 2, "add_bos": None, "template": "{{ messages }}",
    }  # fmt: skip
    fields.update(overrides)
    w = gguf.GGUFWriter(path, "llama")
    if fields["model"] is not None:
        w.add_tokenizer_model(fields["model"])
    if fields["pre"] is not None:
        w.add_tokenizer_pre(fields["pre"])
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["types"])
    w.add_token_merges(fields["merges"])
    if fields["bos"] is not None:
        w.add_bos_token_id(fields["bos"])
    if fields["eos"] is not None:
        w.add_eos_token_id(fields["eos"])
    if fields["add_bos"] is not None:
        w.add_add_bos_token(fields["add_bos"])
    if fields["template"] is not None:
        w.add_chat_template(fields["template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ModelFile(path, use_index=False)


def test_small_gguf_builds_and_merges(tmp_path: Path):
    t = Tokenizer.from_model(write_gguf(tmp_path / "t.gguf"))
    assert t.n_vocab == 4 + 256 + len(MERGED)
    assert [t.token_text(i) for i in t.encode("hello world")] == ["hello", "Ġwo", "r", "l", "d"]
    assert t.eog_ids == frozenset({0, 2})


def test_user_defined_tokens_always_match_control_only_when_parsed(tmp_path: Path):
    t = Tokenizer.from_model(write_gguf(tmp_path / "t.gguf"))
    assert t.encode("a<tool>b") == [*t.encode("a"), 3, *t.encode("b")]
    assert 2 not in t.encode("a<|im_end|>b")
    assert 2 in t.encode("a<|im_end|>b", parse_special=True)


def test_unknown_pre_tokenizer_raises_naming_it(tmp_path: Path):
    with pytest.raises(TokenizerError, match="'made-up-pre'"):
        Tokenizer.from_model(write_gguf(tmp_path / "t.gguf", pre="made-up-pre"))


def test_missing_pre_tokenizer_raises(tmp_path: Path):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre is missing"):
        Tokenizer.from_model(write_gguf(tmp_path / "t.gguf", pre=None))


def test_unsupported_tokenizer_model_raises_naming_it(tmp_path: Path):
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_model(write_gguf(tmp_path / "t.gguf", model="bert"))


def test_duplicate_token_raises(tmp_path: Path):
    tokens = SPECIALS + BYTE_CHARS + MERGED[:-1] + ["he"]
    with pytest.raises(TokenizerError, match="duplicate token 'he' at ids 260 and 265"):
        Tokenizer.from_model(write_gguf(tmp_path / "t.gguf", tokens=tokens))


def test_special_id_outside_vocabulary_raises(tmp_path: Path):
    with pytest.raises(TokenizerError, match="bos_token_id = 99999"):
        Tokenizer.from_model(write_gguf(tmp_path / "t.gguf", bos=99999))


def test_add_bos_defaults_and_overrides(tmp_path: Path):
    assert Tokenizer.from_model(write_gguf(tmp_path / "a.gguf")).add_bos is False
    t = Tokenizer.from_model(write_gguf(tmp_path / "b.gguf", pre="llama-bpe"))
    assert t.add_bos is True and t.encode("hello") == [1, t.encode("hello", add_bos=False)[0]]
    assert Tokenizer.from_model(write_gguf(tmp_path / "c.gguf", pre="llama-bpe", add_bos=False)).add_bos is False
    with pytest.raises(TokenizerError, match="bos_token_id is missing"):
        Tokenizer.from_model(write_gguf(tmp_path / "d.gguf", add_bos=True, bos=None))
    t = Tokenizer.from_model(write_gguf(tmp_path / "e.gguf", bos=None))
    assert t.bos_id is None
    with pytest.raises(TokenizerError, match="no BOS"):
        t.encode("hello", add_bos=True)


def test_hash_changes_with_tokenizer_metadata_not_chat_template(tmp_path: Path):
    base = Tokenizer.from_model(write_gguf(tmp_path / "a.gguf")).hash
    assert Tokenizer.from_model(write_gguf(tmp_path / "b.gguf", template="other")).hash == base
    assert Tokenizer.from_model(write_gguf(tmp_path / "c.gguf", eos=0)).hash != base
    assert Tokenizer.from_model(write_gguf(tmp_path / "d.gguf", merges=MERGES[:-1])).hash != base


def test_incremental_utf8_decoder_matches_bytes_decode():
    # The StreamDecoder invariant rests on this property of Python's codecs.
    data = "é🦙中".encode() + b"\xff\xc3" + "x".encode()
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    assert "".join(dec.decode(data[i : i + 1]) for i in range(len(data))) + dec.decode(b"", final=True) == data.decode(
        "utf-8", errors="replace"
    )
