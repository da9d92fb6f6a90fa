"""tool_choice "auto" with a constrained call body, in the engine on a tiny
random-weight model: free text stays free, and once the model has written the
whole <tool_call> tag the block is a valid call of one of the tools.

A random model never spells <tool_call> by chance, so the model here is
rewired into a bigram model (its layers add nothing; the next token depends on
the last one) that, after `<`, spells `tool_call>` and then random junk; a
logit_bias on `<` makes it open blocks often. Everything after the tag is the
random model's doing, so every valid block is the constraint's.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
from pathlib import Path

import jsonschema_rs
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.config import default_model_path
from stoker.engine.params import CompletionOutput, FinishReason
from stoker.engine.structured import banned_tokens, next_token_bitmask
from stoker.models.loader import load_tokenizer
from stoker.models.tokenizer import Tokenizer
from stoker.server.protocol import ChatCompletionRequest
from stoker.server.tools import CALL_CLOSE, CALL_OPEN, ToolPlan, parse_reply, plan_tools

pytestmark = pytest.mark.timeout(120)

# Bounded, so a random model closes every value within a few tokens.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
OPEN_BIAS = 8.0
"""On `<`: about one token in twenty opens a block."""
SEEDS = range(16)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> LLM:
    return tag_spelling_llm(tmp_path_factory.mktemp("tool-auto"), tokenizer)


def tag_spelling_llm(tmp: Path, tokenizer: Tokenizer) -> LLM:
    """A tiny random model rewired so that `<` is followed by `tool_call>`."""
    folder = make_tiny_hf_model("llama", tmp)
    (path,) = folder.glob("*.safetensors")
    weights = load_file(path)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()  # the residual stream is the last token's embedding
    chain = tokenizer.encode(CALL_OPEN, add_special_tokens=False)  # <, tool, _, call, >
    assert len(chain) > 1  # the default tokenizer splits the tag: the lazy-lexeme path
    norm, head, embed = weights["model.norm.weight"], weights["lm_head.weight"], weights["model.embed_tokens.weight"]
    for a, b in itertools.pairwise(chain):
        e = embed[a]
        hidden = e / torch.sqrt(e.pow(2).mean() + 1e-6) * norm
        head[b] += 40.0 * hidden / hidden.pow(2).sum()  # +40 on b's logit after a
    save_file(weights, path, metadata={"format": "pt"})
    return LLM(str(folder), dtype="float32", num_kv_blocks=256, block_size=16, max_num_batched_tokens=512)


def _plan(tokenizer: Tokenizer, parallel: bool = True) -> ToolPlan:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "parallel_tool_calls": parallel}
    return plan_tools(ChatCompletionRequest.model_validate(body), None, tokenizer)


def _grammar(tokenizer: Tokenizer, parallel: bool = True) -> str:
    plan = _plan(tokenizer, parallel)
    assert plan.mode == "auto" and plan.constraint is not None
    return plan.constraint.grammar


def _generate(
    llm: LLM, grammar: str | None, *, bias: float = OPEN_BIAS, max_tokens: int = 64, eos_bias: float = 0.0
) -> list[CompletionOutput]:
    open_id = llm.engine.tokenizer.encode("<", add_special_tokens=False)[0]
    biases = {open_id: bias}
    biases.update({i: eos_bias for i in llm.engine.tokenizer.eos_token_ids})
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=max_tokens,
            logit_bias={i: b for i, b in biases.items() if b} or None,
            grammar=grammar,
        )
        for seed in SEEDS
    ]
    prompt = llm.engine.tokenizer.encode("What is the weather?")
    return [out.outputs[0] for out in llm.generate([prompt] * len(params), params)]


_BODY = re.compile(r"\n?(.*?)\n?" + re.escape(CALL_CLOSE), re.DOTALL)


def _check_blocks(out: CompletionOutput) -> tuple[int, list[str]]:
    """(complete valid blocks, problems) of one reply. Only the last block of a
    reply cut by max_tokens may be unfinished."""
    segments = out.text.split(CALL_OPEN)[1:]
    valid, problems = 0, []
    for k, segment in enumerate(segments):
        cut_here = k == len(segments) - 1 and out.finish_reason is FinishReason.LENGTH
        match = _BODY.match(segment)
        if match is None:
            if not cut_here:
                problems.append(f"unclosed block: {segment!r}")
            continue
        try:
            call = json.loads(match.group(1))
            jsonschema_rs.validate(SCHEMAS[call["name"]], call["arguments"])
            assert set(call) == {"name", "arguments"}
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            problems.append(f"{match.group(1)!r}: {exc!r}")
            continue
        valid += 1
    return valid, problems


def test_every_call_block_is_valid_with_the_constraint_and_not_without(llm: LLM, tokenizer: Tokenizer) -> None:
    constrained = _generate(llm, _grammar(tokenizer))
    results = [_check_blocks(o) for o in constrained]
    assert [p for _, p in results if p] == []
    valid = sum(v for v, _ in results)
    assert valid >= len(SEEDS) // 2  # the rewired model opens blocks often: many calls were checked
    # parse_reply (the server's path) turns every complete block into a call.
    plan = _plan(tokenizer)
    assert sum(len(parse_reply(o.text, plan)[1]) for o in constrained) == valid
    # The same sampling without the constraint: the tag is spelled, then junk.
    unconstrained = _generate(llm, None)
    assert sum(o.text.count(CALL_OPEN) for o in unconstrained) >= len(SEEDS)
    assert sum(len(_check_blocks(o)[1]) for o in unconstrained) > 0
    assert sum(len(parse_reply(o.text, plan)[1]) for o in unconstrained) == 0


def test_parallel_tool_calls_false_allows_one_call_then_ends(llm: LLM, tokenizer: Tokenizer) -> None:
    outs = _generate(llm, _grammar(tokenizer, parallel=False))
    with_call = [o for o in outs if CALL_OPEN in o.text]
    assert all(o.text.count(CALL_OPEN) == 1 for o in with_call)
    finished = [o for o in with_call if o.finish_reason is FinishReason.STOP]  # the others ran out of max_tokens
    assert len(finished) >= len(SEEDS) // 2
    for o in finished:
        assert o.text.endswith(CALL_CLOSE) and _check_blocks(o) == (1, []), o.text


def test_text_without_a_tag_is_free(llm: LLM, tokenizer: Tokenizer) -> None:
    """Without the bias the model writes no tag: its replies come through as
    text, ending at eos (biased up here so that some do) or at max_tokens. At
    every step the grammar allowed every token except those that would make the
    text invalid UTF-8 (a stray continuation byte) or complete the tag."""
    grammar = _grammar(tokenizer)
    outs = _generate(llm, grammar, bias=0.0, max_tokens=24, eos_bias=9.0)
    assert {o.finish_reason for o in outs} == {FinishReason.STOP, FinishReason.LENGTH}
    plan = _plan(tokenizer)
    for o in outs:
        assert CALL_OPEN not in o.text and parse_reply(o.text, plan) == (o.text, [])
    compiler = llm.engine.grammars
    vocab = compiler.vocab_size
    token_bytes = [compiler.tokenizer.decode_bytes([i]) for i in range(vocab)]
    eos = set(tokenizer.eos_token_ids)
    masked = 0
    for o in outs[:8]:
        matcher = compiler.matcher(grammar)
        text = b""
        for token in o.token_ids:
            allowed = ~banned_tokens(next_token_bitmask(matcher, vocab).unsqueeze(0), vocab)[0]
            assert all(allowed[i] for i in eos)
            for i in (~allowed).nonzero().flatten().tolist():
                masked += 1
                assert not _utf8_prefix(text + token_bytes[i]) or CALL_OPEN.encode() in text + token_bytes[i]
            assert matcher.consume_token(token)
            text += token_bytes[token]
    assert masked > 0  # the check above had something to check


def _utf8_prefix(data: bytes) -> bool:
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True
