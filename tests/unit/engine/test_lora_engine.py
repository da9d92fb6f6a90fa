"""LoRA adapters through the engine (issue 38), on a tiny random-weight Llama and
three random PEFT adapters: a step mixing the base and adapters gives each
request the tokens it gets alone; --max-loras and --max-loaded-loras hold;
a request whose adapter is loading waits without holding others up; the prefix
cache never crosses adapters; speculation and grammars keep working."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from tiny_loras import ALL_MODULES, ATTENTION, MLP, make_peft_adapter
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.config import ModelConfig
from stoker.engine.core import EngineCore
from stoker.engine.grammars import json_schema_grammar
from stoker.engine.outputs import ModelRunnerOutput, SchedulerOutput
from stoker.engine.params import EngineCoreOutput, EngineCoreRequest, FinishReason, LoraCommand
from stoker.models.lora import LoraAdapter

ADAPTERS = {"attn": (4, ATTENTION), "mlp": (8, MLP), "all": (16, ALL_MODULES)}
"""name -> (rank, target modules)."""
NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 9, 77, 1000, 3], [11, 12, 13, 14, 15]]
_alone: dict[tuple[tuple[int, ...], str | None], list[int]] = {}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf_model("llama", root / "base")
    out = {"base": base}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        out[name] = make_peft_adapter(base, root / name, rank=rank, targets=targets, seed=seed)
    return out


@pytest.fixture(scope="module")
def llm(files: dict[str, Path]) -> LLM:
    llm = LLM(
        str(files["base"]),
        dtype="float32",
        num_kv_blocks=128,
        block_size=4,
        speculative_method="ngram",
        speculative_ngram_min=1,
    )
    for name in ADAPTERS:
        llm.add_lora(name, str(files[name]))
    return llm


def alone(llm: LLM, prompt: list[int], lora: str | None, params: SamplingParams = GREEDY) -> list[int]:
    (out,) = llm.generate([prompt], params, lora_name=lora)
    return out.outputs[0].token_ids


def reference(llm: LLM, prompt: list[int], lora: str | None) -> list[int]:
    """Its greedy tokens alone on the module's engine (computed once per module)."""
    key = (tuple(prompt), lora)
    if key not in _alone:
        _alone[key] = alone(llm, prompt, lora)
    return _alone[key]


def run(
    engine: EngineCore, jobs: list[tuple[list[int], str | None]], params: SamplingParams = GREEDY
) -> dict[str, list[EngineCoreOutput]]:
    """Every job added at once (one batch), stepped to the end; deltas by request id."""
    deltas: dict[str, list[EngineCoreOutput]] = {}
    for i, (prompt, lora) in enumerate(jobs):
        rid = f"job-{time.monotonic_ns()}-{i}"
        engine.add_request(EngineCoreRequest(rid, prompt, params, time.time(), lora_name=lora))
        deltas[rid] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return deltas


def tokens(deltas: list[EngineCoreOutput]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def record_adapters(engine: EngineCore, monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The adapters of every step the runner executes, until the test ends."""
    steps: list[set[str]] = []
    execute = engine.runner.execute_model

    def recording(step: SchedulerOutput) -> ModelRunnerOutput:
        steps.append({s.lora.name for s in step.scheduled if s.lora is not None})
        return execute(step)

    monkeypatch.setattr(engine.runner, "execute_model", recording)
    return steps


def test_a_mixed_batch_gives_each_request_its_tokens_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    names: list[str | None] = [None, *ADAPTERS]
    jobs = [(prompt, name) for prompt in PROMPTS for name in names]
    expected = [reference(llm, prompt, name) for prompt, name in jobs]
    assert len({tuple(e) for e in expected[:4]}) == 4, "each adapter changes the output"
    steps = record_adapters(llm.engine, monkeypatch)
    got = [tokens(d) for d in run(llm.engine, jobs).values()]
    assert got == expected
    assert any(len(s) == 3 for s in steps), "the adapters ran in one step"


def test_an_unregistered_adapter_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="LoRA adapter 'nope' is not registered"):
        llm.generate([[1, 2, 3]], GREEDY, lora_name="nope")
    with pytest.raises(ValueError, match="LoRA adapter 'bad'"):
        llm.add_lora("bad", "/nonexistent/adapter")
    with pytest.raises(ValueError, match="already registered"):
        llm.add_lora("attn", "/elsewhere")
    assert llm.add_lora("attn", llm.engine.loras.paths["attn"]).rank == 4  # the same again: its info


def test_the_prefix_cache_never_crosses_adapters(llm: LLM) -> None:
    prompt = list(range(200, 221))  # 5 full blocks of 4, and one token
    (first,) = llm.generate([prompt], GREEDY, lora_name="attn")
    assert first.num_cached_tokens == 0
    (other,) = llm.generate([prompt], GREEDY, lora_name="mlp")
    (base,) = llm.generate([prompt], GREEDY)
    (again,) = llm.generate([prompt], GREEDY, lora_name="attn")
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens == 20
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_speculation_with_an_adapter_gives_the_same_greedy_tokens(llm: LLM) -> None:
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, num_speculative_tokens=0)
    drafting = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    drafts_before = llm.engine.stats().spec_draft_tokens
    for name in ADAPTERS:
        assert alone(llm, prompt, name, drafting) == alone(llm, prompt, name, plain)
    assert llm.engine.stats().spec_draft_tokens > drafts_before


def test_structured_output_with_an_adapter(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=30, temperature=0.0, grammar=json_schema_grammar(schema))
    (out,) = llm.generate([[1, 2, 3]], params, lora_name="all")
    assert json.loads(out.outputs[0].text)["ok"] in (True, False)
    assert out.outputs[0].finish_reason == FinishReason.STOP


@pytest.fixture(scope="module")
def small(files: dict[str, Path]) -> LLM:
    """Room for two adapters in a step and two in memory."""
    llm = LLM(str(files["base"]), dtype="float32", num_kv_blocks=128, block_size=4, max_loras=2, max_loaded_loras=2)
    for name in ADAPTERS:
        llm.add_lora(name, str(files[name]))
    return llm


def test_max_loras_holds_and_nobody_starves(llm: LLM, small: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [(prompt, name) for prompt in PROMPTS for name in [*ADAPTERS, None]]
    expected = [reference(llm, prompt, name) for prompt, name in jobs]
    steps = record_adapters(small.engine, monkeypatch)
    got = [tokens(d) for d in run(small.engine, jobs).values()]
    assert got == expected
    assert max(len(s) for s in steps) == 2
    assert set().union(*steps) == set(ADAPTERS)


def test_eviction_and_reload(llm: LLM, small: LLM) -> None:
    stats = small.engine.stats()
    assert stats.lora_resident == 2 and stats.lora_registered == 3 and stats.lora_evictions >= 1
    loads, evictions = stats.lora_loads, stats.lora_evictions
    for name in ADAPTERS:  # each in turn: at least one was out of memory and is read again
        assert alone(small, PROMPTS[0], name) == reference(llm, PROMPTS[0], name)
    after = small.engine.stats()
    assert after.lora_loads > loads and after.lora_evictions > evictions
    assert after.lora_resident == 2 and after.lora_resident_bytes > 0


def test_a_loading_adapter_does_not_hold_up_others(small: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = small.engine
    (evicted,) = set(ADAPTERS) - {name for name in ADAPTERS if engine.loras.resident(name)}
    release = threading.Event()
    load = engine.loras._loader

    def slow_load(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
        release.wait(30)  # the file read stalls until the test lets it go
        return load(name, path, config, max_rank)

    monkeypatch.setattr(engine.loras, "_loader", slow_load)
    engine.add_request(EngineCoreRequest("waits", PROMPTS[1], GREEDY, time.time(), lora_name=evicted))
    engine.add_request(EngineCoreRequest("base", [600, 601, 3, 3, 3, 3, 2], GREEDY, time.time()))
    produced = {"waits": 0, "base": 0}
    while produced["base"] < NEW_TOKENS:
        for d in engine.step():
            produced[d.request_id] += len(d.new_token_ids)
    assert produced["waits"] == 0
    assert engine.stats().lora_waiting == {evicted: 1}
    release.set()
    while engine.has_unfinished_requests():
        for d in engine.step():
            produced[d.request_id] += len(d.new_token_ids)
    assert produced["waits"] == NEW_TOKENS


def test_removing_an_adapter_ends_its_requests(files: dict[str, Path], small: LLM) -> None:
    engine = small.engine
    engine.add_request(EngineCoreRequest("gone", PROMPTS[0], GREEDY, time.time(), lora_name="mlp"))
    engine.step()
    (ended,) = engine.lora_command(LoraCommand(1, "remove", "mlp"))
    assert ended.finish_reason == FinishReason.ABORT and ended.error == "LoRA adapter 'mlp' was unloaded"
    assert not engine.loras.is_registered("mlp") and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="not registered"):
        small.generate([[1, 2]], GREEDY, lora_name="mlp")
    small.add_lora("mlp", str(files["mlp"]))


def test_more_adapters_than_memory_all_served(
    llm: LLM, files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nine adapters registered (copies of the three under other names), three in memory, two per step:
    one batch naming all of them and the base completes, each request with its adapter's tokens."""
    many = LLM(str(files["base"]), dtype="float32", num_kv_blocks=128, block_size=4, max_loras=2, max_loaded_loras=3)
    source = {}
    for copy in range(3):
        for name in ADAPTERS:
            shutil.copytree(files[name], tmp_path / f"{name}-{copy}")
            many.add_lora(f"{name}-{copy}", str(tmp_path / f"{name}-{copy}"))
            source[f"{name}-{copy}"] = name
    assert many.engine.stats().lora_resident == 3
    jobs: list[tuple[list[int], str | None]] = [(PROMPTS[0], name) for name in [*source, None]]
    expected = [reference(llm, prompt, source[name] if name else None) for prompt, name in jobs]
    steps = record_adapters(many.engine, monkeypatch)
    deltas = run(many.engine, jobs)
    assert [tokens(d) for d in deltas.values()] == expected
    assert all(d[-1].error is None for d in deltas.values())
    assert max(len(s) for s in steps) <= 2 and set().union(*steps) == set(source)
    stats = many.engine.stats()
    assert stats.lora_loads >= 9 + 6 and stats.lora_evictions >= 6 + 6 and stats.lora_resident <= 3
