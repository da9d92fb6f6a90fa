"""c=16 chat load against a running server: rounds of 16 unconstrained then 16 json_schema requests (the 20 schemas of tests/e2e/structured_schemas.py); prints tok/s, validity and the grammar metrics.

python docs/perf/structured_load.py http://127.0.0.1:8000 [rounds] [--equal-length]

--equal-length: every request, constrained or not, generates exactly 256 tokens
(unconstrained ones ignore eos; constrained ones follow a schema of at least 40
items, each an object with a string and an integer, which no reply closes in 256
tokens), so both halves run the same number of steps at the same concurrency and
the throughput ratio is the grammar's cost alone.
"""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "tests" / "e2e"))
from structured_schemas import SCHEMAS

EQUAL = "--equal-length" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--equal-length"]
URL = ARGS[0]
C, ROUNDS = 16, int(ARGS[1]) if len(ARGS) > 1 else 2
MAXT = 256 if EQUAL else 64
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                "required": ["name", "quantity"],
                "additionalProperties": False,
            },
            "minItems": 40,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
client = httpx.Client(base_url=URL, timeout=600)


def one(i, constrained):
    name, prompt, schema = SCHEMAS[i % len(SCHEMAS)]
    if EQUAL:
        name, prompt, schema = "shopping_list", "List forty things to buy for a camping trip, with quantities.", LONG_SCHEMA
    body = {
        "messages": [{"role": "user", "content": prompt + " Answer in JSON."}],
        "max_tokens": MAXT,
        "temperature": 1.0,
        "seed": i,
    }
    if EQUAL and not constrained:
        body["ignore_eos"] = True
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    r = client.post("/v1/chat/completions", json=body).json()
    c = r["choices"][0]
    ok = None
    if constrained and c["finish_reason"] == "stop":
        try:
            jsonschema_rs.validate(schema, json.loads(c["message"]["content"]))
            ok = True
        except Exception:
            ok = False
    return r["usage"]["completion_tokens"], c["finish_reason"], ok


def metric(text, name):
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


totals = {True: [0, 0.0], False: [0, 0.0]}
before = client.get("/metrics").text
valid = [0, 0, 0]
for rnd in range(ROUNDS):
    for constrained in (False, True):
        t = time.perf_counter()
        with ThreadPoolExecutor(C) as pool:
            res = list(pool.map(lambda i, base=rnd * C, c=constrained: one(i + base, c), range(C)))
        dt = time.perf_counter() - t
        toks = sum(r[0] for r in res)
        totals[constrained][0] += toks
        totals[constrained][1] += dt
        if constrained:
            valid[0] += sum(r[2] is True for r in res)
            valid[1] += sum(r[2] is False for r in res)
            valid[2] += sum(r[1] == "length" for r in res)
        print(f"round {rnd} constrained={constrained}: {toks} tokens in {dt:.1f}s = {toks / dt:.1f} tok/s", flush=True)
for k, (toks, dt) in totals.items():
    print(f"constrained={k}: {toks / dt:.1f} tok/s overall")
print(
    f"ratio constrained/unconstrained: {(totals[True][0] / totals[True][1]) / (totals[False][0] / totals[False][1]):.3f}"
)
print(f"constrained finished 'stop': valid {valid[0]}, invalid {valid[1]}; cut by max_tokens={MAXT}: {valid[2]}")
m = client.get("/metrics").text
n = metric(m, "stoker:grammar_mask_seconds_count") - metric(before, "stoker:grammar_mask_seconds_count")
s = metric(m, "stoker:grammar_mask_seconds_sum") - metric(before, "stoker:grammar_mask_seconds_sum")
print(
    f"grammar mask: {n:.0f} steps, mean {1e3 * s / max(n, 1):.2f} ms/step; compiles {metric(m, 'stoker:grammar_compile_seconds_count'):.0f}, mean {1e3 * metric(m, 'stoker:grammar_compile_seconds_sum') / max(1, metric(m, 'stoker:grammar_compile_seconds_count')):.2f} ms; structured requests {metric(m, 'stoker:structured_requests_total'):.0f}"
)
print(f"iteration steps total {metric(m, 'vllm:iteration_tokens_total_count'):.0f}")
