"""`stoker bench quality` / `python -m stoker.bench.quality`: perplexity of the
model behind a running server over a text, through `/v1/completions` with
`echo: true, logprobs: 0, max_tokens: 0` (prompt logprobs), optionally side by
side with a second server (`--compare URL`: another quantization, another
engine such as vLLM, or stoker in float32 as the reference).

The text is tokenized by each server (`/tokenize`), cut into non-overlapping
windows of at most `--window` tokens, and every token but each window's first
(which has no context) is scored. Reported: tokens scored, mean negative
log-likelihood (nats/token) and perplexity = exp(mean NLL). Two servers are
only comparable token for token when they share a tokenizer; the report says
when the token counts differ.

Default text: the project's own docs/architecture.md (about 2,600 tokens with
the default tokenizer), read from the source tree.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
_MAX_DEFAULT_WINDOW = 1024


@dataclass
class Score:
    url: str
    model: str | None
    tokens: int
    """Tokens scored (each window's first is not)."""
    windows: int
    mean_nll: float
    perplexity: float


class QualityError(Exception):
    """A server answered something that cannot be scored; the message says what."""


def _post(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(url.rstrip("/") + path, json=body)
    if r.status_code != 200:
        raise QualityError(f"{url}{path} answered {r.status_code}: {r.text[:300]}")
    data: dict[str, Any] = r.json()
    return data


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    """Non-overlapping windows; a last window of one token scores nothing and is dropped."""
    out = [token_ids[i : i + size] for i in range(0, len(token_ids), size)]
    return [w for w in out if len(w) > 1]


def score_server(client: httpx.Client, url: str, text: str, model: str | None, window: int | None) -> Score:
    tok = _post(client, url, "/tokenize", {"prompt": text, **({"model": model} if model else {})})
    ids: list[int] = tok["tokens"]
    limit = tok.get("max_model_len")
    size = window or min(_MAX_DEFAULT_WINDOW, (limit or _MAX_DEFAULT_WINDOW + 1) - 1)
    if size < 2:
        raise QualityError(f"window must be at least 2 tokens, got {size}")
    total_nll, scored = 0.0, 0
    parts = windows(ids, size)
    if not parts:
        raise QualityError("the text has fewer than 2 tokens: nothing to score")
    for part in parts:
        body: dict[str, Any] = {"prompt": part, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0}
        if model:
            body["model"] = model
        choice = _post(client, url, "/v1/completions", body)["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(logprobs, list) or len(logprobs) < len(part):
            raise QualityError(f"{url} returned no prompt logprobs (does it support echo with logprobs?)")
        values = [lp for lp in logprobs[1 : len(part)] if lp is not None]
        if len(values) != len(part) - 1:
            raise QualityError(f"{url} returned null logprobs inside the prompt")
        total_nll -= sum(values)
        scored += len(values)
    mean = total_nll / scored
    return Score(url, model, scored, len(parts), mean, math.exp(mean))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server to score")
    p.add_argument("--compare", default=None, metavar="URL", help="a second server, scored on the same text")
    p.add_argument("--text", default=None, help=f"UTF-8 text file (default: {DEFAULT_TEXT.name} from the source tree)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's only model)")
    p.add_argument("--compare-model", default=None, help="model name for --compare (default: --model)")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: min(context - 1, 1024))")
    p.add_argument(
        "--api-key",
        default=os.environ.get("STOKER_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default $STOKER_API_KEY or $OPENAI_API_KEY)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def render(scores: list[Score]) -> str:
    lines = ["| server | model | windows | tokens | mean NLL | perplexity |", "|---|---|---|---|---|---|"]
    for s in scores:
        lines.append(
            f"| {s.url} | {s.model or '-'} | {s.windows} | {s.tokens} | {s.mean_nll:.4f} | {s.perplexity:.3f} |"
        )
    if len(scores) == 2:
        a, b = scores
        if a.tokens != b.tokens:
            lines.append(f"\ntoken counts differ ({a.tokens} vs {b.tokens}): different tokenizers, not comparable")
        else:
            lines.append(f"\nperplexity of {b.url} vs {a.url}: {100 * (b.perplexity / a.perplexity - 1):+.2f}%")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[Score]:
    path = Path(args.text) if args.text else DEFAULT_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise QualityError(f"cannot read the text file {path}: {exc.strerror or exc}") from None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(headers=headers, timeout=args.timeout) as client:
        scores = [score_server(client, args.url, text, args.model, args.window)]
        if args.compare:
            scores.append(score_server(client, args.compare, text, args.compare_model or args.model, args.window))
    return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stoker bench quality",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    """`stoker bench quality`: print the scores; 1 with a one-line reason when a server cannot be scored."""
    try:
        scores = run(args)
    except (QualityError, httpx.HTTPError) as exc:
        print(f"stoker bench quality: {exc}", file=sys.stderr)
        return 1
    print(json.dumps([asdict(s) for s in scores], indent=2) if args.json else render(scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
