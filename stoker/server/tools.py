"""OpenAI tool calling: tools in the prompt, tool_choice as an output
constraint, and the reply parsed back into tool_calls.

- "none" (the default without tools): plain chat; tools are not shown.
- named function: the reply is constrained to that function's arguments (a
  JSON value of its `parameters` schema) and becomes one call.
- "required": the reply is constrained to {"name": ..., "arguments": ...} with
  name one of the tools and arguments valid for that tool -- a JSON array of
  such calls (at least one) when parallel_tool_calls is true (the default).
- "auto" (the default with tools): the model is shown the tools and asked to
  answer with <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks
  (the Hermes/Qwen convention). Its text is free, but once it has written the
  whole opening tag the block is constrained: a call of one of the tools with
  valid arguments, then the closing tag (and with parallel_tool_calls false,
  nothing after it). Blocks that parse and name a known tool become calls; the
  rest stays content. Where the chat template renders tools in a format of its
  own (Llama 3.1's JSON, ...) the reply stays unconstrained and is parsed the
  same way. A model may still answer in text; required or a named function
  guarantee a call.

Templates that render `tools` themselves (Qwen2.5, Llama 3.1, Hermes ...)
receive them; for others (SmolLM2's ChatML) a system message lists them and
assistant tool_calls in the history are written as <tool_call> blocks.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from stoker.engine.grammar_compiler import GrammarError
from stoker.engine.grammars import json_schema_grammar, tagged_calls_grammar
from stoker.models.tokenizer import Tokenizer
from stoker.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool, bad_request
from stoker.server.structured import Constraint

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str
    """none | auto | required | named"""
    tools: list[Tool]
    parallel: bool
    named: str | None = None
    constraint: Constraint | None = None

    @property
    def active(self) -> bool:
        """The reply may hold tool calls (and is parsed for them)."""
        return self.mode != "none" and bool(self.tools)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def uses_call_tags(template: str | None) -> bool:
    """The model is asked for <tool_call> blocks: by stoker's own note (a template
    without tool support) or by a template that renders them (Qwen, Hermes)."""
    return template is None or "tools" not in template or CALL_OPEN in template


def plan_tools(body: ChatCompletionRequest, other_constraint: Constraint | None, tokenizer: Tokenizer) -> ToolPlan:
    """What tool_choice asks for; 400 for an unknown function or a clash."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names function {choice.function.name!r}, which is not in tools"
                f" ({', '.join(names) or 'none given'})",
                param="tool_choice",
            )
        plan = ToolPlan("named", tools, parallel, named=choice.function.name)
    elif choice == "required" and not tools:
        raise bad_request('tool_choice "required" needs at least one tool in tools', param="tool_choice")
    else:
        plan = ToolPlan(choice, tools, parallel)
    if plan.mode in ("named", "required"):
        if other_constraint is not None:
            raise bad_request(
                f"tool_choice {plan.mode!r} constrains the reply to a call; it cannot be combined with "
                f"{other_constraint.param}",
                param="tool_choice",
            )
        try:
            plan.constraint = Constraint(json_schema_grammar(_call_schema(plan)), "tools")
        except GrammarError as exc:
            raise bad_request(f"tools: {exc}", param="tools") from None
    elif plan.active and other_constraint is None and uses_call_tags(tokenizer.chat_template):
        # A bad tool schema surfaces when the front end compiles this: a 400 on "tools".
        plan.constraint = Constraint(_auto_grammar(plan, tokenizer), "tools", embeds_schemas=True)
    return plan


def _auto_grammar(plan: ToolPlan, tokenizer: Tokenizer) -> str:
    added = tokenizer.hf.get_added_vocab()
    open_token, close_token = added.get(CALL_OPEN), added.get(CALL_CLOSE)
    structural = {*tokenizer.eos_token_ids, open_token, close_token}
    return tagged_calls_grammar(
        _one_call_schema(plan.tools),
        open_tag=CALL_OPEN,
        close_tag=CALL_CLOSE,
        parallel=plan.parallel,
        open_token=open_token,
        close_token=close_token,
        text_tokens=sorted(i for i in added.values() if i not in structural),
    )


def _one_call_schema(tools: list[Tool]) -> dict[str, Any]:
    """{"name": <one of tools>, "arguments": <valid for that tool>}."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _call_schema(plan: ToolPlan) -> dict[str, Any]:
    if plan.mode == "named":
        return _parameters(next(t for t in plan.tools if t.function.name == plan.named))
    call = _one_call_schema(plan.tools)
    return {"type": "array", "items": call, "minItems": 1} if plan.parallel else call


def _call_block(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def prepare_messages(
    messages: list[dict[str, Any]], plan: ToolPlan, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and extra template arguments that show the model its tools and the
    history's calls, whether or not the chat template knows about tools."""
    if template is not None and "tools" in template:
        kwargs = {"tools": [t.model_dump(exclude_none=True) for t in plan.tools]} if plan.active else {}
        return messages, kwargs
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            try:
                blocks = [_call_block(c["function"]["name"], c["function"].get("arguments")) for c in calls]
            except (KeyError, TypeError, AttributeError):
                raise bad_request(
                    f"messages[{i}].tool_calls must be a list of {{'id', 'type': 'function', "
                    "'function': {'name', 'arguments'}}} objects",
                    param="messages",
                ) from None
            text = "\n".join(filter(None, [m.get("content") or "", *blocks]))
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        out.append(m)
    if plan.active:
        listing = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in plan.tools)
        note = (
            "You can call these functions:\n"
            f"{listing}\n"
            f'To call one, answer with {CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}'
            f"{CALL_CLOSE}; otherwise answer normally."
        )
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, {}


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
    }


def parse_reply(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished reply. Text that does not parse (a
    reply cut by max_tokens) stays content, with no calls."""
    if not plan.active:
        return text, []
    if plan.mode == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [new_call(plan.named or "", text)]
    if plan.mode == "required":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        items = value if isinstance(value, list) else [value]
        try:
            return None, [new_call(c["name"], c["arguments"]) for c in items]
        except (KeyError, TypeError):  # cut short by a stop string: not a call
            return text, []
    known = {t.function.name for t in plan.tools}
    calls: list[dict[str, Any]] = []
    rest = text
    for block in _CALL_BLOCK.finditer(text):
        try:
            value = json.loads(block.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and value.get("name") in known and isinstance(value.get("arguments", {}), dict):
            calls.append(new_call(value["name"], value.get("arguments", {})))
            rest = rest.replace(block.group(0), "", 1)
    if not calls:
        return text, []
    rest = rest.strip()
    return (rest or None), calls
