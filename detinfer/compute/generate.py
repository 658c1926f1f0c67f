"""Generation as a stream of steps: sample, append, decode text safely, stop.

Each step yields the token, its text delta (never a partial UTF-8 character, never part of a stop string),
the chained digest of the logits it was sampled from, and the stop reason on the last step. The CLI, the
manifest writer and (later) sessions and the server all consume this one stream.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ..errors import InputError
from .constrain import Constraint, Guide, check_ignore_eos
from .engine import DEFAULT_CHUNK, Engine
from .kvcache import KVCache
from .prefix_cache import PrefixCache
from .sampler import log_softmax_at, sample, top_logits
from .sampling import Sampling
from .speculate import DraftPolicy, NgramDrafter, check_speculate

DIGEST_SEED = hashlib.sha256(b"detinfer-logits/1").hexdigest()
# "stop_cut": a stop string cut a constrained output before its grammar ended it (with an end-of-generation token),
# so the text may not parse; "stop" is kept for an unconstrained one.
STOP_REASONS = ("eos", "stop", "stop_cut", "max_tokens", "length")
# OpenAI's finish_reason for each stop reason (an end-of-generation token or a stop string is "stop"). A constrained
# output cut by a stop string is "length", OpenAI's word for an output cut short: structured-output clients then
# treat it as incomplete (openai's parse() raises LengthFinishReasonError) instead of parsing a cut JSON.
OPENAI_FINISH_REASON = {"eos": "stop", "stop": "stop", "stop_cut": "length", "max_tokens": "length", "length": "length"}


def chain_digest(previous: str, logits: np.ndarray) -> str:
    """Next link of the logits digest chain: sha256(previous digest bytes || float32 little-endian logits)."""
    return hashlib.sha256(bytes.fromhex(previous) + np.ascontiguousarray(logits, dtype="<f4").tobytes()).hexdigest()


@dataclass(frozen=True)
class Step:
    """One generated token. ``token`` is None only for a final step that stops before sampling (context full)."""

    index: int
    position: int
    token: int | None
    text: str
    digest: str
    top: list[tuple[int, float]]
    stop_reason: str | None = None
    # Only with generate(..., logprobs_k=k): log-softmax of the raw logits (sampler.log_softmax_at) at the sampled
    # token, and the k highest (id, logprob) in top_logits order (highest first, ties by lowest id).
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    mask_digest: str | None = None  # only with a constraint: the mask digest chain at this step


@dataclass
class Timings:
    """Wall-clock seconds; recorded in manifests but never compared."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    decode_tokens: int = 0

    def rates(self) -> dict[str, float]:
        return {
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "prefill_tok_s": round(self.prompt_tokens / self.prefill_s, 2) if self.prefill_s else 0.0,
            "decode_tok_s": round(self.decode_tokens / self.decode_s, 2) if self.decode_s else 0.0,
        }


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str | None = None
    digests: list[str] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # only with logprobs_k
    mask_digests: list[str] = field(default_factory=list)  # only with a constraint
    kv_sha256: str = ""
    reused_tokens: int = 0
    draft_tokens: int = 0  # with speculate: tokens drafted, and of them sampled as drafted
    accepted_tokens: int = 0
    timings: Timings = field(default_factory=Timings)


class _StopMatcher:
    """Holds back text that could still become a stop string; finds the first completed one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # all decoded text so far
        self.emitted = 0

    def push(self, delta: str) -> tuple[str, bool]:
        """Add decoded text; return (text now safe to emit, whether a stop string completed)."""
        self.text += delta
        start = max(0, self.emitted - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end, done = min(hits), True
        else:
            hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end, done = len(self.text) - hold, False
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, done

    def finish(self) -> str:
        """Text held back at the end (it never completed a stop string)."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


def check_prompt(engine: Engine, tokens: Sequence[int]) -> None:
    """Raise InputError for an empty prompt or one longer than the context (n_ctx)."""
    if len(tokens) == 0:
        raise InputError("the prompt is empty; pass some text with --prompt, --prompt-file or --messages")
    if len(tokens) > engine.n_ctx:
        raise InputError(
            f"the prompt has {len(tokens)} tokens but the context holds {engine.n_ctx}; shorten it or raise --ctx "
            f"(this model allows up to {engine.config.n_ctx_train})"
        )


def generate(
    engine: Engine,
    prompt_tokens: Sequence[int],
    sampling: Sampling,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    cache: KVCache | None = None,
    result: GenerationResult | None = None,
    logprobs_k: int | None = None,
    constraint: Constraint | None = None,
    prefix_cache: PrefixCache | None = None,
    speculate: str | None = None,
) -> Iterator[Step]:
    """Prefill ``prompt_tokens`` and generate up to ``sampling.max_tokens`` tokens, yielding one Step per token:
    a :class:`Decoding` whose forwards run one at a time (see it for every option and error; ``chunk_size`` splits
    the prefill and never changes a result). A consumer that stops early leaves the cache as it was at that step."""
    d = Decoding(engine, prompt_tokens, sampling, cache=cache, result=result, logprobs_k=logprobs_k, constraint=constraint,
                 prefix_cache=prefix_cache, speculate=speculate)  # fmt: skip
    try:
        while not d.done:
            if (need := d.need()) is not None:
                tokens, all_logits = need
                d.put(engine.forward(tokens, d.cache, all_logits=all_logits, chunk_size=chunk_size))
            else:
                yield d.step()
    finally:
        d.close()


class Decoding:
    """One generation as a state machine whose forwards its caller runs: :meth:`need` names the tokens the next
    forward must run on :attr:`cache` (None: a step can be sampled now), :meth:`put` takes that forward's logits,
    :meth:`step` samples the next Step. :func:`generate` runs the forwards one at a time; the server's decode
    worker runs those of several decodings in one ``Engine.forward_batch`` step. Either way the Steps, digests and
    KV are the same bytes.

    Prefills ``prompt_tokens`` (``prefill_chunk`` tokens per forward at most; None: all at once) and generates up
    to ``sampling.max_tokens`` tokens. ``cache`` (optional) may already hold a prefix of the prompt: only the rest
    is computed (see :meth:`KVCache.keep_prefix`), with the same bytes as a cold run. With ``prefix_cache``, a
    longer prefix known there (another conversation's, an earlier branch's) is restored first, and the finished
    generation's cache is stored there (not that of a generation closed early).

    Stops at an end-of-generation token (not emitted as text; unless ``sampling.ignore_eos``), a stop string (its
    text is never emitted; stop reason "stop", or "stop_cut" with a constraint: see STOP_REASONS),
    ``sampling.max_tokens``, or the end of the context (stop reason "length": a token at position p needs
    p < n_ctx). ``result`` (optional) is filled in as the decoding advances, with the final KV digest at the end.
    ``logprobs_k`` (optional, 0..n_vocab; default off, costing nothing) adds to each sampled Step, and to
    ``result.logprobs``, the logprob of the sampled token and the ``logprobs_k`` most likely tokens under the raw
    logits (see Step). ``constraint`` (optional): before each sampled token, the tokens its grammar does not allow
    next get -inf logits (constrain.Guide); end-of-generation tokens are allowed only where the grammar accepts.
    Digests, top logits and logprobs stay those of the raw logits; each step's mask digest goes to
    ``Step.mask_digest`` and ``result.mask_digests``. ``speculate="ngram"`` drafts tokens by prompt lookup and checks
    them in one forward (compute.speculate): the same Steps, digests and KV, in fewer forwards where the text repeats
    its context (counts in ``result.draft_tokens`` / ``accepted_tokens``); a cache with recurrent state marks its
    state before each draft window and, on a rejection, goes back there and runs the accepted tokens again in the
    next forward (so the last Step may come one forward before :attr:`done`). Raises InputError for an empty or
    too-long prompt or an unknown ``speculate``; ConstraintError for a constraint that does not compile, with
    ``ignore_eos`` (the grammar ends with an end token), or that can no longer be completed.
    """

    def __init__(self, engine: Engine, prompt_tokens: Sequence[int], sampling: Sampling, *, cache: KVCache | None = None,
                 result: GenerationResult | None = None, logprobs_k: int | None = None, constraint: Constraint | None = None,
                 prefix_cache: PrefixCache | None = None, speculate: str | None = None, prefill_chunk: int | None = None):  # fmt: skip
        check_prompt(engine, prompt_tokens)
        if not isinstance(sampling, Sampling):
            raise InputError(f"sampling must be a Sampling, got {type(sampling).__name__}")
        if logprobs_k is not None and (isinstance(logprobs_k, bool) or not isinstance(logprobs_k, int) or logprobs_k < 0):
            raise InputError(f"logprobs_k must be an int >= 0 or None, got {logprobs_k!r}")
        check_ignore_eos(constraint, sampling.ignore_eos)
        check_speculate(speculate)
        self.engine, self.sampling, self.logprobs_k, self.prefix_cache = engine, sampling, logprobs_k, prefix_cache
        self.guide = Guide(constraint, engine.tokenizer) if constraint is not None else None
        self.result = res = result if result is not None else GenerationResult()
        self.cache = cache = cache if cache is not None else engine.new_cache()
        if prefix_cache is not None:
            prefix_cache.restore_longest(cache, prompt_tokens)
        reused = cache.keep_prefix(prompt_tokens)
        res.reused_tokens, res.timings.prompt_tokens = reused, len(prompt_tokens) - reused
        self.history = list(prompt_tokens)
        self._prefill = self.history[reused:]  # prompt tokens still to run
        self._prefill_chunk = prefill_chunk or len(self._prefill)
        self._decoder = engine.tokenizer.stream_decoder()
        self._matcher = _StopMatcher(sampling.stop)
        self._eog = frozenset() if sampling.ignore_eos else engine.tokenizer.eog_ids
        self._digest = DIGEST_SEED
        self._t0 = time.perf_counter()
        self._index = 0
        self._logits: np.ndarray | None = None  # what the next token is sampled from, once computed
        self._pending: tuple[list[int], bool] | None = None  # the decode forward the next token waits for
        self._drafter = NgramDrafter(self.history) if speculate else None
        self._policy = DraftPolicy()
        self._ahead: list[int] = []  # draft tokens in the cache past the accepted ones; rows[i]: the logits after ahead[i]
        self._rows: list[np.ndarray] = []
        self._drafted = 0  # the length of the last draft
        self._held = cache.n_tokens  # the positions a cache without drafts would hold now
        self._redo = 0  # leading tokens of the pending forward run again after a recurrent state's rollback
        self._final: Step | None = None  # the last Step, returned, whose cache still waits for that forward
        self.done = False

    def need(self) -> tuple[list[int], bool] | None:
        """(tokens, all_logits) the next forward must run on :attr:`cache`, or None if :meth:`step` can sample now
        (or the decoding is done)."""
        if self.done or self._logits is not None:
            return None
        if self._prefill:
            return self._prefill[: self._prefill_chunk], False
        return self._pending

    def put(self, logits: np.ndarray) -> None:
        """The logits of the forward :meth:`need` asked for ([n_vocab], or [n, n_vocab] with all_logits)."""
        if self._prefill:
            del self._prefill[: self._prefill_chunk]
            self._held = self.cache.n_tokens
            if self._prefill:
                return
            self.cache.checkpoint()  # a recurrent state at the prompt's end: where the next turn or a branch resumes
            self.result.timings.prefill_s = time.perf_counter() - self._t0
            self._t0 = time.perf_counter()
            self._logits = logits
        elif self._pending[1]:
            self._logits, self._rows = logits[self._redo], list(logits[self._redo + 1 :])
        else:
            self._logits = logits
        self._pending = None
        if self._final is not None:
            self._finish(self._final)

    def step(self) -> Step:
        """Sample the next token from the logits :meth:`put` gave (or a draft's, already computed) and return its
        Step; the last Step has a stop reason and sets :attr:`done`. Raises ConstraintError (a constraint that can no
        longer be completed)."""
        engine, cache, res, guide, logits = self.engine, self.cache, self.result, self.guide, self._logits
        index = self._index
        position = self._held = cache.n_tokens - len(self._ahead)
        if position >= engine.n_ctx:
            return self._finish(Step(index, position, None, self._matcher.finish(), self._digest, [], "length"))
        mdigest = None
        if guide is not None:
            token = sample(guide.mask(logits), self.sampling, position, self.history)
            mdigest = guide.digest
            res.mask_digests.append(mdigest)
        else:
            token = sample(logits, self.sampling, position, self.history)
        self._digest = digest = chain_digest(self._digest, logits)
        top = top_logits(logits, 5)
        lp, top_lp = None, None
        if (k := self.logprobs_k) is not None:
            ranked = top if k <= len(top) else top_logits(logits, k)
            ids = [token] + [i for i, _ in ranked[:k]]
            values = log_softmax_at(logits, ids)
            lp, top_lp = values[0], list(zip(ids[1:], values[1:]))
            res.logprobs.append((lp, top_lp))
        res.tokens.append(token)
        res.digests.append(digest)
        res.top.append(top)
        self.history.append(token)
        if token in self._eog:
            reason, text = "eos", self._matcher.finish()
        else:
            if guide is not None:
                guide.consume(token)
            text, hit = self._matcher.push(self._decoder.feed(token))
            stop_hit = "stop" if guide is None else "stop_cut"
            reason = stop_hit if hit else "max_tokens" if index + 1 >= self.sampling.max_tokens else "length" if position + 1 >= engine.n_ctx else None
            if reason in ("max_tokens", "length"):
                text += self._matcher.finish()
        res.text += text
        step = Step(index, position, token, text, digest, top, reason, lp, top_lp, mdigest)
        if reason is not None:
            res.timings.decode_tokens = index
            if redo := self._rollback(position):  # the cache ends as plain decoding leaves it: after one more forward
                self._final, self._logits, self._pending, self._redo = step, None, (redo, False), 0
                return step
            return self._finish(step)
        self._index += 1
        self._next(token, position)
        return step

    def _next(self, token: int, position: int) -> None:
        """After sampling ``token`` at ``position``: the logits of the next step are a taken draft's, or the next
        forward runs the token (and a new draft after it)."""
        ahead = self._ahead
        if ahead and ahead[0] == token:  # the draft was right: its logits are already computed
            ahead.pop(0)
            self._logits = self._rows.pop(0)
            self.result.accepted_tokens += 1
            return
        self._logits = None
        if self._drafter is None:
            self._pending = [token], False
            return
        if self._drafted:
            self._policy.taken(self._drafted, self._drafted - len(ahead))
        redo = self._rollback(position) if ahead else []  # drop the first draft token that differs, and those after it
        fits = min(self.sampling.max_tokens - self._index - 1, self.engine.n_ctx - position - 2)  # drafts whose rows are sampled from
        draft = self._drafter.draft(min(self._policy.size(), fits)) if fits > 0 else []
        if draft and self.cache.marked != self.cache.n_tokens:
            self.cache.mark()  # a recurrent state at the window's start, where a rejection goes back to
        self._ahead, self._rows, self._drafted = draft, [], len(draft)
        self._pending, self._redo = ([*redo, token, *draft], bool(draft)), len(redo)
        self.result.draft_tokens += len(draft)

    def _rollback(self, position: int) -> list[int]:
        """Drop what the cache holds past ``position``: truncated for attention layers; for a recurrent state, back
        to the draft window's mark, returning the tokens from there to ``position``, which the next forward runs
        again (the same bytes as never having drafted)."""
        cache = self.cache
        if cache.n_tokens <= position:
            return []
        if cache.truncatable:
            cache.truncate(position)
            return []
        start = cache.marked
        redo = cache.tokens[start:position]
        cache.truncate(start)
        return redo

    def _finish(self, step: Step) -> Step:
        res = self.result
        res.stop_reason = step.stop_reason
        res.timings.decode_s = time.perf_counter() - self._t0
        res.kv_sha256 = self.cache.digest()
        self.cache.checkpoint()  # a recurrent state at the turn's end: where the next turn diverging from it resumes
        if self.prefix_cache is not None:
            self.prefix_cache.store(self.cache)
        self.done = True
        return step

    def close(self) -> None:
        """Leave the cache as decoding without drafts would at the last Step returned (for a caller that stops
        early; a no-op once done): a cache with recurrent state may instead go back to the last draft window's start,
        a shorter exact prefix."""
        if not self.done:
            self._rollback(self._held)
        self.done = True
