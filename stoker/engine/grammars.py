"""From what an API request asks for to an llguidance grammar string.

The front end builds the grammar (and checks that it compiles, see
stoker/server/structured.py); the engine only runs it. Every constraint kind
becomes one llguidance grammar string, so the engine, its cache and the IPC
message carry a single `str`.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from stoker.engine.structured import GrammarError

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
