"""Prompt logprobs (SamplingParams.prompt_logprobs; /v1/completions echo +
logprobs and vLLM's prompt_logprobs): on a tiny random model they equal
log_softmax of transformers' own fp32 forward over the prompt, whether the
prompt runs whole, in chunks, after preemption, or after a prefix-cache fill;
only such requests pay for the extra logits; bad combinations answer 400."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import httpx
import pytest
import torch
from conftest import ServerProcess, start_server
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.engine.params import EngineCoreRequest, TokenLogprob

TOP = 3


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, 49000, (n,), generator=g).tolist() for n in (1, 2, 9, 23, 40)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    return folder, hf


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """log_softmax over the vocabulary at every prompt position, transformers' forward."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(scored: list[TokenLogprob | None] | None, ref: torch.Tensor, prompt: list[int]) -> None:
    assert scored is not None and len(scored) == len(prompt)
    assert scored[0] is None
    for i in range(1, len(prompt)):
        e = scored[i]
        assert e is not None and e.token_id == prompt[i]
        row = ref[i - 1]
        assert math.isfinite(e.logprob)
        assert e.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        # Rank counts the tokens above this one; near-ties may fall either way within fp32 noise.
        value = row[prompt[i]]
        assert int((row > value + 1e-4).sum()) + 1 <= e.rank <= int((row > value - 1e-4).sum()) + 1
        want_lp, want_ids = row.topk(TOP)
        got_ids = [t for t, _ in e.top]
        got_lp = [lp for _, lp in e.top]
        torch.testing.assert_close(torch.tensor(got_lp), want_lp, atol=1e-4, rtol=0)
        assert got_ids == want_ids.tolist()


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 7},  # every prompt but the shortest is chunked
        {"num_kv_blocks": 16, "block_size": 4, "max_num_batched_tokens": 16},  # preemption
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_match_transformers(tiny, engine_args: dict) -> None:
    folder, hf = tiny
    prompts = _prompts()
    llm = LLM(str(folder), dtype="float32", **{"num_kv_blocks": 64, **engine_args})
    # Fill the prefix cache first: the scoring run must not take those blocks (it would skip positions).
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    preemptions = llm.engine.stats().num_preemptions
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0, prompt_logprobs=TOP)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        _check(out.prompt_logprobs, _reference(hf, prompt), prompt)
        assert len(out.outputs[0].token_ids) == 4
    if engine_args.get("num_kv_blocks") == 16:  # preempted while scoring, not only while filling the cache
        assert llm.engine.stats().num_preemptions > preemptions


def test_max_tokens_zero_scores_the_prompt_only_and_n_samples_share_it(tiny) -> None:
    folder, hf = tiny
    prompt = _prompts()[3]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=TOP))
    _check(out.prompt_logprobs, _reference(hf, prompt), prompt)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason.value == "length"
    (out,) = llm.generate([prompt], SamplingParams(n=3, max_tokens=2, prompt_logprobs=TOP, seed=1))
    _check(out.prompt_logprobs, _reference(hf, prompt), prompt)
    assert [len(o.token_ids) for o in out.outputs] == [2, 2, 2]


def test_only_prompt_logprob_requests_get_extra_logits(tiny) -> None:
    folder, _hf = tiny
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    a, b = _prompts()[3:5]
    engine.add_request(EngineCoreRequest("plain", a, SamplingParams(max_tokens=1), 0.0))
    engine.add_request(EngineCoreRequest("scored", b, SamplingParams(max_tokens=1, prompt_logprobs=0), 0.0))
    step = engine.scheduler.schedule()
    inputs = engine.runner.prepare(step)
    # One sampling row each, plus len(b) - 1 scored prompt positions for "scored" alone.
    assert inputs.num_sampling == 2
    assert inputs.logits_indices.numel() == 2 + len(b) - 1


# ---------------------------------------------------------------- HTTP API


@pytest.fixture(scope="module")
def tiny_server(tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder, _hf = tiny
    args = ["--model", str(folder), "--dtype", "float32", "--no-embedding-model", "--no-require-auth"]
    args += ["--num-kv-blocks", "64", "--max-num-batched-tokens", "8"]
    server = start_server(args, str(tmp_path_factory.mktemp("tiny-server")), ready_timeout=300)
    try:
        yield server
    finally:
        server.stop()


def test_http_echo_logprobs_and_vllm_prompt_logprobs(tiny, tiny_server: ServerProcess) -> None:
    _folder, hf = tiny
    prompt = _prompts()[3]
    ref = _reference(hf, prompt)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": TOP, "prompt_logprobs": TOP}
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert all(len(t) <= TOP + 1 for t in lp["top_logprobs"][1:])
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    vllm = choice["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(prompt)
    entry = vllm[5][str(prompt[5])]
    assert entry["logprob"] == pytest.approx(ref[4, prompt[5]].item(), abs=1e-4) and entry["rank"] >= 1

    # Streamed, with generation: the first chunk carries the echoed prompt's logprobs.
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=120) as s:
        lines = [ln.removeprefix("data: ") for ln in s.iter_lines() if ln.startswith("data: {")]
    first = json.loads(lines[0])["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    assert first["token_logprobs"][1 : len(prompt)] == pytest.approx(want, abs=1e-4)
    assert len(first["tokens"]) == len(prompt) + 1  # the prompt, then the first generated token


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True, "logprobs": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ],
    ids=["chat-echo", "chat-prompt-logprobs", "logprobs-21", "prompt-logprobs-21", "max-tokens-0-no-echo"],
)
def test_http_bad_prompt_logprob_requests_are_400(tiny_server: ServerProcess, path: str, body: dict) -> None:
    r = httpx.post(f"{tiny_server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_bench_quality_perplexity_matches_transformers(tiny, tiny_server: ServerProcess, tmp_path, capsys) -> None:
    """`stoker bench quality` through the server equals transformers' own perplexity over the same windows."""
    from stoker.bench import quality

    _folder, hf = tiny
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12, encoding="utf-8")
    assert quality.main(["--url", tiny_server.url, "--text", str(text), "--window", "40", "--json"]) == 0
    (score,) = json.loads(capsys.readouterr().out)
    ids = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": text.read_text()}).json()["tokens"]
    nll, count = 0.0, 0
    for w in quality.windows(ids, 40):
        ref = _reference(hf, w)
        nll -= sum(ref[i - 1, w[i]].item() for i in range(1, len(w)))
        count += len(w) - 1
    assert score["tokens"] == count
    assert score["mean_nll"] == pytest.approx(nll / count, abs=1e-4)
    assert quality.main(["--url", tiny_server.url, "--text", str(tmp_path / "missing.txt")]) == 1
