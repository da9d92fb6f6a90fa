"""Compile and per-token mask time of llguidance vs xgrammar on the default
model's tokenizer (how docs/structured-output.md chose its library).

    pip install --target /tmp/llg llguidance==1.9.1
    pip install --no-deps --target /tmp/xgr xgrammar==0.2.8 apache-tvm-ffi
    PYTHONPATH=.:/tmp/llg python docs/perf/grammar_libraries.py llguidance
    PYTHONPATH=.:/tmp/xgr python docs/perf/grammar_libraries.py xgrammar

Each schema's matcher walks up to 200 random allowed tokens.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

from stoker.config import default_model_path
from stoker.models.loader import load_tokenizer

VOCAB = 49152
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
                },
                "required": ["id", "tags"],
            },
            "kind": {"enum": ["a", "b", "c"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["user", "kind"],
        "additionalProperties": False,
    },
    "big": {
        "type": "object",
        "properties": {f"f{i}": {"type": ["string", "integer", "boolean"]} for i in range(30)},
        "required": [f"f{i}" for i in range(0, 30, 2)],
    },
}


def walk(fill, accept, done, mask) -> list[float]:
    rng, times = random.Random(0), []
    while not done() and len(times) < 200:
        started = time.perf_counter()
        fill(mask)
        times.append(time.perf_counter() - started)
        allowed = [i for i in range(VOCAB) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
        accept(rng.choice(allowed))
    return times


def report(name: str, compile_s: float, times: list[float]) -> None:
    print(
        f"  {name}: compile {1e3 * compile_s:.1f} ms; mask median {1e6 * statistics.median(times):.0f} us, "
        f"max {1e6 * max(times):.0f} us over {len(times)} tokens"
    )


def main(lib: str) -> None:
    tokenizer = load_tokenizer(default_model_path())
    if lib == "llguidance":
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        started = time.perf_counter()
        tok = llguidance.hf.from_tokenizer(tokenizer.hf)
        print(f"llguidance: tokenizer {1e3 * (time.perf_counter() - started):.0f} ms")
        for name, schema in SCHEMAS.items():
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            started = time.perf_counter()
            m = llguidance.LLMatcher(tok, grammar)
            compile_s = time.perf_counter() - started
            mask = lt.allocate_token_bitmask(1, VOCAB)
            times = walk(lambda b, m=m: lt.fill_next_token_bitmask(m, b, 0), m.consume_token, m.is_stopped, mask)
            report(name, compile_s, times)
    else:
        import xgrammar as xgr

        started = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=VOCAB)
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        print(f"xgrammar: tokenizer {1e3 * (time.perf_counter() - started):.0f} ms")
        for name, schema in SCHEMAS.items():
            started = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            compile_s = time.perf_counter() - started
            m = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, VOCAB)
            times = walk(lambda b, m=m: m.fill_next_token_bitmask(b, 0), m.accept_token, m.is_terminated, mask)
            report(name, compile_s, times)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llguidance")
