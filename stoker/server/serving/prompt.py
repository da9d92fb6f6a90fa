"""What a request body becomes before the engine sees it: its prompt (a chat
through the model's template), its token budget, its sampling parameters.
Every API that serves a chat (chat completions, Responses, Messages) builds
its job here; /tokenize renders a chat the same way."""

from __future__ import annotations

from typing import Any

from stoker.engine.params import ReasoningParams, SamplingParams
from stoker.models.tokenizer import TEMPLATE_ERRORS, Tokenizer
from stoker.server.bounds import offload
from stoker.server.fleet import ModelVersion
from stoker.server.protocol import (
    ChatCompletionRequest,
    ChatTemplateFields,
    SamplingFields,
    bad_request,
    template_error,
)
from stoker.server.reasoning import prompt_thinking, reasoning_params, request_budget, template_switch
from stoker.server.serving import JSONObject
from stoker.server.serving.job import Job
from stoker.server.structured import Constraint, requested_constraint
from stoker.server.tools import ToolPlan, plan_tools, prepare_messages


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
    reasoning: ReasoningParams | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            seed=body.seed,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            logit_bias={int(t): b for t, b in body.logit_bias.items()} if body.logit_bias else None,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
            num_speculative_tokens=body.num_speculative_tokens,
            reasoning=reasoning,
        )
    except ValueError as exc:
        raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from None


def check_token_ids(version: ModelVersion, prompts: list[list[int]], body: SamplingFields) -> None:
    """400 for an empty prompt, or a token id (prompt, stop_token_ids, logit_bias)
    outside the model's vocabulary: the engine refuses them too, but the answer
    should not depend on which engine serves."""
    vocab = version.vocab_size
    for ids in prompts:
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if vocab is not None and any(t >= vocab for t in body.stop_token_ids or []):
        raise bad_request(f"stop_token_ids must be below the vocabulary size {vocab}", param="stop_token_ids")
    if vocab is not None and any(int(t) >= vocab for t in body.logit_bias or {}):
        raise bad_request(f"logit_bias token ids must be below the vocabulary size {vocab}", param="logit_bias")


def chat_max_tokens(body: ChatCompletionRequest) -> int | None:
    """max_completion_tokens, else max_tokens (null: up to the context)."""
    return body.max_completion_tokens or body.max_tokens


def resolve_max_tokens(
    version: ModelVersion, prompts: list[list[int]], requested: int | None, body: SamplingFields
) -> int:
    """The per-sample token budget, once every token id the request names is
    checked (check_token_ids); 400 naming the numbers when it cannot fit the context.

    Left out, it is what the context leaves after the prompt (as vLLM does), but no
    more than each sample's share of the KV cache: several samples of a long-context
    model would otherwise be refused by the KV footprint cap (server/caps.py) for
    a budget the client never asked for. A sample cut there ends with "length"."""
    check_token_ids(version, prompts, body)
    limit = version.max_model_len
    longest = max((len(ids) for ids in prompts), default=0)
    if requested is None:
        if longest >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has {longest} tokens "
                "and leaves no room for a completion.",
                param="messages",
                code="context_length_exceeded",
            )
        implied = limit - longest
        info = version.engine.info
        samples = len(prompts) * max(1, body.n)
        if info is not None and samples > 1:
            share = (info.kv_capacity_tokens - samples * longest) // samples
            implied = max(1, min(implied, share))
        return implied
    if longest + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{longest + requested} tokens ({longest} in the prompt, {requested} for the completion). "
            "Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def chat_plan(body: ChatCompletionRequest, tokenizer: Tokenizer) -> tuple[ToolPlan, Constraint | None]:
    """How a chat request's tools are planned and the output constraint it ends up with
    (grammars built from JSON schemas: run it off the event loop, see bounds.offload)."""
    constraint = requested_constraint(body)
    plan = plan_tools(body, constraint, tokenizer)
    return plan, plan.constraint or constraint


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Tokenizer, plan: ToolPlan) -> list[int]:
    """The prompt a chat request becomes: its messages (and tools) through the chat template."""
    messages, template_kwargs = prepare_messages(
        [m.model_dump(exclude_none=True, exclude={"reasoning"}) for m in body.messages], plan, tokenizer.chat_template
    )
    template_kwargs |= template_switch(body.reasoning_effort, body.chat_template_kwargs)
    return template_ids(tokenizer, messages, body, **template_kwargs)


def template_ids(
    tokenizer: Tokenizer, messages: list[JSONObject], fields: ChatTemplateFields, **template_kwargs: Any
) -> list[int]:
    """Messages through the model's chat template as a request's template
    fields ask, as token ids; 400 for what the template refuses."""
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=fields.add_generation_prompt,
            tokenize=True,
            continue_final_message=fields.continue_final_message,
            variables=fields.chat_template_kwargs,
            **template_kwargs,
        )
    except TEMPLATE_ERRORS as exc:
        raise template_error(exc) from None
    assert not isinstance(ids, str)  # tokenize=True: ids, not text
    return ids


async def chat_job(
    body: ChatCompletionRequest, version: ModelVersion, endpoint: str, default_budget: int | None = None
) -> tuple[Job, ToolPlan]:
    """The job a chat request becomes (its prompt through the template, its
    budget, sampling, output constraint and thinking), and how its tools are
    planned. default_budget: the server's --reasoning-budget."""
    tokenizer = version.tokenizer
    plan, constraint = await offload(chat_plan, body, tokenizer)
    if constraint is not None:
        await version.grammars.check(constraint)
    ids = await offload(chat_prompt_ids, body, tokenizer, plan)
    max_tokens = resolve_max_tokens(version, [ids], chat_max_tokens(body), body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    reasoning = await chat_reasoning(body, version, ids, default_budget)
    params = sampling_params(body, max_tokens, logprobs, grammar=grammar_of(constraint), reasoning=reasoning)
    return Job(endpoint, version.name, [ids], params, [None]), plan


async def chat_reasoning(
    body: ChatCompletionRequest, version: ModelVersion, ids: list[int], default_budget: int | None
) -> ReasoningParams | None:
    """How the engine keeps a thinking model's reply apart: from the model's
    markers, what the rendered prompt did about the thinking, and the request's budget."""
    markers = version.reasoning
    if markers is None:
        return None
    continued = body.continue_final_message
    thinking = await offload(prompt_thinking, markers, ids, version.tokenizer.decode, continued)
    budget = request_budget(body.reasoning_effort, body.reasoning_budget, default_budget)
    return reasoning_params(markers, thinking, budget)


def grammar_of(constraint: Constraint | None) -> str | None:
    return constraint.grammar if constraint is not None else None
