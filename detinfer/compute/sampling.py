"""The one sampling schema: :class:`SamplingParams` (what the sampler reads) and :class:`Sampling` (those plus when to
stop), with :class:`SamplingOverrides` for partial settings. Invalid values raise InputError naming the option,
never clamped; the sampler's exact arithmetic is in sampler.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
)
from typing_extensions import Self

from ..errors import InputError
from ..fileio import utf8_error

U64 = 2**64


class SamplingParams(BaseModel):
    """Sampling parameters; invalid values raise InputError naming the parameter (never clamped).

    temperature: >= 0, 0 = greedy. top_k: >= 0, 0 = off. top_p: in (0, 1], 1 = off. min_p: in [0, 1), 0 = off.
    repetition_penalty: > 0, 1 = off. repeat_last_n: >= 0, how many of the most recent history tokens the
    penalty looks at (0 = none). seed: 0 <= seed < 2**64, keys the counter-based RNG with the position.
    NaN and infinities are rejected; values are strict (no bools, no numeric strings; ints pass for floats).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, lt=2**63)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, lt=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    repeat_last_n: int = Field(64, ge=0, lt=2**63)
    seed: int = Field(0, ge=0, lt=U64)

    @classmethod
    def create(cls, spelling: Mapping[str, str] | None = None, /, **kw: Any) -> Self:
        """Build from user-given values (options, a request, a script); raises InputError naming the bad option(s)
        and value(s), each as ``spelling`` (positional: a keyword is a sampling option) spells it if it does (a CLI's
        flag), else as "sampling parameter" and its field name. Records are read with ``model_validate`` (pydantic's ValidationError, with its location)."""
        try:
            return cls(**kw)
        except ValidationError as e:
            raise _input_error(e, spelling or {}) from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampling(SamplingParams):
    """Every option that decides a generation's tokens besides the prompt, the model and a constraint: the
    sampler's parameters (:class:`SamplingParams`) plus when to stop. The one sampling schema: the Python API's
    keyword options, ``detinfer run``'s options, batch lines, session scripts (as :class:`SamplingOverrides`),
    every record's ``sampling`` section, and what the server maps OpenAI request fields onto. Unset fields take
    ``detinfer run``'s defaults. Invalid values raise InputError naming the option (never clamped).

    max_tokens: new tokens, 1 <= n < 2**31 (generation also stops at the end of the context); stop: strings
    (valid UTF-8) the output stops before, never emitting them (empty ones are ignored; a string is one stop);
    ignore_eos: keep generating past end-of-generation tokens.
    """

    max_tokens: int = Field(128, ge=1, lt=2**31)
    stop: list[str] = []
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else list(value) if isinstance(value, tuple) else value

    @field_validator("stop")
    @classmethod
    def _utf8(cls, value: list[str]) -> list[str]:
        for i, s in enumerate(value):
            if (bad := utf8_error(s)) is not None:
                raise ValueError(f"stop string {i} is not valid UTF-8: {bad}")
        return value


def missing_fields(data: Any) -> list[str]:
    """The :class:`Sampling` fields a record's ``sampling`` mapping lacks: a record states every option."""
    return [k for k in Sampling.model_fields if k not in data] if isinstance(data, dict) else []


def _overrides_model() -> type[BaseModel]:
    """SamplingOverrides: every field of Sampling, optional and unset by default (checked when applied)."""
    fields = {name: (Optional[f.annotation], None) for name, f in Sampling.model_fields.items()}
    return create_model("SamplingOverrides", __config__=ConfigDict(frozen=True, extra="forbid", strict=True), **fields)


SamplingOverrides = _overrides_model()
SamplingOverrides.__doc__ = """A partial :class:`Sampling` (a session script's defaults or one turn's): only the fields it sets count."""


def apply_overrides(base: Sampling, *overrides: BaseModel | None) -> Sampling:
    """``base`` with the fields set by each of ``overrides`` (SamplingOverrides or None) in turn; InputError for a
    value Sampling refuses."""
    merged = base.model_dump()
    for o in overrides:
        if o is not None:
            merged.update(o.model_dump(exclude_none=True))
    return Sampling.create(**merged)


# llama.cpp's and HF's spellings of an option, for the message that names detinfer's
_OTHER_SPELLINGS = {"repeat_penalty": "repetition_penalty", "n_predict": "max_tokens", "max_new_tokens": "max_tokens"}


def _input_error(e: ValidationError, spelling: Mapping[str, str]) -> InputError:
    """One line for a ValidationError: 'invalid sampling parameter top_p=1.5: must be ...' ('--top-p 1.5: must
    be ...' where ``spelling`` names the field's flag)."""
    parts = []
    for err in e.errors():
        name = ".".join(str(x) for x in err["loc"]) or "?"
        if err["type"] == "extra_forbidden":
            known = ", ".join(Sampling.model_fields)
            hint = f"; detinfer spells it {_OTHER_SPELLINGS[name]}" if name in _OTHER_SPELLINGS else f" (known: {known})"
            parts.append(f"unknown sampling option {name!r}={err['input']!r}{hint}")
            continue
        why = err["msg"].replace("Input should be", "must be", 1)
        if err["type"] == "less_than" and isinstance(err["input"], int) and isinstance(err["ctx"]["lt"], int):
            why = f"must be at most {err['ctx']['lt'] - 1}"  # "2147483648: must be less than 2147483648" read oddly
        flag = spelling.get(str(err["loc"][0])) if err["loc"] else None
        parts.append(f"{flag} {err['input']!r}: {why}" if flag else f"invalid sampling parameter {name}={err['input']!r}: {why}")
    return InputError("; ".join(parts))
