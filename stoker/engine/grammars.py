"""From what an API request asks for to an llguidance grammar string.

The front end builds the grammar (and checks that it compiles, see
stoker/server/structured.py); the engine only runs it. Every constraint kind
becomes one llguidance grammar string, so the engine, its cache and the IPC
message carry a single `str`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from stoker.engine.grammar_compiler import GrammarError

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
"""OpenAI's {"type": "json_object"}: any JSON object."""

_JSON_OPTIONS: dict[str, Any] = {
    # Compact JSON: with flexible whitespace a weak model may emit spaces and
    # newlines until max_tokens and never close the object.
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # An unsupported keyword is an error (a 400 naming it), never silently ignored.
    "lenient": False,
}


def json_schema_grammar(schema: Any) -> str:
    """Output is JSON valid against schema (a dict, or true/false)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]  # a TypedDict in the stub
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def regex_grammar(pattern: str) -> str:
    """Output matches pattern in full (Rust regex syntax, as llguidance parses it)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("a regex must be a non-empty string")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    """Output is exactly one of choices (vLLM's guided_choice)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choices must be a non-empty list of non-empty strings")
    # JSON string syntax is Lark's string-literal syntax too.
    alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")


def text_grammar(text: str) -> str:
    """A context-free grammar: llguidance's Lark dialect, or llama.cpp's GBNF
    (recognised by its `root ::=` rule) converted to it."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("a grammar must be a non-empty string")
    if "::=" in text:
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter raises plain Exceptions on syntax errors
            raise GrammarError(f"GBNF grammar: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def _token_set(ids: Sequence[int]) -> str:
    """Lark's token-id syntax: <[1,3-16]>."""
    ranges: list[list[int]] = []
    for i in sorted(set(ids)):
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return "<[" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) + "]>"


def tagged_calls_grammar(
    call_schema: dict[str, Any],
    *,
    open_tag: str,
    close_tag: str,
    parallel: bool,
    open_token: int | None = None,
    close_token: int | None = None,
    text_tokens: Sequence[int] = (),
) -> str:
    """Free text in which each open_tag starts a call: then one JSON value valid
    against call_schema (compact, optionally between single newlines), then
    close_tag. parallel: any number of calls with text around them; otherwise
    at most one, and the output ends right after its close_tag.

    The text is any valid UTF-8 and may end (eos) anywhere outside a call. It
    is matched by a lazy lexeme that ends at the first open_tag, so a `<` or a
    prefix of the tag in text stays free, however the tokenizer splits it; only
    the complete tag commits to a call. open_token/close_token: the tags' ids
    where the tokenizer has them as added tokens (Qwen's), which llguidance
    sees as special tokens rather than text; both spellings then open and close
    a call. text_tokens: other special tokens that free text may hold, as
    unconstrained output may (Qwen3's <think>, for one).
    """
    schema = {**call_schema, "x-guidance": _JSON_OPTIONS}
    special = f"special: {_token_set(text_tokens)}\n" if text_tokens else ""
    lead = "(TEXT special)* " if text_tokens else ""
    opener = f"{lead}call_open"
    if open_token is not None:
        opener += f" | text {_token_set([open_token])}"
    closer = json.dumps(close_tag)
    if close_token is not None:
        closer = f"({closer} | {_token_set([close_token])})"
    start = "call* text" if parallel else "text | call"
    return llguidance.LLMatcher.grammar_from_lark(
        "%llguidance {}\n"
        f"start: {start}\n"
        f"text: {lead}TEXT\n"
        f"{special}"
        f'call: opener "\\n"? %json {json.dumps(schema)} "\\n"? {closer}\n'
        f"opener: {opener}\n"
        f"call_open[lazy]: TEXT {json.dumps(open_tag)}\n"
        "TEXT: /(?s:.)*/\n"
    )
