"""PrefixPins, the engine core's side of pinning, over a real DiskBlockStore: a pin
becomes a prompt-only request whose outputs never reach the front end; when it
finishes, its full blocks' hashes (the prefix cache's own) are pinned; every
refusal is an answer, never an exception in the step loop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stoker.engine.kv_cache import chain_hash
from stoker.engine.kv_disk import DiskBlockStore, DiskLayout
from stoker.engine.params import EngineCoreOutput, FinishReason
from stoker.engine.pins import NO_DISK_TIER, PrefixCommand, PrefixPins, block_hashes

BLOCK = 4
LAYOUT = DiskLayout(model_digest="sha256:" + "cd" * 32, kv_dtype="bfloat16", block_size=BLOCK, block_bytes=64)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskBlockStore]:
    store = DiskBlockStore(tmp_path, 1 << 20, LAYOUT)
    yield store
    store.close()


def output(request_id: str, finish: FinishReason | None = None, error: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, 0, [7], "x", None, 10, 0, finish_reason=finish, error=error)


def test_block_hashes_are_the_prefix_caches_chain() -> None:
    tokens = list(range(10))
    first = chain_hash(None, (0, 1, 2, 3))
    assert block_hashes(tokens, BLOCK) == [first, chain_hash(first, (4, 5, 6, 7))]  # the partial block has none
    assert block_hashes(tokens[:3], BLOCK) == []


def test_a_pin_runs_as_a_hidden_request_then_pins_its_full_blocks(store: DiskBlockStore) -> None:
    pins = PrefixPins(store, BLOCK)
    tokens = list(range(100, 110))
    request = pins.handle(PrefixCommand(1, "pin", "system", tokens))
    assert request is not None and request.prompt_token_ids == tokens
    assert request.sampling_params.max_tokens == 1 and request.sampling_params.temperature == 0.0
    other = output("req-1")
    # A step's outputs: the pin's (unfinished, then finished) never pass; others do, in order.
    assert pins.settle([output(request.request_id), other]) == [other]
    assert pins.take_answers() == []
    assert pins.settle([output(request.request_id, FinishReason.LENGTH)]) == []
    (answer,) = pins.take_answers()
    assert answer.ticket == 1 and answer.error is None
    (pinned,) = answer.pins
    assert (pinned.label, pinned.num_tokens, pinned.num_blocks) == ("system", 10, 2)
    (listed,) = [p for p in store.pins() if p.label == "system"]
    assert listed == pinned
    # The store keeps exactly those hashes from eviction: its pin file names them.
    record = (store.root / "pins" / "system.json").read_text()
    assert all(h.hex() in record for h in block_hashes(tokens, BLOCK))


def test_list_and_unpin_answer_at_once(store: DiskBlockStore) -> None:
    pins = PrefixPins(store, BLOCK)
    store.pin("doc", block_hashes(list(range(8)), BLOCK), 8)
    assert pins.handle(PrefixCommand(2, "list")) is None
    assert pins.handle(PrefixCommand(3, "unpin", "doc")) is None
    assert pins.handle(PrefixCommand(4, "unpin", "doc")) is None
    listed, removed, again = pins.take_answers()
    assert [p.label for p in listed.pins] == ["doc"]
    assert (removed.ticket, removed.removed, again.removed) == (3, True, False)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (PrefixCommand(5, "pin", "../etc", list(range(8))), "label '../etc'"),
        (PrefixCommand(5, "unpin", "a" * 65), "1 to 64 characters"),
        (PrefixCommand(5, "pin", "short", [1, 2, 3]), "at least 4 tokens"),
    ],
)
def test_refusals_are_answers(store: DiskBlockStore, command: PrefixCommand, message: str) -> None:
    pins = PrefixPins(store, BLOCK)
    assert pins.handle(command) is None
    (answer,) = pins.take_answers()
    assert answer.ticket == 5 and answer.error is not None and message in answer.error
    assert store.pins() == []


def test_without_a_disk_tier_every_command_says_so() -> None:
    pins = PrefixPins(None, BLOCK)
    for ticket, action in enumerate(("pin", "unpin", "list")):
        assert pins.handle(PrefixCommand(ticket, action, "x", list(range(8)))) is None  # type: ignore[arg-type]
    assert [a.error for a in pins.take_answers()] == [NO_DISK_TIER] * 3


def test_a_refused_or_aborted_pin_pins_nothing(store: DiskBlockStore) -> None:
    pins = PrefixPins(store, BLOCK)
    refused = pins.handle(PrefixCommand(6, "pin", "long", list(range(8))))
    assert refused is not None
    pins.refused(refused, "prompt is 8 tokens; this model's context is 8")
    aborted = pins.handle(PrefixCommand(7, "pin", "cut", list(range(8))))
    assert aborted is not None
    assert pins.settle([output(aborted.request_id, FinishReason.ABORT, "deadline")]) == []
    assert [(a.ticket, a.error) for a in pins.take_answers()] == [
        (6, "prompt is 8 tokens; this model's context is 8"),
        (7, "deadline"),
    ]
    assert store.pins() == []
