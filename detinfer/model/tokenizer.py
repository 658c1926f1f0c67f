"""Tokenizer: GGUF ``tokenizer.ggml.*`` metadata → a HF ``tokenizers`` pipeline giving llama.cpp's token ids.

The BPE merging itself is the ``tokenizers`` library's; this module only chooses its pieces the way
llama.cpp's ``src/llama-vocab.cpp`` (``llama_vocab::impl::load``, ``llm_tokenizer_bpe`` and
``llm_tokenizer_spm``) does: the pre-tokenizer regexes named by ``tokenizer.ggml.pre``, the merge table,
which tokens are special, which ids end a generation, and how a token id turns back into bytes. Each
``tokenizer.ggml.model`` has its own builder function in ``_BUILDERS``: ``gpt2`` (byte-level BPE with a
merge list) and ``llama`` (SentencePiece BPE with scores and ``<0xXX>`` byte fallback).
"""

from __future__ import annotations

import codecs
import json
import operator
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np
import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from ..errors import TokenizerError
from ..fileio import DamagedCache, read_sealed_cache, sha256_bytes, warn_damaged_cache, write_sealed_cache
from ..paths import detinfer_home
from .gguf_file import ModelFile

# Token types whose text is matched verbatim before BPE (llama.cpp's special-token cache) and whose
# bytes are their UTF-8 text. Only CONTROL and UNKNOWN are skipped when special tokens are not parsed.
SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})
VERBATIM_TYPES = SPECIAL_TYPES | {TokenType.USER_DEFINED}
NORMAL = int(TokenType.NORMAL)  # a plain int: compared 49k times per build

# Texts llama.cpp treats as end of generation whatever the metadata says (llama-vocab.cpp, "maintain a
# list of tokens that cause end-of-generation"; it also forces them to CONTROL).
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip
# llama.cpp also ends generation on the fill-in-the-middle pad / repo / file-separator tokens, found by
# these texts when their ``tokenizer.ggml.fim_*_token_id`` key is absent.
FIM_EOG_TEXTS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one ``tokenizer.ggml.pre`` value.

    regexes: applied in order, each to the pieces of the previous one; every match and every gap between
        matches becomes a piece (llama.cpp's ``unicode_regex_split``, HF's ``Split(..., "isolated")``).
    ignore_merges: a piece that is itself a vocabulary entry becomes that token without merging.
    add_bos: the default of ``tokenizer.ggml.add_bos_token`` when the key is absent.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


# Regexes copied from llama.cpp's src/llama-vocab.cpp (llm_tokenizer_bpe's constructor), the names from
# llama_vocab::impl::load. Only pre-tokenizers that are a plain regex sequence are listed.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (  # qwen2's with combining marks kept in letter runs (\p{M})
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
_DIGITS_GPT2 = PreTokenizer((r"\p{N}", _GPT2))  # every digit its own piece, then GPT-2
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_LLAMA3_REGEX = PreTokenizer((_LLAMA3,))
_QWEN2_PRE = PreTokenizer((_QWEN2,))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    "gpt-2": _GPT2_PRE,
    "mpt": _GPT2_PRE,
    "olmo": _GPT2_PRE,
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "dbrx": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    "qwen2": _QWEN2_PRE,
    "deepseek-r1-qwen": _QWEN2_PRE,
    "stablelm2": _QWEN2_PRE,
    "qwen35": PreTokenizer((_QWEN35,)),
}


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (openai/gpt-2 encoder.py; llama.cpp's unicode_byte_to_utf8)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_OF_CHAR = {c: b for b, c in _gpt2_bytes_to_unicode().items()}


def _byte_level_bytes(text: str) -> bytes:
    """Bytes of a byte-level BPE token text; a character outside GPT-2's table is kept as its UTF-8."""
    try:
        return bytes([_BYTE_OF_CHAR[c] for c in text])
    except KeyError:
        return b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode("utf-8") for c in text)


@dataclass(frozen=True)
class _Vocab:
    """The ``tokenizer.ggml.*`` fields every builder needs, validated. ``types[i]`` is a TokenType value."""

    name: str  # file name, for messages
    model: str
    pre: str | None
    tokens: list[str]
    ids: dict[str, int]  # token text → id
    types: list[int]
    meta: dict[str, Any]


@dataclass(frozen=True)
class _Backend:
    """What a builder returns: the HF pipeline (no special tokens yet), how a normal token becomes bytes, and
    how a BYTE-typed token does (None: such tokens give no bytes, as llama.cpp's BPE vocabularies)."""

    hf: tokenizers.Tokenizer
    normal_bytes: Callable[[str], bytes]
    add_bos_default: bool
    byte_bytes: Callable[[str], bytes] | None = None


def _split_merges(name: str, merges: Sequence[str]) -> list[tuple[str, str]]:
    """``"a b"`` merge strings → pairs, split at the first space after the first character as llama.cpp does."""
    if set(map(str.count, merges, repeat(" "))) <= {1} and not any(map(str.startswith, merges, repeat(" "))):
        it = iter(" ".join(merges).split(" "))  # fast path: exactly one space, inside, in every merge
        return list(zip(it, it))
    pairs = []
    for i, m in enumerate(merges):
        p = m.find(" ", 1)
        if p < 0:
            raise TokenizerError(f"{name}: tokenizer.ggml.merges[{i}] = {m!r} has no space between its two parts")
        pairs.append((m[:p], m[p + 1 :]))
    return pairs


def _build_gpt2(v: _Vocab) -> _Backend:
    """Byte-level BPE from tokens + merges, split by the ``tokenizer.ggml.pre`` entry of PRE_TOKENIZERS."""
    if v.pre is None:
        raise TokenizerError(
            f"{v.name}: tokenizer.ggml.pre is missing; detinfer needs it to pick the pre-tokenizer "
            f"(known: {', '.join(sorted(PRE_TOKENIZERS))}); re-convert the model with a recent llama.cpp"
        )
    pre = PRE_TOKENIZERS.get(v.pre)
    if pre is None:
        raise TokenizerError(
            f"{v.name}: unknown pre-tokenizer tokenizer.ggml.pre = {v.pre!r}; "
            f"detinfer knows: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    merges = v.meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not set(map(type, merges)) <= {str}:
        raise TokenizerError(f"{v.name}: tokenizer.ggml.merges is missing or not a list of strings")
    try:
        bpe = models.BPE(vocab=v.ids, merges=_split_merges(v.name, merges), ignore_merges=pre.ignore_merges)
    except Exception as e:  # tokenizers raises plain Exception on merges naming unknown tokens
        raise TokenizerError(f"{v.name}: tokenizer.ggml.merges is inconsistent with the vocabulary ({e})") from None
    hf = tokenizers.Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return _Backend(hf, _byte_level_bytes, pre.add_bos)


SPM_SPACE = "\u2581"  # "▁": SentencePiece's escaped space (llama.cpp's llama_escape_whitespace)
SPM_MERGES_VERSION = 2  # bump if _spm_merges changes what it computes or how it is kept: the cache file name carries it
SPM_CACHE_MIN_TOKENS = 32_768  # smaller vocabularies compute their merges faster than a file round trip is worth


def _spm_bytes(text: str) -> bytes:
    """Bytes of a normal SentencePiece token: "▁" is a space (llama.cpp's llama_unescape_whitespace)."""
    return text.replace(SPM_SPACE, " ").encode("utf-8")


def _spm_byte_token(text: str) -> bytes:
    """The byte of a ``<0xXX>`` token (llama.cpp's token_to_byte for SPM); b"" if the text is not of that form."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    return b""


def _spm_merges(v: _Vocab, scores: list[float]) -> np.ndarray:
    """Every (left, right) token-id pair whose texts concatenate to a vocabulary token, best merge first.

    llama.cpp's ``llm_tokenizer_spm_session`` (like SentencePiece's BPE) repeatedly merges the adjacent pair of
    symbols whose concatenation is a token with the highest score, leftmost on a tie. HF's BPE model does the same
    with an explicit merge list, lowest rank first, leftmost on a tie; so the list holds each split of each token
    into two tokens, ranked by the token's score (higher first), then by token id and split position, which only
    matter between splits of the same token. (One case differs in principle: two *different* splits of the same
    token adjacent at once, as "ab|a|ba" for a token "aba"; llama.cpp merges the leftmost, HF the lower rank.
    Scores are distinct in real vocabularies, so only such same-token splits can tie.) Returns an int32 array of
    shape (n_merges, 2).

    Raises TokenizerError if a token is a character that is not itself a token joined to a token (or to another
    such character): llama.cpp can make that merge, HF's BPE cannot (the character becomes byte tokens first).
    """
    ids = v.ids
    # A character without a token of its own stays one symbol in llama.cpp and may still merge with a neighbour;
    # HF's BPE turns it into byte tokens first. Refuse the (unusual) vocabularies where that could happen.
    def symbol(s: str) -> bool:
        return s in ids or (len(s) == 1 and s != " ")  # a space never reaches the merges: it is "▁" by then

    for t in v.tokens:
        if len(t) > 1 and (
            (t[0] not in ids and t[0] != " " and symbol(t[1:])) or (t[-1] not in ids and t[-1] != " " and symbol(t[:-1]))
        ):
            c = t[0] if t[0] not in ids else t[-1]
            raise TokenizerError(
                f"{v.name}: token {t!r} can be merged from character {c!r}, which is not a token itself; "
                "detinfer cannot reproduce llama.cpp's SentencePiece merges for this vocabulary"
            )
    order: list[tuple[float, int, int]] = []  # (-score, token id, split position)
    long = [(i, t) for i, t in enumerate(v.tokens) if len(t) > 1]
    k = 1
    while long:  # one pass per split position: comprehensions are ~2x faster than a loop per token
        order += [(-scores[i], i, k) for i, t in long if t[:k] in ids and t[k:] in ids]
        k += 1
        long = [(i, t) for i, t in long if len(t) > k]
    order.sort()
    toks = v.tokens
    return np.array([(ids[toks[i][:k]], ids[toks[i][k:]]) for _, i, k in order], dtype=np.int32).reshape(-1, 2)


def _cached_spm_merges(v: _Vocab, scores: list[float], key: str, cache: bool) -> np.ndarray:
    """``_spm_merges``, kept under ``$DETINFER_HOME/index/`` by the sha256 of the tokenizer metadata when ``cache``.

    Computing the merges of a 262k-token vocabulary takes ~1.5 s; loading them back, milliseconds. The file
    (``tokenizer-<key>.spm-merges-v2``) holds the int32 pairs sealed to that key (:func:`detinfer.fileio.seal`):
    one whose seal, length or token ids do not check out is reported (one warning line) and recomputed, never
    used; a cache folder that cannot be written is not an error. Vocabularies under SPM_CACHE_MIN_TOKENS are not
    cached.
    """
    if not cache or len(v.tokens) < SPM_CACHE_MIN_TOKENS:
        return _spm_merges(v, scores)
    path = detinfer_home() / "index" / f"tokenizer-{key}.spm-merges-v{SPM_MERGES_VERSION}"
    source = f"tokenizer {key}"
    try:
        payload = read_sealed_cache(path, source, max_bytes=1 << 30)
        if payload is not None:
            if len(payload) % 8:
                raise DamagedCache(f"cache file {path} does not hold whole (left, right) pairs")
            merges = np.frombuffer(payload, "<i4").reshape(-1, 2).astype(np.int32)
            if merges.size and (merges.min() < 0 or merges.max() >= len(v.tokens)):
                raise DamagedCache(f"cache file {path} names token ids outside the vocabulary")
            return merges
    except DamagedCache as e:
        warn_damaged_cache(str(e), v.name)
    merges = _spm_merges(v, scores)
    write_sealed_cache(path, merges.astype("<i4").tobytes(), source)
    return merges


def _metadata_hash(mf: ModelFile, meta: dict[str, Any]) -> str:
    """sha256 hex of the canonical JSON of the ``tokenizer.ggml.*`` metadata ``meta`` of ``mf``, kept beside the
    file's index (:meth:`ModelFile.derived_cache_path`, sealed to the header key that covers every metadata byte).
    Encoding a 262k-token vocabulary as JSON takes ~80 ms; reading the hash back, microseconds. A kept value whose
    seal does not check out, or that is not a sha256, is reported (one warning line) and recomputed."""
    kept = mf.derived_cache_path("tokenizer-sha256-v2")
    if kept is not None:
        path, source = kept
        try:
            payload = read_sealed_cache(path, source, max_bytes=4096)
            if payload is not None:
                if not re.fullmatch(rb"[0-9a-f]{64}", payload):
                    raise DamagedCache(f"cache file {path} does not hold a sha256")
                return payload.decode("ascii")
        except DamagedCache as e:
            warn_damaged_cache(str(e), mf.path.name)
    key = sha256_bytes(json.dumps(meta, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode("ascii"))
    if kept is not None:
        write_sealed_cache(path, key.encode("ascii"), source)
    return key


def _build_spm(v: _Vocab, key: str, cache: bool) -> _Backend:
    """SentencePiece BPE (``tokenizer.ggml.model = "llama"``) as llama.cpp's ``llm_tokenizer_spm`` runs it.

    Each raw-text fragment (the text between special / user-defined tokens) gets a leading space if
    ``tokenizer.ggml.add_space_prefix`` (default true), has its spaces escaped to "▁", and is merged as one
    piece (no splitting at spaces). A character with no token of its own becomes its UTF-8 bytes as ``<0xXX>``
    tokens. Raises TokenizerError for missing or malformed scores, or a token containing a character that is
    not itself a token (llama.cpp could merge such a character; HF's BPE cannot, so the ids could differ).
    """
    scores = v.meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(v.tokens) or not set(map(type, scores)) <= {float, int}:
        raise TokenizerError(
            f"{v.name}: tokenizer.ggml.scores is missing or not one number per token ({len(v.tokens)}); "
            "a SentencePiece vocabulary needs its scores to rank merges"
        )
    add_space_prefix = v.meta.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(add_space_prefix, bool):
        raise TokenizerError(f"{v.name}: tokenizer.ggml.add_space_prefix = {add_space_prefix!r} is not a boolean")
    merges = _cached_spm_merges(v, scores, key, cache)
    tokens = np.array(v.tokens, dtype=object)  # indexing it picks 10^6 strings in C: twice as fast as map()
    pairs = list(zip(tokens[merges[:, 0]].tolist(), tokens[merges[:, 1]].tolist()))
    unk = _token_id(v, "tokenizer.ggml.unknown_token_id")
    unk_text = v.tokens[unk] if unk is not None else None
    bpe = models.BPE(vocab=v.ids, merges=pairs, byte_fallback=True, unk_token=unk_text, fuse_unk=False)
    hf = tokenizers.Tokenizer(bpe)
    # Normalizers run on each fragment between added tokens, like llama.cpp's per-fragment prefix (it adds one
    # after every special token, "is_prev_special"); HF's Metaspace would skip it before an existing space.
    steps = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    return _Backend(hf, _spm_bytes, True, _spm_byte_token)


# tokenizer.ggml.model → builder(vocabulary, sha256 of the tokenizer metadata, whether it may keep derived files).
_BUILDERS: dict[str, Callable[[_Vocab, str, bool], _Backend]] = {"gpt2": lambda v, key, cache: _build_gpt2(v),
                                                                 "llama": _build_spm}  # fmt: skip


def _read_vocab(mf: ModelFile) -> _Vocab:
    name = mf.path.name
    model = mf.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(f"{name}: tokenizer.ggml.model is missing; the file has no tokenizer")
    if model not in _BUILDERS:
        raise TokenizerError(
            f"{name}: unsupported tokenizer.ggml.model = {model!r}; detinfer supports: {', '.join(sorted(_BUILDERS))}"
        )
    tokens = mf.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or set(map(type, tokens)) != {str}:
        raise TokenizerError(f"{name}: tokenizer.ggml.tokens is missing, empty or not a list of strings")
    ids = {t: i for i, t in enumerate(tokens)}
    if len(ids) != len(tokens):
        first = {t: i for i, t in reversed(list(enumerate(tokens)))}
        i = next(i for i, t in enumerate(tokens) if first[t] != i)
        raise TokenizerError(f"{name}: duplicate token {tokens[i]!r} at ids {first[tokens[i]]} and {i}")
    types = mf.get("tokenizer.ggml.token_type")
    if types is None:
        types = [int(TokenType.NORMAL)] * len(tokens)  # llama.cpp: no types means every token is normal
    elif not isinstance(types, list) or len(types) != len(tokens):
        raise TokenizerError(f"{name}: tokenizer.ggml.token_type does not have one entry per token ({len(tokens)})")
    pre = mf.get("tokenizer.ggml.pre")
    meta = {k: v for k, v in mf.metadata.items() if k.startswith("tokenizer.ggml.")}
    return _Vocab(name, model, pre, tokens, ids, list(types), meta)


def _token_id(v: _Vocab, key: str) -> int | None:
    value = v.meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(v.tokens):
        raise TokenizerError(f"{v.name}: {key} = {value!r} is not a token id below the vocabulary size {len(v.tokens)}")
    return value


def _eog_ids(v: _Vocab, eos_id: int | None) -> frozenset[int]:
    """End-of-generation ids as llama.cpp computes them (llama-vocab.cpp, ``special_eog_ids``).

    Like llama.cpp, forces the tokens found by text to CONTROL in ``v.types``, so they are special when
    encoding.
    """
    keyed = (eos_id, _token_id(v, "tokenizer.ggml.eot_token_id"), _token_id(v, "tokenizer.ggml.eom_token_id"))
    ids = {i for i in keyed if i is not None}
    by_text = {v.ids[t] for t in EOG_TEXTS if t in v.ids}
    for key, texts in FIM_EOG_TEXTS.items():
        fim = _token_id(v, key)
        if fim is not None:
            ids.add(fim)
        elif found := [v.ids[t] for t in texts if t in v.ids]:
            by_text.add(found[0])
    for i in by_text:
        v.types[i] = int(TokenType.CONTROL)
    ids |= by_text
    # llama.cpp's workarounds for vocabularies where <|end|> ends a message (harmony, solar-open) or
    # </s> is ordinary text (gemma4, paddleocr), not the generation.
    texts = {v.tokens[i]: i for i in ids}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        ids.discard(texts["<|end|>"])
        v.types[texts["<|end|>"]] = int(TokenType.USER_DEFINED)
    if "<|tool_response>" in texts and "</s>" in texts:
        ids.discard(texts["</s>"])
        v.types[texts["</s>"]] = int(TokenType.NORMAL)
    return frozenset(ids)


class Tokenizer:
    """Text ↔ token ids for one GGUF model, identical to llama.cpp's ``llama_tokenize`` / ``token_to_piece``.

    Attributes: ``n_vocab``; ``bos_id`` / ``eos_id`` (None if the file has none); ``eog_ids`` (ids that end
    a generation); ``add_bos`` (the model's default for prepending BOS); ``hash`` (sha256 hex of the
    canonical JSON of all ``tokenizer.ggml.*`` metadata, not the chat template); ``special_ids`` (control and
    unknown tokens, and user-defined ones written ``<...>``: never text a grammar can match).
    """

    def __init__(self, *, hf: tokenizers.Tokenizer, tokens: list[str], types: list[int],
                 normal_bytes: Callable[[str], bytes], bos_id: int | None, eos_id: int | None,
                 eog_ids: frozenset[int], add_bos: bool, hash: str,
                 byte_bytes: Callable[[str], bytes] | None = None):  # fmt: skip
        self._hf = hf
        self._tokens = tokens
        self._types = types
        self._normal_bytes = normal_bytes
        self._byte_bytes = byte_bytes
        self._bytes: list[bytes | None] = [None] * len(tokens)
        self._lock = threading.Lock()  # encode_special_tokens is a flag on the shared HF object
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.hash = hash
        self.special_ids = frozenset(
            i for i, t in enumerate(types)
            if t in SPECIAL_TYPES or (t == TokenType.USER_DEFINED and tokens[i].startswith("<") and tokens[i].endswith(">"))
        )  # fmt: skip

    @classmethod
    def from_model(cls, mf: ModelFile) -> Tokenizer:
        """Build the tokenizer of a GGUF file from its ``tokenizer.ggml.*`` metadata.

        ~0.1 s for SmolLM2's 49k-token BPE; ~1 s of CPU for Gemma 3's 262k-token SentencePiece vocabulary once
        its merge table is cached in ``$DETINFER_HOME/index`` (the first build computes it, ~1.5 s more).

        Raises TokenizerError naming the key for an unsupported ``tokenizer.ggml.model``, an unknown
        ``tokenizer.ggml.pre``, missing or malformed tokens / types / merges, duplicate tokens, a special
        token id outside the vocabulary, or ``add_bos_token`` set without a BOS id.
        """
        v = _read_vocab(mf)
        key = _metadata_hash(mf, v.meta)
        backend = _BUILDERS[v.model](v, key, mf.indexed)
        bos_id = _token_id(v, "tokenizer.ggml.bos_token_id")
        eos_id = _token_id(v, "tokenizer.ggml.eos_token_id")
        eog_ids = _eog_ids(v, eos_id)
        add_bos = v.meta.get("tokenizer.ggml.add_bos_token", backend.add_bos_default)
        if not isinstance(add_bos, bool):
            raise TokenizerError(f"{v.name}: tokenizer.ggml.add_bos_token = {add_bos!r} is not a boolean")
        if add_bos and bos_id is None:
            why = "is true" if "tokenizer.ggml.add_bos_token" in v.meta else f"defaults to true for {v.model!r}"
            raise TokenizerError(
                f"{v.name}: tokenizer.ggml.add_bos_token {why} but tokenizer.ggml.bos_token_id is missing; "
                "add the BOS id to the file (gguf_set_metadata.py) or set add_bos_token to false"
            )
        # llama.cpp matches special texts before BPE; CONTROL/UNKNOWN only when parsing special tokens
        # (HF: special=True), USER_DEFINED always (HF: special=False).
        backend.hf.add_tokens(
            [AddedToken(v.tokens[i], special=v.types[i] in SPECIAL_TYPES, normalized=False)
             for i, t in enumerate(v.types) if t != NORMAL and t in VERBATIM_TYPES and v.tokens[i]]
        )  # fmt: skip
        return cls(
            hf=backend.hf, tokens=v.tokens, types=v.types, normal_bytes=backend.normal_bytes, bos_id=bos_id,
            eos_id=eos_id, eog_ids=eog_ids, add_bos=add_bos, hash=key, byte_bytes=backend.byte_bytes,
        )  # fmt: skip

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize(text, add_special, parse_special)``.

        add_bos: prepend ``bos_id``; None uses the model's default (``self.add_bos``), True without a BOS
            token raises TokenizerError.
        parse_special: match control-token texts (``<|im_start|>``...) as those tokens, as needed for a
            rendered chat template; False keeps them plain text, so user input cannot forge them.
        Raises TokenizerError if the text cannot be encoded (e.g. a lone surrogate).
        """
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is None:
            raise TokenizerError("add_bos was requested but this model has no BOS token")
        try:
            with self._lock:
                self._hf.encode_special_tokens = not parse_special
                ids = self._hf.encode(text, add_special_tokens=False).ids
        except Exception as e:  # the Rust side raises plain exceptions (e.g. on unpaired surrogates)
            raise TokenizerError(f"text cannot be tokenized: {e}") from None
        return [self.bos_id, *ids] if add_bos else ids

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of ``token_id`` as stored in the GGUF (byte-level form for BPE tokens)."""
        return self._tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (llama.cpp's ``token_to_piece`` with special=true).

        Normal tokens are byte-level decoded (BPE) or have "▁" turned into a space (SentencePiece); control,
        unknown and user-defined tokens give their UTF-8 text; SentencePiece ``<0xXX>`` byte tokens give that
        byte; unused tokens (and BPE byte-typed ones) give b"". May be part of a UTF-8 character.
        TokenizerError if out of range.
        """
        token_id = self._check_id(token_id)
        cached = self._bytes[token_id]
        if cached is not None:
            return cached
        t = self._types[token_id]
        text = self._tokens[token_id]
        if t == TokenType.NORMAL:
            b = self._normal_bytes(text)
        elif t in VERBATIM_TYPES:
            b = text.encode("utf-8")
        elif t == TokenType.BYTE and self._byte_bytes is not None:
            b = self._byte_bytes(text)
        else:
            b = b""
        self._bytes[token_id] = b
        return b

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a token sequence: the concatenated token bytes as UTF-8, invalid bytes as U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        """A fresh incremental decoder for one generated token stream."""
        return StreamDecoder(self)

    def _check_id(self, token_id: int) -> int:
        """``token_id`` as a Python int (numpy integers accepted); TokenizerError if not an id of this vocabulary."""
        try:
            i = operator.index(token_id)
        except TypeError:
            raise TokenizerError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= i < self.n_vocab:
            raise TokenizerError(f"token id {i} is outside the vocabulary (0..{self.n_vocab - 1})")
        return i


class StreamDecoder:
    """Turns token ids into text as they arrive, holding back the bytes of an incomplete UTF-8 character.

    Invariant: ``"".join(feed(i) for i in ids) + flush() == tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this token (possibly ""). TokenizerError if the id is out of range."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Text of any bytes still held back (U+FFFD for an unfinished character); the decoder is then reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
