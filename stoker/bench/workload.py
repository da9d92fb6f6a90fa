"""Benchmark workloads: synthetic prompts of exact token lengths, shared-prefix
prompts, grounded (copy/quote) prompts, and JSONL datasets.

Synthetic text is random words from a built-in list (no downloads), measured
with the served model's tokenizer (through the server's /tokenize, or a local
file) so `--input-len 100:1000` means tokens, not words."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlparse

import httpx

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


# Plain lowercase ASCII words: byte-level BPE splits them at the leading space,
# so cutting a prompt after a word never changes the tokens before it.
WORDS = """
the of and to in is was for that with as on by at from his her they which this be
are or an had not but were have one all their there been has when who would more
will some into out time them about other can what these than then its only over
first new two after most also many like may such any made city water river stone
garden market window engine bridge winter summer morning evening harbour valley
mountain forest village letter record signal number circle metal paper copper silver
ancient modern quiet bright narrow simple careful sudden gentle distant famous hidden
travel measure follow gather listen answer build carry divide explain remember repair
machine pattern railway lantern kitchen library journey station captain teacher doctor
weather question history science reason surface corner border season animal orchard
because through between against without although whether during before beneath beyond
north south east west green yellow purple orange silent golden wooden frozen crowded
""".split()  # noqa: SIM905 - a readable block beats 180 quoted words


def load_tokenizer(model: str | None = None) -> HFTokenizer:
    """The served model's tokenizer, loaded as `stoker serve` loads it (or
    transformers' reading of the file if stoker's loader is unavailable).
    Offline only; the default is stoker's default GGUF."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from stoker.config import default_model_path

    path = model or default_model_path()
    name = (
        f"the local tokenizer of {path}" if model else f"stoker's default model's tokenizer ({os.path.basename(path)})"
    )
    try:
        from stoker.models.loader import load_tokenizer as stoker_tokenizer
    except ImportError:
        pass
    else:
        return HFTokenizer(stoker_tokenizer(path).hf, name)
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    else:
        hf = AutoTokenizer.from_pretrained(path)
    return HFTokenizer(hf, name)


class HFTokenizer:
    """Counts content tokens only: the server adds its own BOS / chat template."""

    def __init__(self, hf: PreTrainedTokenizerBase, name: str = "a local tokenizer") -> None:
        self.hf = hf
        self.name = name
        """What counted, for the bench to print."""

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids)))

    def chat_overhead(self) -> int:
        """Tokens the chat template wraps around one user message."""
        try:
            ids = self.hf.apply_chat_template(
                [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True
            )
        except Exception:
            return 0
        if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return max(0, len(ids) - len(self.encode("x")))


class BenchError(Exception):
    """A failure a bench command reports in one line (exit 2); `status`: the HTTP status behind it, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def checked(reply: httpx.Response) -> httpx.Response:
    if reply.status_code != 200:
        request = f"{reply.request.method} {reply.request.url.path}"
        raise BenchError(f"{request}: {reply.status_code} {reply.text[:500]}", reply.status_code)
    return reply


VLLM = "vllm"
"""/tokenize {"model", "prompt", "add_special_tokens"} -> {"tokens"}, /detokenize {"model", "tokens"} -> {"prompt"}:
vLLM's schema, which stoker serves."""
LLAMA_SERVER = "llama-server"
"""llama.cpp's: /tokenize {"content", "add_special"} -> {"tokens"}, /detokenize {"tokens"} -> {"content"}."""
SCHEMA_NAMES = {VLLM: "vLLM's", LLAMA_SERVER: "llama-server's"}
PROBE = "Hello world"


class ServedTokenizer:
    """The served model's tokenizer through /tokenize and /detokenize: any model,
    nothing loaded here. One persistent client; the last text counted is
    remembered (synthetic() counts its prompt again once fit_text has)."""

    def __init__(self, client: httpx.Client, model: str | None, schema: str = VLLM) -> None:
        self.client = client
        self.model = model
        self.schema = schema
        self._last: tuple[str, list[int]] | None = None

    @property
    def name(self) -> str:
        where = f"{urlparse(str(self.client.base_url)).netloc}/tokenize"
        served = f"{self.model}'s" if self.model and self.schema == VLLM else "the served model's"
        return f"{served} tokenizer through {where}" + (" (llama-server)" if self.schema == LLAMA_SERVER else "")

    def _body(self, **fields: object) -> dict[str, object]:
        return fields if self.model is None or self.schema == LLAMA_SERVER else {"model": self.model, **fields}

    def encode(self, text: str) -> list[int]:
        if self._last is not None and self._last[0] == text:
            return list(self._last[1])
        if self.schema == LLAMA_SERVER:
            body = self._body(content=text, add_special=False)
        else:
            body = self._body(prompt=text, add_special_tokens=False)
        ids = [int(t) for t in checked(self.client.post("/tokenize", json=body)).json()["tokens"]]
        self._last = (text, ids)
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        reply = checked(self.client.post("/detokenize", json=self._body(tokens=list(ids)))).json()
        return str(reply["content" if self.schema == LLAMA_SERVER else "prompt"])

    def chat_overhead(self) -> int:
        """Tokens the chat template wraps around one user message: vLLM's chat form
        of /tokenize (llama-server: its /apply-template, then /tokenize); 0 where
        the server refuses it."""
        messages = [{"role": "user", "content": "x"}]
        try:
            if self.schema == LLAMA_SERVER:
                prompt = checked(self.client.post("/apply-template", json={"messages": messages})).json()["prompt"]
                body = self._body(content=str(prompt), add_special=False)
            else:
                body = self._body(messages=messages, add_generation_prompt=True)
            templated = len(checked(self.client.post("/tokenize", json=body)).json()["tokens"])
            return max(0, templated - len(self.encode("x")))
        except (BenchError, httpx.HTTPError, ValueError, KeyError, TypeError):
            return 0

    def close(self) -> None:
        self.client.close()


def served_tokenizer(
    url: str, model: str | None = None, headers: Mapping[str, str] | None = None, timeout: float = 60.0
) -> ServedTokenizer:
    """The tokenizer of the model served at `url` (base URL, no /v1), in whichever
    schema its /tokenize answers: vLLM's (and stoker's), else llama-server's, each
    tried once with a round trip through /detokenize. Without `model`, the first
    one /v1/models lists. A BenchError saying why when neither answers."""
    client = httpx.Client(base_url=url, headers=dict(headers or {}), timeout=timeout)
    try:
        if model is None:
            model = listed_model(client)
        reasons: dict[str, str] = {}
        for schema in (VLLM, LLAMA_SERVER):
            tok = ServedTokenizer(client, model, schema)
            try:
                ids = tok.encode(PROBE)
                decoded = tok.decode(ids) if ids else ""
            except httpx.TransportError as exc:
                raise BenchError(f"cannot reach {url} ({type(exc).__name__}: {exc})") from None
            except BenchError as exc:
                if exc.status in (401, 403):
                    why = "the API key was refused" if "authorization" in client.headers else "no API key was given"
                    raise BenchError(f"its /tokenize answered {exc.status}: {why}", exc.status) from None
                reasons[schema] = str(exc)[:120]
                continue
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                reasons[schema] = f"{type(exc).__name__} {str(exc)[:80]}"
                continue
            if " ".join(decoded.split()) == PROBE:
                return tok
            reasons[schema] = f"{PROBE!r} came back as {decoded[:60]!r}" if ids else f"no tokens for {PROBE!r}"
        if len(set(reasons.values())) == 1:  # both bodies refused alike: a server without /tokenize
            raise BenchError(reasons[VLLM])
        raise BenchError("; ".join(f"{SCHEMA_NAMES[schema]} schema: {why}" for schema, why in reasons.items()))
    except BaseException:
        client.close()
        raise


def listed_model(client: httpx.Client) -> str | None:
    """The first model id the server's /v1/models lists; None where it lists none or does not answer."""
    try:
        data = client.get("/v1/models").json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass
class LengthDist:
    """fixed N, uniform A:B (inclusive), normal:MEAN:STD (clipped to >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        s = str(spec).strip().lower()
        parts = s.split(":")
        try:
            if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
                return cls("fixed", int(parts[-1]))
            if parts[0] == "uniform" and len(parts) == 3:
                parts = parts[1:]
            if len(parts) == 2:
                lo, hi = int(parts[0]), int(parts[1])
                if lo > hi:
                    raise ValueError
                return cls("uniform", lo, hi)
            if parts[0] == "normal" and len(parts) == 3:
                return cls("normal", float(parts[1]), float(parts[2]))
        except ValueError:
            pass
        raise ValueError(f"bad length {spec!r}: use N, A:B (uniform) or normal:MEAN:STD")

    def sample(self, rng: random.Random, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return [rng.randint(int(self.a), int(self.b)) for _ in range(n)]
        return [max(1, round(rng.gauss(self.a, self.b))) for _ in range(n)]


@dataclass
class RequestSpec:
    """One request to send. Either `prompt` (completions) or `messages` (chat);
    the load generator converts between them for the other endpoint."""

    prompt: str | None = None
    messages: list[dict[str, object]] | None = None
    input_len: int | None = None
    """Prompt tokens as counted locally (content only), when known."""
    output_len: int | None = None
    """max_tokens to ask for; None lets the server decide."""
    prefix_group: int | None = None


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def fit_text(tok: Tokenizer, rng: random.Random, n_tokens: int, prefix: str = "") -> str:
    """Text starting with `prefix` that encodes to exactly n_tokens tokens
    (when the tokenizer allows it; else the nearest found)."""
    if n_tokens < 1:
        raise ValueError("n_tokens must be at least 1")

    def count(t: str) -> int:
        return len(tok.encode(t))

    text = prefix
    sep = " " if prefix else ""
    # Grow by about the missing number of words (English words are ~1-1.5 tokens).
    while (have := count(text)) < n_tokens:
        text = text + sep + random_words(rng, max(1, n_tokens - have))
        sep = " "
    if have == n_tokens:
        return text
    # Overshot: cut the suffix token by token, re-measuring after each cut
    # because a cut word may re-encode into a different number of tokens.
    suffix_ids = tok.encode(text[len(prefix) :])
    k = len(suffix_ids) - (have - n_tokens)
    best, best_err, seen = text, have - n_tokens, set()
    while 0 <= k <= len(suffix_ids) and k not in seen:
        seen.add(k)
        candidate = prefix + tok.decode(suffix_ids[:k])
        c = count(candidate)
        if c == n_tokens:
            return candidate
        if abs(c - n_tokens) < abs(best_err):
            best, best_err = candidate, c - n_tokens
        k += n_tokens - c
    return best


def synthetic(
    tok: Tokenizer,
    num: int,
    input_len: LengthDist,
    output_len: LengthDist | None,
    seed: int = 0,
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
    chat_overhead: int = 0,
    variant: int = 0,
) -> list[RequestSpec]:
    """`num` random prompts. With a shared prefix, request i starts with prefix
    i % num_prefixes (shared_prefix_len tokens) followed by its own input_len
    tokens. chat_overhead is subtracted so the templated prompt hits the length.
    Each `variant` draws new prompts (and lengths) but keeps the same prefixes."""
    rng = random.Random(seed)
    prefixes = shared_prefixes(tok, rng, shared_prefix_len, num_prefixes)
    if variant:
        rng = random.Random(f"{seed}/{variant}")
    in_lens = input_len.sample(rng, num)
    out_lens = output_len.sample(rng, num) if output_len else [None] * num
    specs = []
    for i in range(num):
        n = max(1, in_lens[i] - chat_overhead)
        group = i % num_prefixes if prefixes else None
        if prefixes and group is not None:
            text = fit_text(tok, rng, shared_prefix_len + n, prefix=prefixes[group])
        else:
            text = fit_text(tok, rng, n)
        specs.append(
            RequestSpec(prompt=text, input_len=len(tok.encode(text)), output_len=out_lens[i], prefix_group=group)
        )
    return specs


def shared_prefixes(tok: Tokenizer, rng: random.Random, length: int, count: int) -> list[str]:
    """The `count` shared prefixes of `length` tokens that synthetic() starts its prompts with."""
    return [fit_text(tok, rng, length) for _ in range(count)] if length > 0 else []


def prefix_fill(tok: Tokenizer, length: int, count: int, seed: int = 0) -> list[RequestSpec]:
    """Each shared prefix of synthetic(seed=seed) alone, one token asked for: sent
    before a run, it computes every prefix once (and a disk tier writes it)."""
    return [
        RequestSpec(prompt=text, input_len=length, output_len=1, prefix_group=group)
        for group, text in enumerate(shared_prefixes(tok, random.Random(seed), length, count))
    ]


_SUBJECTS = ["the captain", "a teacher", "the old doctor", "our neighbour", "the station master", "a young engineer"]
_VERBS = ["repaired", "measured", "carried", "explained", "remembered", "followed", "gathered", "divided"]
_OBJECTS = ["the copper lantern", "a wooden bridge", "the library records", "the railway signal", "a silver engine"]
_PLACES = ["near the harbour", "in the quiet valley", "beyond the north border", "before the winter", "at the market"]
_GROUNDED_ASKS = [
    "Copy the passage above word for word.",
    "Repeat the passage above exactly, without changing anything.",
    "Quote the passage above in full.",
]


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."


def grounded(
    tok: Tokenizer, num: int, input_len: LengthDist, output_len: LengthDist | None, seed: int = 0, variant: int = 0
) -> list[RequestSpec]:
    """Copy/quote requests: a passage of plain sentences of about input_len
    tokens, then an instruction to repeat it, so the answer restates its
    context (the RAG, extraction and code-editing shape where prompt-lookup
    speculative decoding pays). Each `variant` draws new passages."""
    rng = random.Random(f"grounded/{seed}/{variant}")
    in_lens = input_len.sample(rng, num)
    out_lens = output_len.sample(rng, num) if output_len else [None] * num
    specs = []
    for i in range(num):
        ask = rng.choice(_GROUNDED_ASKS)
        text = " ".join(_sentences_reaching(tok, rng, in_lens[i], "\n\n" + ask)) + "\n\n" + ask
        specs.append(RequestSpec(prompt=text, input_len=len(tok.encode(text)), output_len=out_lens[i]))
    return specs


def _sentences_reaching(tok: Tokenizer, rng: random.Random, length: int, tail: str) -> list[str]:
    """The fewest of the sentences rng draws next whose passage, then `tail`, is at
    least `length` tokens, and rng left as drawing exactly those leaves it: what
    adding one sentence at a time and counting gives (counts grow with sentences),
    in a few counts, not one per sentence (each may be a call to the server)."""
    state = rng.getstate()
    drawn: list[str] = []

    def reaches(m: int) -> bool:
        while len(drawn) < m:
            drawn.append(_sentence(rng))
        return len(tok.encode(" ".join(drawn[:m]) + tail)) >= length

    low, high = -1, 0  # not reached at low (-1: none counted), reached at high once found
    while not reaches(high):
        low, high = high, max(1, 2 * high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if reaches(mid) else (mid, high)
    rng.setstate(state)
    return [_sentence(rng) for _ in range(high)]


def synthetic_token_ids(tok: Tokenizer, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token id prompts of exactly these lengths (for the offline bench)."""
    rng = random.Random(seed)
    return [tok.encode(fit_text(tok, rng, n))[:n] for n in lengths]


def load_dataset(
    path: str, output_len: LengthDist | None = None, seed: int = 0, tok: Tokenizer | None = None
) -> list[RequestSpec]:
    """JSONL, one request a line: {"prompt": "..."} or {"messages": [...]}, with
    an optional "max_tokens" / "output_len". A conversation ending with an
    assistant turn is sent without it; that turn's length becomes max_tokens."""
    rng = random.Random(seed)
    specs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            out = row.get("max_tokens", row.get("output_len"))
            if "messages" in row:
                messages = list(row["messages"])
                if messages and messages[-1].get("role") == "assistant":
                    reply = messages.pop()["content"]
                    if out is None and tok is not None:
                        out = max(1, len(tok.encode(reply)))
                spec = RequestSpec(messages=messages)
                text = "\n".join(m.get("content", "") for m in messages)
            elif "prompt" in row:
                spec = RequestSpec(prompt=row["prompt"])
                text = row["prompt"]
            else:
                raise ValueError(f"{path}:{lineno}: expected a 'prompt' or 'messages' field")
            if tok is not None:
                spec.input_len = len(tok.encode(text))
            if out is None and output_len is not None:
                out = output_len.sample(rng, 1)[0]
            spec.output_len = int(out) if out is not None else None
            specs.append(spec)
    return specs


def as_prompt(spec: RequestSpec) -> str:
    """Completions endpoint: a conversation flattened to plain text."""
    if spec.prompt is not None:
        return spec.prompt
    return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in spec.messages or []) + "\nassistant:"


def as_messages(spec: RequestSpec) -> list[dict[str, object]]:
    if spec.messages is not None:
        return spec.messages
    return [{"role": "user", "content": spec.prompt or ""}]


_RANGE = re.compile(r"^\d+(,\d+)*$")


def parse_int_list(spec: str) -> list[int]:
    """'1,4,16,32' -> [1, 4, 16, 32]."""
    if not _RANGE.match(spec.replace(" ", "")):
        raise ValueError(f"expected comma-separated integers, got {spec!r}")
    return [int(x) for x in spec.replace(" ", "").split(",")]
