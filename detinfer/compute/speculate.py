"""Drafts for speculative decoding: guesses at the next tokens, checked by the model, never changing a byte.

generate() feeds the sampled token and a draft of k guessed tokens through one forward of k + 1 positions. The
engine's logits for a position do not depend on the chunk it is computed in (prefill chunk invariance, proved by
``detinfer selftest``), so each row is the bytes a one-token decode step would give, and each token is still
chosen by the same sampler call at the same position with the same history and constraint state. A draft token is
kept while the sampled token equals it; at the first that differs the cache is truncated past the accepted ones.
Tokens, logits digests, KV and mask digests are those of decoding without a draft at any sampling settings; a
draft only saves forwards when it is right and costs a wider forward when it is not.

The drafter is prompt lookup (A. Saxena, "Prompt Lookup Decoding", 2023,
https://github.com/apoorvumang/prompt-lookup-decoding; llama.cpp's ``lookup`` example): the continuation of the
latest earlier occurrence of the context's last n tokens, longest n first. Agent turns quote tool results, JSON
keys and code from their context, which is where it pays. :class:`DraftPolicy` adapts the draft length to how
often drafts are taken, and pauses drafting after misses, so text with nothing to look up stays at the speed of
plain decoding.
"""

from __future__ import annotations

from ..errors import InputError

SPECULATORS = ("ngram",)  # the drafters --speculate names
NGRAM_MAX = 12  # the longest context suffix looked up: long enough to tell repeated structure apart (JSON items)
K_START, K_MAX = 4, 12  # draft tokens per forward: first try, most (a forward of 13 positions costs ~1.5 decode steps)
PAUSE_MAX = 16  # decode steps without drafting after repeated misses, at most


def check_speculate(speculate: str | None) -> str | None:
    """``speculate`` if it names a drafter (or is None: no speculation); raises InputError otherwise."""
    if speculate is not None and speculate not in SPECULATORS:
        raise InputError(f"unknown --speculate {speculate!r}; use {' or '.join(SPECULATORS)} (or leave it out)")
    return speculate


class NgramDrafter:
    """Prompt lookup over ``tokens``, the live context list (prompt, then every accepted token appended by the
    caller). An index from each n-gram (n = 1..NGRAM_MAX) to the position after its latest occurrence is
    extended lazily, so a draft costs O(tokens appended since the last one)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 1  # n-grams ending before this position are in the index

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens following the latest earlier occurrence of the context's longest matching suffix
        (empty if none of its last NGRAM_MAX suffixes occurred before)."""
        t, after = self.tokens, self._after
        for j in range(self._indexed, len(t)):
            for n in range(1, min(NGRAM_MAX, j) + 1):
                after[tuple(t[j - n : j])] = j
        self._indexed = max(self._indexed, len(t))
        for n in range(min(NGRAM_MAX, len(t)), 0, -1):
            p = after.get(tuple(t[len(t) - n :]))
            if p is not None:
                return t[p : p + k]
        return []


class DraftPolicy:
    """How many tokens to draft next: doubled (up to K_MAX) after a draft taken whole, cut to one more than was
    taken after a partial one; after a draft of which nothing was taken, drafting pauses for 1, 2, 4 ... PAUSE_MAX
    decode steps (reset by the next draft of which anything is taken)."""

    def __init__(self) -> None:
        self.k, self._misses, self._pause = K_START, 0, 0

    def size(self) -> int:
        """Draft tokens to ask for at this step (0 while paused)."""
        if self._pause:
            self._pause -= 1
            return 0
        return self.k

    def taken(self, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            self.k, self._misses = min(2 * self.k, K_MAX), 0
        elif accepted:
            self.k, self._misses = accepted + 1, 0
        else:
            self._misses += 1
            self._pause = min(1 << (self._misses - 1), PAUSE_MAX)
