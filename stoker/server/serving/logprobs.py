"""Token logprobs as the OpenAI-shaped APIs write them (chat's entries, which
Responses' output_text parts carry too)."""

from __future__ import annotations

from stoker.engine.params import TokenLogprob
from stoker.server.fleet import ModelVersion
from stoker.server.serving import JSONObject

LOGPROB_FLOOR = -9999.0
"""What a token the request could not sample (logprob -inf) reads as: JSON has
no infinity, and vLLM writes the same number."""


def finite_logprob(value: float) -> float:
    """-inf as LOGPROB_FLOOR; NaN is left to the strict encoder to refuse loudly."""
    return LOGPROB_FLOOR if value < LOGPROB_FLOOR else value


def token_entries(version: ModelVersion, items: list[TokenLogprob]) -> list[JSONObject]:
    """Each token with its logprob, its bytes and its top alternatives (chat's `content`)."""

    def entry(token_id: int, logprob: float) -> JSONObject:
        text = version.token_text(token_id)
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode())}

    return [{**entry(i.token_id, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]} for i in items]
