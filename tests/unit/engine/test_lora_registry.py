"""The engine's LoRA bookkeeping without a model: registration answers, LRU
residency that never drops an adapter in use, hash roots that follow the
file's bytes, and KV events that carry the adapter's name."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stoker.config import ModelConfig
from stoker.engine.kv_cache import KVCacheManager
from stoker.engine.kv_events import BlockStored, KVEventLog
from stoker.engine.lora_registry import LoraRegistry, files_digest, hash_root
from stoker.engine.params import SamplingParams
from stoker.engine.request import Request
from stoker.models.lora import LoraAdapter, LoraError

CONFIG = ModelConfig("LlamaForCausalLM", 100, 8, 16, 1, 2, 1, 4, 64, 1e-5, 10000.0)


def fake_loader(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """An adapter without tensors; a file holding 'bad' is refused as load_lora refuses one."""
    if Path(path).read_text() == "bad":
        raise LoraError.of(name, "rank 99 is above --max-lora-rank 8")
    return LoraAdapter(name, path, 4, 2.0, frozenset({"q_proj"}), 1000, ())


def settle(registry: LoraRegistry, in_use: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    deadline = time.monotonic() + 10
    while registry.busy and time.monotonic() < deadline:
        registry.wait(0.05)
        registry.poll(set(in_use))


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name in ("a", "b", "c", "bad"):
        (tmp_path / name).write_text("bad" if name == "bad" else name)
        paths[name] = str(tmp_path / name)
    return paths


def test_registration_answers_and_refusals(adapters: dict[str, str]) -> None:
    registry = LoraRegistry(CONFIG, 8, 2, fake_loader)
    registry.register(1, "a", adapters["a"])
    registry.register(2, "bad", adapters["bad"])
    registry.register(3, " spaced", adapters["a"])
    settle(registry)
    answers = {a.ticket: a for a in registry.take_answers()}
    assert answers[1].info is not None and answers[1].info.nbytes == 1000 and answers[1].error is None
    assert answers[2].error == "LoRA adapter 'bad': rank 99 is above --max-lora-rank 8"
    assert answers[3].error is not None and "printable characters" in answers[3].error
    assert registry.paths == {"a": adapters["a"]} and registry.num_load_failures == 1
    registry.register(4, "a", adapters["b"])
    (refused,) = registry.take_answers()
    assert refused.error == f"LoRA adapter 'a' is already registered from {adapters['a']}; remove it first"


def test_lru_keeps_adapters_in_use_and_reloads_on_demand(adapters: dict[str, str]) -> None:
    registry = LoraRegistry(CONFIG, 8, 2, fake_loader)
    for ticket, name in enumerate("abc"):
        registry.register(ticket, name, adapters[name])
        settle(registry, {"a"})
    assert registry.resident("a") is not None, "in use: never dropped"
    assert registry.resident("b") is None and registry.resident("c") is not None
    assert registry.num_evictions == 1
    assert registry.ensure("b", {"a", "c"}) is None, "no room beside two in use: it waits"
    assert registry.ensure("b", {"a"}) is None  # c goes, b loads
    settle(registry, {"a", "b"})
    resident = registry.ensure("b", {"a", "b"})
    assert resident is not None and registry.resident("c") is None and registry.num_loads == 4
    assert registry.resident_bytes == 2000


def test_the_hash_root_follows_the_name_and_the_bytes(adapters: dict[str, str]) -> None:
    digest = files_digest(adapters["a"])
    assert hash_root("a", digest) != hash_root("b", digest)
    Path(adapters["a"]).write_text("changed")
    assert hash_root("a", files_digest(adapters["a"])) != hash_root("a", digest)


def test_adapter_blocks_chain_from_its_root_and_announce_its_name() -> None:
    events = KVEventLog(4)
    kv = KVCacheManager(16, 4, True, events)
    params = SamplingParams(max_tokens=1)
    prompt = list(range(9))
    base = Request("base", 0, prompt, params, 0.0)
    adapted = Request("lora", 0, prompt, params, 0.0, lora_name="a")
    adapted.hash_root = hash_root("a", b"digest")
    for request in (base, adapted):
        assert kv.allocate(request, len(prompt))
        kv.cache_full_blocks(request, len(prompt))
    stored = [e for e in events.take() if isinstance(e, BlockStored)]
    assert [(e.parent_block_hash, e.lora_name, len(e.block_hashes)) for e in stored] == [
        (None, None, 2),
        (None, "a", 2),
    ]
    assert set(stored[0].block_hashes).isdisjoint(stored[1].block_hashes)
    again = Request("again", 0, prompt, params, 0.0, lora_name="a")
    again.hash_root = adapted.hash_root
    assert [b.block_id for b in kv.find_cached_prefix(again)] == kv.block_ids(adapted)[:2]
    other = Request("other", 0, prompt, params, 0.0, lora_name="b")
    other.hash_root = hash_root("b", b"digest")
    assert kv.find_cached_prefix(other) == []
    assert [b.block_id for b in kv.find_cached_prefix(Request("b2", 0, prompt, params, 0.0))] == kv.block_ids(base)[:2]
