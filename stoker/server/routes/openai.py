"""/v1/chat/completions and /v1/completions in OpenAI's request and response shapes."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from stoker.engine.client import EngineUnavailableError
from stoker.engine.params import (
    CompletionOutput,
    EngineCoreOutput,
    FinishReason,
    SamplingParams,
    TokenLogprob,
)
from stoker.errors import APIError
from stoker.models.tokenizer import TEMPLATE_ERRORS, Tokenizer
from stoker.server.bounds import offload
from stoker.server.caps import check_cost, check_prompts
from stoker.server.fallback import serve_from_chain
from stoker.server.fleet import ModelVersion
from stoker.server.hooks import AdmissionInfo
from stoker.server.protocol import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    SamplingFields,
    bad_request,
    deadline_exceeded,
    flatten_prompts,
    template_error,
    unavailable,
)
from stoker.server.serving import (
    ClientDisconnected,
    EngineStreamingResponse,
    Job,
    engine_error,
    run_job,
    sse,
    until_disconnect,
)
from stoker.server.state import ServerState, admitted, get_state, run_before_hooks
from stoker.server.strict_json import StrictJSONResponse
from stoker.server.structured import Constraint, requested_constraint
from stoker.server.tools import ToolPlan, new_call, parse_reply, plan_tools, prepare_messages

router = APIRouter(dependencies=[Depends(run_before_hooks)])
CLIENT_CLOSED = 499  # nginx's code for "client closed request", for logs only


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
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


def completion_max_tokens(body: CompletionRequest) -> int | None:
    """max_tokens as given (null: up to the context), 16 when absent, as OpenAI."""
    return body.max_tokens if "max_tokens" in body.model_fields_set else 16


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


def request_id_for(request: Request) -> str | None:
    """The id a middleware gave the request (stoker.control takes X-Request-Id or makes one)."""
    rid = getattr(request.state, "request_id", None)
    return rid if isinstance(rid, str) and rid else None


async def run(
    request: Request,
    state: ServerState,
    version: ModelVersion,
    job: Job,
    stream: bool,
    include_usage: bool,
    render_delta: Any,
    render_final: Any,
    obj: str,
    fields: SamplingFields,
    frame: Callable[[dict[str, Any]], str] = sse,
    done_marker: bool = True,
) -> Response:
    """Admit and run a job; answer its final body, or stream what render_delta
    makes of each delta (each chunk written by frame; "data: [DONE]" last
    unless done_marker is false)."""
    job.request_id = request_id_for(request) or job.request_id
    job.version = version.label
    info = AdmissionInfo(
        job.endpoint,
        job.model,
        sum(map(len, job.prompts)),
        job.params.max_tokens or 0,
        job.params.n,
        stream,
        priority=fields.priority,
        timeout=fields.timeout,
        prompts=len(job.prompts),
    )
    engine_info = version.engine.info
    check_cost(state.config, info.cost, engine_info.kv_capacity_tokens if engine_info else None)
    await state.hooks.run_admit(request, info)
    job.priority = getattr(request.state, "priority", job.priority)
    job.deadline = getattr(request.state, "deadline", job.deadline)
    events = run_job(version.engine, job, state.engine_ids_in_use)
    try:
        # Wait for the first delta before committing to a status, so early
        # failures (engine down, request rejected, deadline) are real HTTP errors.
        first = await until_disconnect(request, events.__anext__())
        if not stream:

            async def rest() -> None:
                async for _ in events:
                    pass

            await until_disconnect(request, rest())
    except ClientDisconnected:
        state.hooks.run_finished(job.record(CLIENT_CLOSED, "client disconnected", stream, request))
        return Response(status_code=CLIENT_CLOSED)
    except (EngineUnavailableError, ValueError) as exc:
        await events.aclose()
        error = engine_error(exc)
        state.hooks.run_finished(job.record(error.status, error.message, stream, request))
        raise error from None
    if job.deadline_missed and job.completion_tokens == 0:
        # Dropped (or cut) at its deadline before a single token: nothing was
        # sent yet, so the client gets a real 504 rather than an empty answer.
        await events.aclose()
        timeout = deadline_exceeded(job.request_id)
        state.hooks.run_finished(job.record(timeout.status, "deadline", stream, request))
        raise timeout
    if not stream:
        # A deadline that passed during generation ends the samples with
        # finish_reason "abort"; the answer keeps what was generated.
        try:
            response = StrictJSONResponse(render_final(job))
        except APIError as exc:
            state.hooks.run_finished(job.record(exc.status, exc.message, False, request))
            raise
        state.hooks.run_finished(job.record(200, "deadline" if job.deadline_missed else None, False, request))
        return response
    prefix = "chatcmpl" if job.endpoint == "chat" else "cmpl"
    head = {"id": f"{prefix}-{job.request_id}", "object": obj, "created": job.created, "model": job.model}
    outcome: dict[str, Any] = {"status": 200, "error": None}

    async def body() -> AsyncIterator[str]:
        try:
            for chunk in render_delta(job, *first, head):
                yield frame(chunk)
            async for prompt_index, delta in events:
                for chunk in render_delta(job, prompt_index, delta, head):
                    yield frame(chunk)
            if include_usage:
                yield sse({**head, "choices": [], "usage": job.usage()})
        except EngineUnavailableError as exc:
            outcome["error"] = str(exc)
            yield sse(unavailable(str(exc)).body())
        except APIError as exc:  # an event strict JSON could not encode: end the stream with the error
            outcome["error"] = exc.message
            yield sse(exc.body())
        finally:
            await events.aclose()
        if done_marker:
            yield "data: [DONE]\n\n"

    def on_close() -> None:
        if not all(o.finished for o in job.outputs) and outcome["error"] is None:
            outcome.update(status=CLIENT_CLOSED, error="client disconnected")
        elif outcome["error"] is None and job.deadline_missed:
            outcome["error"] = "deadline"
        state.hooks.run_finished(job.record(outcome["status"], outcome["error"], True, request))

    return EngineStreamingResponse(body(), on_close=on_close)


# ---- chat ------------------------------------------------------------------


LOGPROB_FLOOR = -9999.0
"""What a token the request could not sample (logprob -inf) reads as: JSON has
no infinity, and vLLM writes the same number."""


def finite_logprob(value: float) -> float:
    """-inf as LOGPROB_FLOOR; NaN is left to the strict encoder to refuse loudly."""
    return LOGPROB_FLOOR if value < LOGPROB_FLOOR else value


def chat_logprobs(version: ModelVersion, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if items is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = version.token_text(token_id)
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode())}

    return {
        "content": [{**entry(i.token_id, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]} for i in items]
    }


def chat_plan(body: ChatCompletionRequest, tokenizer: Tokenizer) -> tuple[ToolPlan, Constraint | None]:
    """How a chat request's tools are planned and the output constraint it ends up with
    (grammars built from JSON schemas: run it off the event loop, see bounds.offload)."""
    constraint = requested_constraint(body)
    plan = plan_tools(body, constraint, tokenizer)
    return plan, plan.constraint or constraint


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Tokenizer, plan: ToolPlan) -> list[int]:
    """The prompt a chat request becomes: its messages (and tools) through the chat template."""
    messages, template_kwargs = prepare_messages(
        [m.model_dump(exclude_none=True) for m in body.messages], plan, tokenizer.chat_template
    )
    return template_ids(tokenizer, messages, body, **template_kwargs)


def template_ids(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], fields: ChatTemplateFields, **template_kwargs: Any
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


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt of a completion request as token ids, with its text where it came as text."""
    prompts: list[list[int]] = []
    texts: list[str | None] = []
    for prompt in flatten_prompts(body.prompt):
        if isinstance(prompt, str):
            prompts.append(tokenizer.encode(prompt))
            texts.append(prompt)
        else:
            prompts.append(list(prompt))
            texts.append(None)
    return prompts, texts


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
    """The token ids a chat request would be served with, without serving it (vLLM's render
    endpoint). vllm-router's kv_aware policy asks for them and matches them against the KV
    events replicas publish (docs/routers.md)."""
    version = get_state(request).version_for(body.model)
    async with admitted(request, "render", version.name):
        plan, _ = await offload(chat_plan, body, version.tokenizer)
        ids = await offload(chat_prompt_ids, body, version.tokenizer, plan)
        # Refused as serving would refuse it: the budget, the token ids, the sampling fields together.
        sampling_params(body, resolve_max_tokens(version, [ids], chat_max_tokens(body), body), None)
    return {"model": version.name, "token_ids": ids}


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, request: Request) -> list[dict[str, Any]]:
    """As /v1/chat/completions/render, one entry per prompt (vLLM answers a list here too)."""
    version = get_state(request).version_for(body.model)
    async with admitted(request, "render", version.name):
        prompts, _ = await offload(completion_prompts, body, version.tokenizer)
        sampling_params(
            body, resolve_max_tokens(version, prompts, completion_max_tokens(body), body), None
        )  # as chat's
    return [{"model": version.name, "token_ids": ids} for ids in prompts]


# With "stream": true the answer is server-sent events, one JSON chunk per
# `data:` line and `data: [DONE]` last (chat, completions); /v1/responses and
# /v1/messages name each event on an `event:` line too. Before OpenAPI 3.2's
# itemSchema, a stream's `schema` describes one event.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": 'The completion, or with "stream": true its chunks as server-sent events.',
        "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}},
    }
}


@router.post("/v1/chat/completions", responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    return await serve_from_chain(state, body.model, lambda version: chat_attempt(body, request, state, version))


async def chat_job(body: ChatCompletionRequest, version: ModelVersion, endpoint: str) -> tuple[Job, ToolPlan]:
    """The job a chat request becomes (its prompt through the template, its
    budget, sampling and output constraint), and how its tools are planned."""
    tokenizer = version.tokenizer
    plan, constraint = await offload(chat_plan, body, tokenizer)
    if constraint is not None:
        await version.grammars.check(constraint)
    ids = await offload(chat_prompt_ids, body, tokenizer, plan)
    max_tokens = resolve_max_tokens(version, [ids], chat_max_tokens(body), body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs, grammar=_grammar(constraint))
    return Job(endpoint, version.name, [ids], params, [None]), plan


async def chat_attempt(
    body: ChatCompletionRequest, request: Request, state: ServerState, version: ModelVersion
) -> Response:
    job, plan = await chat_job(body, version, "chat")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    sent_role: set[int] = set()

    def message(c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        content, calls = parse_reply(c.text, plan)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg, ("tool_calls" if calls and c.finish_reason is FinishReason.STOP else _reason(c))

    def render_tool_delta(job: Job, d: EngineCoreOutput, head: dict[str, Any]) -> list[dict[str, Any]]:
        """With a named function the reply is its arguments: the call (id, name)
        opens the stream and the arguments follow in fragments, as OpenAI
        streams them. Otherwise a reply is parsed once finished: its role goes
        first, then its content and each call (id, name, whole arguments)."""
        chunks: list[dict[str, Any]] = []
        # Logprobs go with the text they score, as in the non-streamed reply:
        # with the argument fragments, or with the reply parsed at its end.
        pending = chat_logprobs(version, d.new_logprobs if plan.mode == "named" else None)
        if plan.mode != "named" and d.finished:
            pending = chat_logprobs(version, job.outputs[0].outputs[d.index].logprobs)

        def chunk(delta: dict[str, Any], finish: str | None = None, scored: bool = False) -> None:
            nonlocal pending
            logprobs, pending = (pending, None) if scored else (None, pending)
            choice = {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            chunks.append({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

        if plan.mode == "named":
            if d.index not in sent_role:
                sent_role.add(d.index)
                chunk({"role": "assistant", "content": None})
                call = new_call(plan.named or "", "")
                chunk({"tool_calls": [{"index": 0, **call}]})
            if d.new_text:
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": d.new_text}}]}, scored=True)
            if d.finished:
                chunk({}, "tool_calls" if d.finish_reason is FinishReason.STOP else _reason_of(d), scored=True)
            elif pending is not None:  # tokens whose text is still held back (a split character)
                chunk({}, scored=True)
            return chunks
        if d.index not in sent_role:
            sent_role.add(d.index)
            chunk({"role": "assistant", "content": ""})
        if d.finished:
            msg, finish = message(job.outputs[0].outputs[d.index])
            if msg["content"]:
                chunk({"content": msg["content"]}, scored=True)
            for k, call in enumerate(msg.get("tool_calls", [])):
                chunk({"tool_calls": [{"index": k, **call}]}, scored=True)
            chunk({}, finish, scored=True)
        return chunks

    def render_delta(job: Job, _p: int, d: EngineCoreOutput, head: dict[str, Any]) -> list[dict[str, Any]]:
        if plan.active:
            return render_tool_delta(job, d, head)
        delta: dict[str, Any] = {"content": d.new_text} if d.new_text or d.finished else {}
        if d.index not in sent_role:
            sent_role.add(d.index)
            delta = {"role": "assistant", "content": d.new_text}
        if not delta and not d.new_logprobs:
            return []
        choice = {
            "index": d.index,
            "delta": delta,
            "logprobs": chat_logprobs(version, d.new_logprobs),
            "finish_reason": d.finish_reason.value if d.finish_reason else None,
        }
        return [{**head, "choices": [choice], **({"usage": None} if include_usage else {})}]

    def render_final(job: Job) -> dict[str, Any]:
        choices = []
        for c in job.outputs[0].outputs:
            msg, finish = message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": msg,
                    "logprobs": chat_logprobs(version, c.logprobs),
                    "finish_reason": finish,
                }
            )
        return {
            "id": f"chatcmpl-{job.request_id}",
            "object": "chat.completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": job.usage(),
        }

    return await run(
        request,
        state,
        version,
        job,
        body.stream,
        include_usage,
        render_delta,
        render_final,
        "chat.completion.chunk" if body.stream else "chat.completion",
        body,
    )


def _grammar(constraint: Constraint | None) -> str | None:
    return constraint.grammar if constraint is not None else None


def _reason_of(d: EngineCoreOutput) -> str | None:
    return d.finish_reason.value if d.finish_reason else None


def _reason(c: CompletionOutput) -> str | None:
    return c.finish_reason.value if c.finish_reason else None


# ---- completions -----------------------------------------------------------


def completion_logprobs(version: ModelVersion, items: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
    if items is None:
        return None
    tokens = [version.token_text(i.token_id) for i in items]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [finite_logprob(i.logprob) for i in items],
        "top_logprobs": [{version.token_text(t): finite_logprob(lp) for t, lp in i.top} for i in items],
        "text_offset": offsets,
    }


def echoed_logprobs(
    version: ModelVersion,
    prompt_ids: list[int],
    scored: list[TokenLogprob | None] | None,
    generated: dict[str, Any] | None,
) -> dict[str, Any]:
    """OpenAI's echo + logprobs: the prompt tokens first (the first has no
    context: null), then the generated ones, offsets running on through both."""
    entries = scored if scored is not None else [None] * len(prompt_ids)
    tokens = [version.token_text(t) for t in prompt_ids]
    offsets = list(itertools.accumulate(map(len, tokens), initial=0))
    out: dict[str, Any] = {
        "tokens": tokens,
        "token_logprobs": [e.logprob if e else None for e in entries],
        "top_logprobs": [{version.token_text(t): lp for t, lp in e.top} if e else None for e in entries],
        "text_offset": offsets[:-1],
    }
    if generated is not None:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += generated[key]
        out["text_offset"] += [offsets[-1] + o for o in generated["text_offset"]]
    return out


def vllm_prompt_logprobs(
    version: ModelVersion, prompt_ids: list[int], scored: list[TokenLogprob | None] | None
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, None first, then token id ->
    {logprob, rank, decoded_token} for the token itself and the top alternatives."""
    if scored is None:
        return None
    out: list[dict[int, dict[str, Any]] | None] = []
    for token_id, e in zip(prompt_ids, scored):
        if e is None:
            out.append(None)
            continue
        entry = {token_id: {"logprob": e.logprob, "rank": e.rank, "decoded_token": version.token_text(token_id)}}
        for rank, (t, lp) in enumerate(e.top, start=1):
            entry.setdefault(t, {"logprob": lp, "rank": rank, "decoded_token": version.token_text(t)})
        out.append(entry)
    return out


@router.post("/v1/completions", responses=STREAMED)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens 0 needs echo: true (the answer is then the prompt alone)", param="max_tokens")
    check_prompts(state.config, len(flatten_prompts(body.prompt)))  # before any of them is tokenized
    return await serve_from_chain(state, body.model, lambda version: completion_attempt(body, request, state, version))


async def completion_attempt(
    body: CompletionRequest, request: Request, state: ServerState, version: ModelVersion
) -> Response:
    model = version.name
    constraint = await offload(requested_constraint, body)
    if constraint is not None:
        await version.grammars.check(constraint)
    tokenizer = version.tokenizer
    prompts, texts = await offload(completion_prompts, body, tokenizer)
    max_tokens = resolve_max_tokens(version, prompts, completion_max_tokens(body), body)
    if body.echo:
        given = texts
        texts = await offload(lambda: [t if t is not None else tokenizer.decode(ids) for t, ids in zip(given, prompts)])
    # echo + logprobs scores the prompt too: the engine's prompt_logprobs, at the larger top-N asked for.
    asked = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
    params = sampling_params(body, max_tokens, body.logprobs, max(asked) if asked else None, _grammar(constraint))
    job = Job("completion", model, prompts, params, texts)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echoed: set[int] = set()
    text_len: dict[int, int] = {}

    def add_prompt_scores(choice: dict[str, Any], p: int, generated: dict[str, Any] | None) -> None:
        scored = job.outputs[p].prompt_logprobs
        if body.echo and body.logprobs is not None:
            choice["logprobs"] = echoed_logprobs(version, job.prompts[p], scored, generated)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(version, job.prompts[p], scored)

    def render_delta(job: Job, p: int, d: EngineCoreOutput, head: dict[str, Any]) -> list[dict[str, Any]]:
        index = job.choice_index(p, d.index)
        text = d.new_text
        first_chunk = index not in echoed
        if first_chunk:
            echoed.add(index)
        if body.echo and first_chunk:
            text = (job.prompt_texts[p] or "") + text
        offset = text_len.get(index, 0)
        text_len[index] = offset + len(text)
        logprobs = completion_logprobs(version, d.new_logprobs, offset)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason.value if d.finish_reason else None,
        }
        if first_chunk and (body.echo or body.prompt_logprobs is not None):
            add_prompt_scores(choice, p, logprobs)
        return [{**head, "choices": [choice], **({"usage": None} if include_usage else {})}]

    def render_final(job: Job) -> dict[str, Any]:
        choices = []
        for p, out in enumerate(job.outputs):
            prefix = (job.prompt_texts[p] or "") if body.echo else ""
            for c in out.outputs:
                logprobs = completion_logprobs(version, c.logprobs, 0)
                choice = {
                    "index": job.choice_index(p, c.index),
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": _reason(c),
                }
                add_prompt_scores(choice, p, logprobs)
                choices.append(choice)
        return {
            "id": f"cmpl-{job.request_id}",
            "object": "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": job.usage(),
        }

    return await run(
        request, state, version, job, body.stream, include_usage, render_delta, render_final, "text_completion", body
    )


__all__ = ["APIError", "router"]
