"""Priority and deadline policy: what the engine's EngineCoreRequest.priority
and .deadline are set to for a request.

Priority: the key's class gives the best priority it may use (interactive 0,
batch 1; lower is served first, as in vLLM). A request may ask for a larger
number (lower priority) but never a smaller one: asking for more than the key
allows is clamped, not refused, so a client that always sends "interactive"
keeps working under a batch key.

Deadline: `x-stoker-deadline-ms` (milliseconds from now; relative so client
and server clocks need not agree) or the body's `timeout` (seconds); the
earlier wins, and the server's maximum queue wait caps it. The engine drops a
request still waiting at its deadline (answered 504 `timeout`) and aborts one
that is generating (finish_reason "abort", metered for what it used).

A deadline shorter than MIN_DEADLINE_S cannot be met at all (reading the body
and one engine step take longer), so it is refused with a 400 naming the
minimum instead of being admitted only to end as a 504: the 504 stays the
answer to a deadline that was plausible but passed while the request waited.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from stoker.errors import APIError

if TYPE_CHECKING:  # annotations only: stoker.server.protocol imports the minimum without the key store
    from stoker.control.keys import ApiKey

PRIORITY_VALUES: dict[str, int] = {"interactive": 0, "batch": 1}
MAX_PRIORITY_VALUE = 100
DEADLINE_HEADER = "x-stoker-deadline-ms"
MIN_DEADLINE_S = 0.001
"""The shortest deadline accepted (1 ms, as x-stoker-deadline-ms: 1)."""


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", code="invalid_value", param=param)


def key_priority(key: ApiKey | None) -> int:
    """The best (smallest) priority value a key may use; open mode is interactive."""
    return PRIORITY_VALUES[key.priority] if key is not None else 0


def resolve_priority(key: ApiKey | None, requested: int | str | None) -> int:
    base = key_priority(key)
    if requested is None:
        return base
    if isinstance(requested, str):
        if requested not in PRIORITY_VALUES:
            raise _bad(
                "priority", f"priority must be an integer or one of {sorted(PRIORITY_VALUES)}, got {requested!r}"
            )
        value = PRIORITY_VALUES[requested]
    elif isinstance(requested, bool) or not isinstance(requested, int):
        raise _bad("priority", f"priority must be an integer, got {requested!r}")
    else:
        value = requested
    if not -MAX_PRIORITY_VALUE <= value <= MAX_PRIORITY_VALUE:
        raise _bad("priority", f"priority must be between {-MAX_PRIORITY_VALUE} and {MAX_PRIORITY_VALUE}")
    # Larger number = lower priority: the request may only move down.
    return max(base, value)


def resolve_deadline(
    header_ms: str | None,
    timeout: float | None,
    max_queue_wait: float | None,
    now: float | None = None,
) -> float | None:
    """Absolute deadline (time.time() seconds) or None when neither the
    client nor the server sets one."""
    now = now if now is not None else time.time()
    budgets: list[float] = []
    if header_ms is not None and header_ms.strip() != "":
        try:
            ms = float(header_ms)
        except ValueError:
            raise _bad(
                DEADLINE_HEADER, f"{DEADLINE_HEADER} must be a number of milliseconds, got {header_ms!r}"
            ) from None
        if not math.isfinite(ms) or ms < MIN_DEADLINE_S * 1000.0:
            raise _bad(
                DEADLINE_HEADER,
                f"{DEADLINE_HEADER} must be at least {MIN_DEADLINE_S * 1000.0:g} (milliseconds), got {header_ms!r}; "
                "a shorter deadline cannot be met",
            )
        budgets.append(ms / 1000.0)
    if timeout is not None:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout < MIN_DEADLINE_S
        ):
            raise _bad(
                "timeout",
                f"timeout must be at least {MIN_DEADLINE_S:g} (seconds), got {timeout!r}; "
                "a shorter deadline cannot be met",
            )
        budgets.append(float(timeout))
    if not budgets:
        return None
    budget = min(budgets)
    if max_queue_wait is not None:
        budget = min(budget, max_queue_wait)
    return now + budget
