"""Thinking models on the APIs: which markers a model thinks between (the
parsers qwen3 and deepseek_r1, or auto from its chat template), what a request
asks of the thinking (on, off, a budget), and the ReasoningParams the engine
keeps the thinking apart from the answer with.

The engine splits the two by token ids and ends the thinking at its budget
(stoker/engine/reasoning.py); everything above it is here: one place that
reads the markers, looks at the rendered prompt and sets the budget, so each
API only translates its own fields. docs/reasoning.md is the user's view.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, get_args

from stoker.engine.params import ReasoningParams

ParserName = Literal["auto", "qwen3", "deepseek_r1", "none"]
PARSERS: tuple[str, ...] = get_args(ParserName)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
ReasoningField = Literal["both", "reasoning_content", "reasoning"]

START_MARKER = "<think>"
END_MARKER = "</think>"

EFFORT_BUDGETS: dict[str, int] = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192}
"""Thinking tokens each reasoning_effort allows (docs/reasoning.md's table); "none" also turns the
template's own switch off (Qwen3's enable_thinking)."""

BLANK_TAIL_TOKENS = 8
"""Most tokens between a marker and the prompt's end that may still be only whitespace
(a template writes "<think>\\n"): a longer tail is text, and the marker is not this reply's."""


@dataclass(frozen=True)
class ReasoningMarkers:
    """How one model marks its thinking, resolved once when the model loads."""

    parser: Literal["qwen3", "deepseek_r1"]
    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]

    @property
    def opens_itself(self) -> bool:
        """deepseek_r1: the reply starts inside the thinking whether or not the
        prompt opened it (R1's older templates do not; the model skips the marker)."""
        return self.parser == "deepseek_r1"


@dataclass(frozen=True)
class ParserChoices:
    """--reasoning-parser: a parser for every model, and per model by name."""

    default: ParserName = "auto"
    per_model: dict[str, ParserName] = field(default_factory=dict)

    def for_model(self, name: str) -> ParserName:
        return self.per_model.get(name, self.default)


def parse_parser_choices(entries: Sequence[str]) -> ParserChoices:
    """PARSER (every model) or NAME=PARSER entries; ValueError naming the bad one."""
    default: ParserName = "auto"
    per_model: dict[str, ParserName] = {}
    for entry in entries:
        name, _, parser = entry.rpartition("=")
        if parser not in PARSERS:
            raise ValueError(f"{entry!r}: the parser must be one of {', '.join(PARSERS)} (as PARSER or NAME=PARSER)")
        if not name and "=" in entry:
            raise ValueError(f"{entry!r}: no model name before '='")
        checked: ParserName = parser  # type: ignore[assignment]  # checked against PARSERS just above
        if name:
            per_model[name] = checked
        else:
            default = checked
    return ParserChoices(default, per_model)


def check_model_names(choices: ParserChoices, names: Sequence[str]) -> None:
    """ValueError for a per-model parser naming no model given at start."""
    unknown = sorted(set(choices.per_model) - set(names))
    if unknown:
        raise ValueError(
            f"--reasoning-parser names {', '.join(unknown)}, which is not a model given at start "
            f"(models: {', '.join(names)})"
        )


def single_token(tokenizer: Any, text: str) -> int | None:
    """The token id that is exactly text, or None where text takes several tokens.
    The vocabulary is asked first: encoding alone may put a word-start marker
    before it (SentencePiece's "▁"), which would hide a token that is there."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        found = hf.convert_tokens_to_ids(text)
        if isinstance(found, int) and found != hf.unk_token_id:
            return found
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def resolve_markers(parser: ParserName, tokenizer: Any, model: str) -> ReasoningMarkers | None:
    """A model's markers under its parser. auto: the markers of a chat template
    that writes them and a tokenizer that holds them as tokens, else none.
    ValueError (one line naming the model and the parser) for a parser that does not fit."""
    if parser == "none":
        return None
    start, end = single_token(tokenizer, START_MARKER), single_token(tokenizer, END_MARKER)
    if parser == "auto":
        template = tokenizer.chat_template
        if (
            start is None
            or end is None
            or not template
            or (START_MARKER not in template and END_MARKER not in template)
        ):
            return None
        probe = ReasoningMarkers("qwen3", (start,), (end,))
        parser = "deepseek_r1" if _template_opens_thinking(probe, tokenizer) else "qwen3"
    missing = [marker for marker, token in ((START_MARKER, start), (END_MARKER, end)) if token is None]
    if missing:
        raise ValueError(
            f"model {model}: --reasoning-parser {parser} does not fit it: {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not a token of its tokenizer (use none, or auto)"
        )
    assert start is not None and end is not None
    return ReasoningMarkers(parser, (start,), (end,))


def _template_opens_thinking(markers: ReasoningMarkers, tokenizer: Any) -> bool:
    """Whether the template's assistant turn opens the thinking itself (DeepSeek-R1's distills)."""
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    except Exception:  # a template that refuses a bare user turn tells nothing either way
        return False
    return prompt_thinking(markers, ids, tokenizer.decode, continued=False) is PromptThinking.OPEN


class PromptThinking(Enum):
    """What the rendered prompt already did about this reply's thinking."""

    UNSAID = "unsaid"  # the reply may open it (or not)
    OPEN = "open"  # the prompt ends inside an opened thinking: the reply starts thinking
    CLOSED = "closed"  # the prompt opened and closed it (thinking off): the reply is all answer


def _last_index(ids: Sequence[int], marker: tuple[int, ...]) -> int:
    """Where marker last starts in ids, or -1 (list searches: a long prompt is scanned in C)."""
    backwards = list(ids)[::-1]
    at = 0
    while True:
        try:
            at = backwards.index(marker[0], at)
        except ValueError:
            return -1
        start = len(backwards) - 1 - at
        if tuple(ids[start : start + len(marker)]) == marker:
            return start
        at += 1


def prompt_thinking(
    markers: ReasoningMarkers, ids: Sequence[int], decode: Callable[[list[int]], str], continued: bool
) -> PromptThinking:
    """Read the prompt's last marker: an opened one with only whitespace after
    it (or a continued final message, whose text is the thinking so far) means
    the reply starts thinking; a closed one with only whitespace after it (or a
    continued answer) means thinking is off for this reply. A marker followed
    by other text belongs to an earlier turn, or to a user's words."""
    start = _last_index(ids, markers.start_token_ids)
    end = _last_index(ids, markers.end_token_ids)
    if start < 0 and end < 0:
        return PromptThinking.UNSAID
    opened = start > end
    after = start + len(markers.start_token_ids) if opened else end + len(markers.end_token_ids)
    tail = list(ids[after:])
    if continued or (len(tail) <= BLANK_TAIL_TOKENS and not decode(tail).strip()):
        return PromptThinking.OPEN if opened else PromptThinking.CLOSED
    return PromptThinking.UNSAID


def reasoning_params(
    markers: ReasoningMarkers | None, thinking: PromptThinking, budget: int | None
) -> ReasoningParams | None:
    """What the engine is told: None where the model does not think or the prompt
    turned the thinking off (the reply is then all answer, as without a parser)."""
    if markers is None or thinking is PromptThinking.CLOSED:
        return None
    return ReasoningParams(
        end_token_ids=markers.end_token_ids,
        start_token_ids=markers.start_token_ids,
        thinking_open=thinking is PromptThinking.OPEN or markers.opens_itself,
        budget=budget,
    )


def request_budget(effort: str | None, budget: int | None, default: int | None) -> int | None:
    """A request's thinking budget: its own reasoning_budget (Anthropic's
    budget_tokens), else its effort's, else the server's --reasoning-budget."""
    if budget is not None:
        return budget
    if effort is not None:
        return EFFORT_BUDGETS[effort]
    return default


def template_switch(effort: str | None, variables: dict[str, Any] | None) -> dict[str, Any]:
    """Template variables a request's effort implies: "none" turns Qwen3's own
    switch off, unless the request set it itself."""
    if effort == "none" and "enable_thinking" not in (variables or {}):
        return {"enable_thinking": False}
    return {}


def check_thinking_fields(effort: str | None, variables: dict[str, Any] | None) -> None:
    """ValueError for thinking fields that do not fit together."""
    switch = (variables or {}).get("enable_thinking")
    if switch is None:
        return
    if not isinstance(switch, bool):
        raise ValueError(f"chat_template_kwargs.enable_thinking must be true or false, got {switch!r}")
    if switch and effort == "none":
        raise ValueError("reasoning_effort none turns thinking off, but chat_template_kwargs.enable_thinking is true")


def reasoning_fields(text: str | None, which: ReasoningField) -> dict[str, str | None]:
    """The thinking as a chat message or delta carries it: reasoning_content
    (vLLM's older name, DeepSeek's), reasoning (vLLM's newer one) or both."""
    names = ("reasoning_content", "reasoning") if which == "both" else (which,)
    return dict.fromkeys(names, text)


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text, so clients that keep
    and send back signed blocks can. It proves nothing (stoker holds no secret
    for it) and is not checked when a block comes back: the client owns its history."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()
