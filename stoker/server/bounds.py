"""Every bound on what a request body may hold, in one place: the request
models (stoker/server/protocol.py, responses_api.py, anthropic_api.py) take
their Field(max_length=...) from here, and docs/server.md ("Request bounds")
lists the same names and values. Where OpenAI or vLLM publish a limit, it is
theirs; elsewhere a generous figure no real client comes near.

Strings are bounded by the body itself (--max-body-bytes, 413 before parsing),
so only lists, objects and short identifiers have a bound of their own here.

Also the worker pool that runs the front end's CPU work that grows with a
client's input (tokenizing, chat templates, JSON schema to grammar), so one
big body never holds the event loop that answers /health and every stream.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

# Chat: OpenAI answers "array too long ... maximum length 2048" beyond 2048 messages.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 1024
"""Content parts of one message (text parts; Anthropic's blocks)."""
MAX_TOOLS = 128
"""OpenAI's limit on `tools`."""
MAX_STOP_STRINGS = 64
"""OpenAI allows 4; vLLM any number. 64 leaves room for clients that list a model's stop words."""
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
"""OpenAI's limit on `logit_bias` entries; each value in [-100, 100]."""
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on `top_logprobs` (and vLLM's default --max-logprobs)."""
MAX_CHOICES = 1024
"""Choices of `guided_choice` / structured_outputs.choice."""
MAX_TEMPLATE_KWARGS = 64
"""Keys of `chat_template_kwargs`."""
MAX_PROMPTS = 2048
"""Prompts in one /v1/completions request (OpenAI's limit on a prompt array);
--max-prompts-per-request caps it further at run time."""
MAX_TOKEN_IDS = 262_144
"""Token ids in one list (a prompt given as ids, /detokenize, an embedding input):
beyond any context length served here, so the model's own limit answers first."""
MAX_EMBEDDING_INPUTS = 2048
"""OpenAI's limit on /v1/embeddings `input` items."""
MAX_EXTRA_FIELDS = 64
"""Fields a body (or a message, a content part) may carry that the server does not know:
ignored, as OpenAI's SDKs send newer ones, but not without end."""
MAX_NAME_CHARS = 256
"""Identifiers: model, user, a message's name, a tool's name in tool_choice."""
MAX_INCLUDE = 16
"""/v1/responses `include` entries."""
MAX_JSON_DEPTH = 900
"""Nesting of arrays and objects in a body: Python's JSON parser stops a little
deeper (its recursion limit, about 990 levels), so this is the depth every body
within it is sure to parse; deeper is a 400 naming this figure."""

# How many requests' input work (tokenize, template, grammar) runs at once; the
# rest wait their turn without holding a thread each.
FRONTEND_WORKERS = 4

P = ParamSpec("P")
T = TypeVar("T")


@functools.cache
def _executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=FRONTEND_WORKERS, thread_name_prefix="stoker-input")


async def offload(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) in the bounded input pool, the caller's context
    variables carried along (as asyncio.to_thread does)."""
    loop = asyncio.get_running_loop()
    call: Callable[[], Any] = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    result: T = await loop.run_in_executor(_executor(), call)
    return result
