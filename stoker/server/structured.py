"""Structured output in the front end: which constraint a request asks for,
as one grammar string, checked to compile before the request reaches the engine.

The request's fields (OpenAI's response_format, vLLM's guided_* and
structured_outputs, tool_choice through stoker/server/tools.py) become an
llguidance grammar (stoker/engine/grammars.py). It is compiled here once, in a
worker thread, bounded by size and time, so a bad or pathological grammar is a
400 naming the problem and never reaches, let alone stalls, the engine. The
engine compiles it again from its own cache (the server and the engine are
separate processes).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from stoker.engine.grammar_compiler import GrammarCompiler, GrammarError
from stoker.engine.grammars import (
    JSON_OBJECT_SCHEMA,
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
    text_grammar,
)
from stoker.models.tokenizer import Tokenizer
from stoker.server.protocol import SamplingFields, bad_request


@dataclass
class Constraint:
    grammar: str
    param: str
    """The request field it came from, for error messages."""
    embeds_schemas: bool = False
    """A Lark grammar stoker wrote around the request's JSON schemas (auto tool
    calls): a compile error is reported as the schema problem alone, without
    the lines of a grammar the client never wrote."""


_SCHEMA_ERROR = "failed to compile JSON schema: "


def _compile_error(constraint: Constraint, error: GrammarError) -> str:
    message = str(error)
    if constraint.embeds_schemas and _SCHEMA_ERROR in message:
        message = message.split(_SCHEMA_ERROR, 1)[1].split("\n", 1)[0]
    return message


def _json_schema(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{param} is not valid JSON: {exc}") from None
    return json_schema_grammar(value)


def requested_constraint(body: SamplingFields) -> Constraint | None:
    """The one constraint the request's own fields ask for (tools aside); 400
    if it names several or one does not build."""
    found: list[tuple[str, Any]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", lambda: json_schema_grammar(JSON_OBJECT_SCHEMA)))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        schema = rf.json_schema.schema_
        found.append(("response_format", lambda: json_schema_grammar(schema if schema is not None else {})))
    if body.guided_json is not None:
        found.append(("guided_json", lambda: _json_schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", lambda: regex_grammar(body.guided_regex or "")))
    if body.guided_choice is not None:
        found.append(("guided_choice", lambda: choice_grammar(body.guided_choice or [])))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", lambda: text_grammar(body.guided_grammar or "")))
    so = body.structured_outputs
    if so is not None:
        kinds = [
            (name, build)
            for name, value, build in (
                ("json", so.json_, lambda: _json_schema(so.json_, "structured_outputs.json")),
                ("regex", so.regex, lambda: regex_grammar(so.regex or "")),
                ("choice", so.choice, lambda: choice_grammar(so.choice or [])),
                ("grammar", so.grammar, lambda: text_grammar(so.grammar or "")),
                ("json_object", so.json_object or None, lambda: json_schema_grammar(JSON_OBJECT_SCHEMA)),
            )
            if value is not None
        ]
        if len(kinds) != 1:
            raise bad_request("structured_outputs must set exactly one of json, regex, choice, grammar, json_object")
        found.append((f"structured_outputs.{kinds[0][0]}", kinds[0][1]))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one output constraint may be given, got {', '.join(p for p, _ in found)}")
    param, build = found[0]
    try:
        return Constraint(build(), param)
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None


@dataclass
class GrammarChecker:
    """Compiles each new grammar once (LRU-cached) against the served tokenizer."""

    tokenizer: Tokenizer
    max_bytes: int
    timeout_s: float
    _compiler: GrammarCompiler | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    compile_seconds: list[float] = field(default_factory=list)
    """Compiles since last drained (metrics read them)."""

    async def check(self, constraint: Constraint) -> None:
        """400 naming the field when the grammar is too big, fails to compile, or
        takes longer than the timeout to compile."""
        param = constraint.param
        if len(constraint.grammar) > self.max_bytes:
            raise bad_request(
                f"{param}: the constraint is {len(constraint.grammar)} bytes as a grammar; "
                f"this server accepts at most {self.max_bytes} (--max-grammar-bytes)",
                param=param,
            )
        async with self._lock:  # the wrapped tokenizer is built once (~0.4 s), by the first caller
            if self._compiler is None:
                self._compiler = await asyncio.to_thread(
                    GrammarCompiler, self.tokenizer.hf, self.tokenizer.vocab_size, self.tokenizer.eos_token_ids
                )
        compiler = self._compiler
        started = time.perf_counter()
        try:
            # The compile drops the GIL: a slow one blocks neither the event loop nor the engine.
            await asyncio.wait_for(asyncio.to_thread(compiler.compile, constraint.grammar), self.timeout_s)
        except GrammarError as exc:
            raise bad_request(f"{param}: {_compile_error(constraint, exc)}", param=param) from None
        except TimeoutError:
            raise bad_request(
                f"{param}: the constraint took longer than {self.timeout_s:g} s to compile; simplify it",
                param=param,
            ) from None
        self.compile_seconds.append(time.perf_counter() - started)
