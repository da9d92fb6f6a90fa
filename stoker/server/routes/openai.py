"""/v1/chat/completions and /v1/completions in OpenAI's request and response shapes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from stoker.engine.params import CompletionOutput, EngineCoreOutput, FinishReason, TokenLogprob
from stoker.models.tokenizer import Tokenizer
from stoker.server.bounds import offload
from stoker.server.caps import check_prompts
from stoker.server.fallback import serve_from_chain
from stoker.server.fleet import ModelVersion
from stoker.server.kv_roles import split_request
from stoker.server.protocol import ChatCompletionRequest, CompletionRequest, bad_request, flatten_prompts
from stoker.server.reasoning import ReasoningField, reasoning_fields
from stoker.server.serving import JSONObject
from stoker.server.serving.generate import STREAMED, Generation, Renderer, generate
from stoker.server.serving.job import Job
from stoker.server.serving.logprobs import finite_logprob, token_entries
from stoker.server.serving.prompt import (
    chat_job,
    chat_max_tokens,
    chat_plan,
    chat_prompt_ids,
    grammar_of,
    resolve_max_tokens,
    sampling_params,
)
from stoker.server.state import ServerState, admitted, get_state, run_before_hooks
from stoker.server.structured import requested_constraint
from stoker.server.tools import ToolPlan, new_call, parse_reply

router = APIRouter(dependencies=[Depends(run_before_hooks)])


def completion_max_tokens(body: CompletionRequest) -> int | None:
    """max_tokens as given (null: up to the context), 16 when absent, as OpenAI."""
    return body.max_tokens if "max_tokens" in body.model_fields_set else 16


# ---- chat ------------------------------------------------------------------


def chat_logprobs(version: ModelVersion, items: list[TokenLogprob] | None) -> JSONObject | None:
    return None if items is None else {"content": token_entries(version, items)}


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
async def render_chat(body: ChatCompletionRequest, request: Request) -> JSONObject:
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
async def render_completion(body: CompletionRequest, request: Request) -> list[JSONObject]:
    """As /v1/chat/completions/render, one entry per prompt (vLLM answers a list here too)."""
    version = get_state(request).version_for(body.model)
    async with admitted(request, "render", version.name):
        prompts, _ = await offload(completion_prompts, body, version.tokenizer)
        sampling_params(
            body, resolve_max_tokens(version, prompts, completion_max_tokens(body), body), None
        )  # as chat's
    return [{"model": version.name, "token_ids": ids} for ids in prompts]


@router.post("/v1/chat/completions", responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    return await serve_from_chain(state, body.model, lambda version: chat_attempt(body, request, state, version))


async def chat_attempt(
    body: ChatCompletionRequest, request: Request, state: ServerState, version: ModelVersion
) -> Response:
    job, plan = await chat_job(body, version, "chat", state.config.reasoning_budget)
    split_request(request, body, job, version.engine.config, state.config.kv_peers)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    reasoning = state.config.reasoning_field if job.params.reasoning is not None else None
    renderer = ChatRenderer(version, plan, include_usage, reasoning)
    return await generate(Generation(request, state, version, job, renderer, body.stream, body))


@dataclass
class ChatRenderer(Renderer):
    """A chat completion, or its chunks."""

    version: ModelVersion
    plan: ToolPlan
    include_usage: bool
    reasoning: ReasoningField | None = None
    """The field(s) that carry the thinking (--reasoning-field); None: the reply has no thinking apart."""
    sent_role: set[int] = field(default_factory=set)
    """Samples whose first chunk (the one with the role) went out."""
    opened_call: set[int] = field(default_factory=set)
    """Samples whose named call (id, name) went out."""

    def thinking(self, text: str | None) -> JSONObject:
        """The thinking as the reply's fields carry it (none where the reply has no thinking apart)."""
        return reasoning_fields(text, self.reasoning) if self.reasoning is not None else {}

    def head(self, job: Job) -> JSONObject:
        return {
            "id": f"chatcmpl-{job.request_id}",
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": job.model,
        }

    def chunk(self, job: Job, choice: JSONObject) -> JSONObject:
        return {**self.head(job), "choices": [choice], **({"usage": None} if self.include_usage else {})}

    def message(self, c: CompletionOutput) -> tuple[JSONObject, str | None]:
        content, calls = parse_reply(c.text, self.plan)
        msg: JSONObject = {"role": "assistant", "content": content, **self.thinking(c.reasoning_text or None)}
        if calls:
            msg["tool_calls"] = calls
        return msg, ("tool_calls" if calls and c.finish_reason is FinishReason.STOP else _reason(c))

    def events(self, job: Job, prompt_index: int, d: EngineCoreOutput) -> list[JSONObject]:
        if self.plan.active:
            return self.tool_events(job, d)
        delta: JSONObject = {"content": d.new_text} if d.new_text or d.finished else {}
        if d.index not in self.sent_role:
            self.sent_role.add(d.index)
            delta = {"role": "assistant", "content": d.new_text}
        if d.new_reasoning_text:
            delta |= self.thinking(d.new_reasoning_text)
        if not delta and not d.new_logprobs:
            return []
        choice = {
            "index": d.index,
            "delta": delta,
            "logprobs": chat_logprobs(self.version, d.new_logprobs),
            "finish_reason": d.finish_reason.value if d.finish_reason else None,
        }
        return [self.chunk(job, choice)]

    def tool_events(self, job: Job, d: EngineCoreOutput) -> list[JSONObject]:
        """With a named function the reply is its arguments: the call (id, name)
        opens the stream and the arguments follow in fragments, as OpenAI
        streams them. Otherwise a reply is parsed once finished: its role goes
        first, then its content and each call (id, name, whole arguments)."""
        chunks: list[JSONObject] = []
        named = self.plan.mode == "named"
        # Logprobs go with the text they score, as in the non-streamed reply:
        # with the argument fragments, or with the reply parsed at its end.
        pending = chat_logprobs(self.version, d.new_logprobs if named else None)
        if not named and d.finished:
            pending = chat_logprobs(self.version, job.outputs[0].outputs[d.index].logprobs)

        def chunk(delta: JSONObject, finish: str | None = None, scored: bool = False) -> None:
            nonlocal pending
            logprobs, pending = (pending, None) if scored else (None, pending)
            choice = {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            chunks.append(self.chunk(job, choice))

        if d.index not in self.sent_role:
            self.sent_role.add(d.index)
            chunk({"role": "assistant", "content": None if named else ""})
        if d.new_reasoning_text:
            chunk(self.thinking(d.new_reasoning_text))
        if named:
            # A thinking reply's call opens with its answer, after the thinking.
            if d.index not in self.opened_call and (self.reasoning is None or d.new_text or d.finished):
                self.opened_call.add(d.index)
                call = new_call(self.plan.named or "", "")
                chunk({"tool_calls": [{"index": 0, **call}]})
            if d.new_text:
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": d.new_text}}]}, scored=True)
            if d.finished:
                chunk({}, "tool_calls" if d.finish_reason is FinishReason.STOP else _reason_of(d), scored=True)
            elif pending is not None:  # tokens whose text is still held back (a split character)
                chunk({}, scored=True)
            return chunks
        if d.finished:
            msg, finish = self.message(job.outputs[0].outputs[d.index])
            if msg["content"]:
                chunk({"content": msg["content"]}, scored=True)
            for k, call in enumerate(msg.get("tool_calls", [])):
                chunk({"tool_calls": [{"index": k, **call}]}, scored=True)
            chunk({}, finish, scored=True)
        return chunks

    def closing(self, job: Job) -> list[JSONObject]:
        return [{**self.head(job), "choices": [], "usage": job.usage()}] if self.include_usage else []

    def final(self, job: Job) -> JSONObject:
        choices = []
        for c in job.outputs[0].outputs:
            msg, finish = self.message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": msg,
                    "logprobs": chat_logprobs(self.version, c.logprobs),
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


def _reason_of(d: EngineCoreOutput) -> str | None:
    return d.finish_reason.value if d.finish_reason else None


def _reason(c: CompletionOutput) -> str | None:
    return c.finish_reason.value if c.finish_reason else None


# ---- completions -----------------------------------------------------------


def completion_logprobs(version: ModelVersion, items: list[TokenLogprob] | None, offset: int) -> JSONObject | None:
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
    generated: JSONObject | None,
) -> JSONObject:
    """OpenAI's echo + logprobs: the prompt tokens first (the first has no
    context: null), then the generated ones, offsets running on through both."""
    entries = scored if scored is not None else [None] * len(prompt_ids)
    tokens = [version.token_text(t) for t in prompt_ids]
    offsets = list(itertools.accumulate(map(len, tokens), initial=0))
    out: JSONObject = {
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
) -> list[dict[int, JSONObject] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, None first, then token id ->
    {logprob, rank, decoded_token} for the token itself and the top alternatives."""
    if scored is None:
        return None
    out: list[dict[int, JSONObject] | None] = []
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
    params = sampling_params(body, max_tokens, body.logprobs, max(asked) if asked else None, grammar_of(constraint))
    job = Job("completion", version.name, prompts, params, texts)
    split_request(request, body, job, version.engine.config, state.config.kv_peers)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    renderer = CompletionRenderer(version, body, include_usage)
    return await generate(Generation(request, state, version, job, renderer, body.stream, body))


@dataclass
class CompletionRenderer(Renderer):
    """A text completion, or its chunks: one choice per prompt and sample."""

    version: ModelVersion
    body: CompletionRequest
    include_usage: bool
    echoed: set[int] = field(default_factory=set)
    """Choices whose first chunk (with the echoed prompt and its scores) went out."""
    text_len: dict[int, int] = field(default_factory=dict)
    """Text sent so far per choice: where the next logprobs' text_offset starts."""

    def head(self, job: Job) -> JSONObject:
        return {"id": f"cmpl-{job.request_id}", "object": "text_completion", "created": job.created, "model": job.model}

    def add_prompt_scores(self, job: Job, choice: JSONObject, p: int, generated: JSONObject | None) -> None:
        scored = job.outputs[p].prompt_logprobs
        if self.body.echo and self.body.logprobs is not None:
            choice["logprobs"] = echoed_logprobs(self.version, job.prompts[p], scored, generated)
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.version, job.prompts[p], scored)

    def events(self, job: Job, prompt_index: int, d: EngineCoreOutput) -> list[JSONObject]:
        p = prompt_index
        index = job.choice_index(p, d.index)
        text = d.new_text
        first_chunk = index not in self.echoed
        if first_chunk:
            self.echoed.add(index)
        if self.body.echo and first_chunk:
            text = (job.prompt_texts[p] or "") + text
        offset = self.text_len.get(index, 0)
        self.text_len[index] = offset + len(text)
        logprobs = completion_logprobs(self.version, d.new_logprobs, offset)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason.value if d.finish_reason else None,
        }
        if first_chunk and (self.body.echo or self.body.prompt_logprobs is not None):
            self.add_prompt_scores(job, choice, p, logprobs)
        return [{**self.head(job), "choices": [choice], **({"usage": None} if self.include_usage else {})}]

    def closing(self, job: Job) -> list[JSONObject]:
        return [{**self.head(job), "choices": [], "usage": job.usage()}] if self.include_usage else []

    def final(self, job: Job) -> JSONObject:
        choices = []
        for p, out in enumerate(job.outputs):
            prefix = (job.prompt_texts[p] or "") if self.body.echo else ""
            for c in out.outputs:
                logprobs = completion_logprobs(self.version, c.logprobs, 0)
                choice = {
                    "index": job.choice_index(p, c.index),
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": _reason(c),
                }
                self.add_prompt_scores(job, choice, p, logprobs)
                choices.append(choice)
        return {
            "id": f"cmpl-{job.request_id}",
            "object": "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": job.usage(),
        }


__all__ = ["router"]
