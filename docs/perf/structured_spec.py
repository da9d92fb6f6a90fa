"""Constrained requests with and without speculation, one stream: JSON extraction
from a passage (the values are copied from the prompt, where prompt lookup pays),
sent alternately to two servers, greedy, so both must return the same text.

python docs/perf/structured_spec.py URL_SPEC URL_NONE [requests]
"""

import json
import random
import sys
import time

import httpx

SPEC_URL, NONE_URL = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 8
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "city": {"type": "string"},
                    "email": {"type": "string"},
                    "order": {"type": "string"},
                },
                "required": ["name", "city", "email", "order"],
                "additionalProperties": False,
            },
            "minItems": 4,
            "maxItems": 4,
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
FIRST = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Margaret", "Ken", "Dennis", "Frances"]
LAST = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Hamilton", "Thompson", "Ritchie", "Allen"]
CITIES = ["Lisbon", "Oslo", "Kyoto", "Dublin", "Quito", "Tallinn", "Austin", "Perth", "Accra", "Bergen"]
ITEMS = ["blue kettle", "oak desk lamp", "wool scarf", "steel water bottle", "canvas backpack", "ceramic mug"]


def passage(rng: random.Random) -> str:
    lines = []
    for _ in range(4):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        email = f"{first.lower()}.{last.lower()}{rng.randint(10, 99)}@example.org"
        lines.append(
            f"{first} {last} lives in {rng.choice(CITIES)}, can be reached at {email}, "
            f"and ordered a {rng.choice(ITEMS)} (order number {rng.randint(100000, 999999)})."
        )
    return " ".join(lines)


def ask(client: httpx.Client, url: str, text: str) -> tuple[str, int, float]:
    body = {
        "messages": [{"role": "user", "content": f"{text}\n\nExtract every person (name, city, email, order number) as JSON."}],
        "max_tokens": 300,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}},
    }
    started = time.perf_counter()
    reply = client.post(f"{url}/v1/chat/completions", json=body).json()
    elapsed = time.perf_counter() - started
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"], elapsed


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


rng = random.Random(0)
texts = [passage(rng) for _ in range(N)]
client = httpx.Client(timeout=600)
ask(client, SPEC_URL, texts[0])  # warm both (grammar compile, first-request costs)
ask(client, NONE_URL, texts[0])
totals = {SPEC_URL: [0, 0.0], NONE_URL: [0, 0.0]}
same = valid = 0
for i, text in enumerate(texts):
    order = (SPEC_URL, NONE_URL) if i % 2 == 0 else (NONE_URL, SPEC_URL)
    got = {}
    for url in order:
        content, tokens, elapsed = ask(client, url, text)
        totals[url][0] += tokens
        totals[url][1] += elapsed
        got[url] = content
    same += got[SPEC_URL] == got[NONE_URL]
    try:
        json.loads(got[SPEC_URL])
        valid += 1
    except ValueError:
        pass
for url, (tokens, seconds) in totals.items():
    print(f"{url}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s")
ratio = (totals[SPEC_URL][0] / totals[SPEC_URL][1]) / (totals[NONE_URL][0] / totals[NONE_URL][1])
print(f"speculation / none: {ratio:.2f}x; identical replies {same}/{N}; JSON parses {valid}/{N}")
drafts = metric(SPEC_URL, "vllm:spec_decode_num_draft_tokens_total")
accepted = metric(SPEC_URL, "vllm:spec_decode_num_accepted_tokens_total")
print(f"draft tokens {drafts:.0f}, accepted {accepted:.0f} ({accepted / max(drafts, 1):.0%})")
