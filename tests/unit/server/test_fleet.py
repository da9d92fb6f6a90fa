"""The pieces of the model fleet that need no server: --model and --fallback
parsing and checks, content digests, the canary's share, the cost meter."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stoker.models.digest import model_digest
from stoker.observe.cost import CostMeter, cost_per_million
from stoker.server.fleet import (
    FleetError,
    ModelSpec,
    ServedModel,
    check_fallbacks,
    parse_fallbacks,
    parse_model_spec,
    plan_models,
)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.bin"
    path.write_bytes(b"weights" * 1000)
    return path


def test_model_spec_forms(model_file: Path) -> None:
    digest = "sha256:" + hashlib.sha256(model_file.read_bytes()).hexdigest()
    assert parse_model_spec(f"big={model_file}") == ModelSpec("big", str(model_file))
    assert parse_model_spec(f"org/big={model_file}@{digest}") == ModelSpec("org/big", str(model_file), digest)
    bare = parse_model_spec(str(model_file))
    assert bare.name == "m.bin" and not bare.named and bare.digest is None
    # Upper-case hex is the same pin.
    assert parse_model_spec(f"big={model_file}@{digest.upper().replace('SHA256:', 'sha256:')}").digest == digest
    odd = model_file.parent / "a=b.bin"
    shutil.copy(model_file, odd)
    assert parse_model_spec(str(odd)).path == str(odd)  # a path holding "=" is a path


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("big=", "no path"),
        ("big=/nowhere/x.gguf", "no model at /nowhere/x.gguf"),
        ("big={f}@sha256:abc", "sha256:<64 hex digits>"),
        ("bad name={f}", "model name 'bad name'"),
    ],
)
def test_model_spec_errors(model_file: Path, text: str, says: str) -> None:
    with pytest.raises(FleetError, match=None) as info:
        parse_model_spec(text.format(f=model_file))
    assert says in str(info.value)


def test_plan_refuses_duplicate_names(model_file: Path) -> None:
    with pytest.raises(FleetError, match="two models are named 'a'"):
        plan_models(None, [f"a={model_file}", f"a={model_file}"], None)
    specs = plan_models(str(model_file), [f"b={model_file}"], None)
    assert [s.name for s in specs] == ["m.bin", "b"]
    assert plan_models(str(model_file), [], "chat")[0].name == "chat"
    assert plan_models(None, [str(model_file)], "chat")[0].name == "chat"
    with pytest.raises(FleetError, match="--served-model-name names a server's only model"):
        plan_models(str(model_file), [f"b={model_file}"], "chat")


def test_fallback_chains() -> None:
    assert parse_fallbacks(["big=small, tiny", "small=tiny"]) == {"big": ["small", "tiny"], "small": ["tiny"]}
    for bad in (["big"], ["=small"], ["big="], ["big=a", "big=b"]):
        with pytest.raises(FleetError):
            parse_fallbacks(bad)
    names = ["big", "small", "tiny"]
    check_fallbacks(names, {"big": ["small", "tiny"], "small": ["tiny"]})
    with pytest.raises(FleetError, match="unknown model 'huge'"):
        check_fallbacks(names, {"big": ["huge"]})
    with pytest.raises(FleetError, match="not itself"):
        check_fallbacks(names, {"big": ["big"]})
    with pytest.raises(FleetError, match="cycle big -> small -> tiny -> big"):
        check_fallbacks(names, {"big": ["small"], "small": ["tiny"], "tiny": ["big"]})


def test_file_digest_is_sha256sum(model_file: Path) -> None:
    assert model_digest(model_file) == "sha256:" + hashlib.sha256(model_file.read_bytes()).hexdigest()


def test_folder_digest_matches_the_documented_shell_command(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\x00" * 100)
    (folder / "sub" / "tokenizer.json").write_text('{"a": 1}')
    (folder / "README.md").write_text("not pinned")
    (folder / ".git").mkdir()
    (folder / ".git" / "x.json").write_text("hidden")
    first = model_digest(folder)
    command = (
        "find . -type f \\( -name '*.safetensors' -o -name '*.bin' -o -name '*.gguf' -o -name '*.json' "
        "-o -name '*.model' -o -name '*.txt' -o -name '*.jinja' \\) -not -path '*/.*' "
        "| sed 's|^\\./||' | LC_ALL=C sort | xargs sha256sum | sha256sum"
    )
    shell = subprocess.run(["sh", "-c", command], cwd=folder, capture_output=True, text=True, check=True)
    assert first == "sha256:" + shell.stdout.split()[0]
    (folder / "README.md").write_text("edited")  # a model card is not the model
    assert model_digest(folder) == first
    (folder / "config.json").write_text('{"changed": true}')
    assert model_digest(folder) != first
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no weight"):
        model_digest(tmp_path / "empty")


def test_an_unpinned_digest_reuses_the_hash_of_the_same_unchanged_file(
    model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))
    true = "sha256:" + hashlib.sha256(model_file.read_bytes()).hexdigest()
    assert model_digest(model_file, reuse=True) == true
    [entry] = (tmp_path / "cache" / "digests").iterdir()
    planted = {**json.loads(entry.read_text()), "sha256": "0" * 64}
    entry.write_text(json.dumps(planted))
    assert model_digest(model_file, reuse=True) == "sha256:" + "0" * 64  # read from the entry, not the file
    assert model_digest(model_file) == true  # what a pin is checked against: the bytes
    # Written to, same size, its modification time put back: the change time still moved.
    before = model_file.stat()
    model_file.write_bytes(b"WEIGHTS" * 1000)
    os.utime(model_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert model_digest(model_file, reuse=True) == "sha256:" + hashlib.sha256(b"WEIGHTS" * 1000).hexdigest()


async def test_the_fleet_reuses_a_hash_only_where_nothing_is_pinned(
    model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stoker.config import EngineConfig
    from stoker.server.fleet import Fleet

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))
    true = "sha256:" + hashlib.sha256(model_file.read_bytes()).hexdigest()
    [version] = await Fleet([ModelSpec("a", str(model_file))], {}, EngineConfig(), _RecordedEngine, lambda t: t).start()  # type: ignore[arg-type]
    assert version.digest == true
    [entry] = (tmp_path / "cache" / "digests").iterdir()
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "sha256": "1" * 64}))
    [again] = await Fleet([ModelSpec("a", str(model_file))], {}, EngineConfig(), _RecordedEngine, lambda t: t).start()  # type: ignore[arg-type]
    assert again.digest == "sha256:" + "1" * 64
    [pinned] = await Fleet(
        [ModelSpec("a", str(model_file), true)], {}, EngineConfig(), _RecordedEngine, lambda t: t
    ).start()  # type: ignore[arg-type]
    assert pinned.digest == true


class _Version:
    def __init__(self, label: str) -> None:
        self.label = label
        self.ready = True


def test_canary_share_is_dealt_evenly() -> None:
    stable, canary = _Version("v1"), _Version("v2")
    model = ServedModel("m", stable, canary, 10.0)  # type: ignore[arg-type]
    picks = [model.pick().label for _ in range(200)]
    assert picks.count("v2") == 20
    assert all(picks[i : i + 10].count("v2") == 1 for i in range(0, 200, 10))
    model.canary_percent = 37.5
    assert sum(model.pick().label == "v2" for _ in range(400)) in (149, 150, 151)
    stable.ready = False  # the stable version's engine restarts: the canary takes everything
    assert {model.pick().label for _ in range(10)} == {"v2"}


def test_cost_meter_follows_busy_time_and_tokens() -> None:
    now = [100.0]
    meter = CostMeter(3.6, window=60.0, clock=lambda: now[0])  # $3.60/h = $0.001/s
    now[0] = 160.0
    meter.add("big", prompt_tokens=0, generation_tokens=1000, busy_seconds=45.0)
    meter.add("small", prompt_tokens=2000, generation_tokens=3000, busy_seconds=15.0)
    costs = meter.costs()
    # 60 s cost $0.06: big was busy 3/4 of the engines' time.
    assert costs["big"] == {"generation": pytest.approx(0.045 / 1000 * 1e6)}
    assert costs["small"]["generation"] == pytest.approx(0.015 / 3000 * 1e6)
    assert costs["small"]["prompt"] == pytest.approx(0.015 / 2000 * 1e6)
    now[0] = 500.0  # the window moved on: nothing measured, no figure
    assert meter.costs() == {"big": {}, "small": {}}
    assert cost_per_million(3.6, 1000.0) == pytest.approx(1.0)
    assert cost_per_million(3.6, 0.0) is None


class _RecordedEngine:
    """An engine client that only records start and shutdown."""

    def __init__(self, config: object) -> None:
        self.events: list[str] = []
        self.info = None  # what a real client holds until its engine says ready

    async def start(self) -> None:
        self.events.append("start")

    async def shutdown(self) -> None:
        self.events.append("shutdown")


async def test_memory_budget_refuses_before_loading(model_file: Path) -> None:
    """The estimate before a load (weights + runtime) already over the budget: refused, the engine never started."""
    from stoker.config import EngineConfig
    from stoker.server.fleet import ENGINE_RUNTIME_BYTES, Fleet

    specs = [ModelSpec("a", str(model_file))]
    fleet = Fleet(specs, {}, EngineConfig(), _RecordedEngine, lambda t: t, max_memory=ENGINE_RUNTIME_BYTES)  # type: ignore[arg-type]
    with pytest.raises(FleetError, match="model a: needs about") as info:
        await fleet.start()
    assert info.value.status == 409 and "start" not in fleet.initial[0].engine.events  # type: ignore[attr-defined]


async def test_a_pinned_file_is_checked_before_its_engine_starts(model_file: Path) -> None:
    from stoker.config import EngineConfig
    from stoker.server.fleet import Fleet

    wrong = "sha256:" + "0" * 64
    fleet = Fleet([ModelSpec("a", str(model_file), wrong)], {}, EngineConfig(), _RecordedEngine, lambda t: t)  # type: ignore[arg-type]
    with pytest.raises(FleetError, match="digest mismatch"):
        await fleet.start()
    assert "start" not in fleet.initial[0].engine.events  # type: ignore[attr-defined]


async def test_an_unpinned_file_is_hashed_while_its_engine_starts(
    model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest is known once the load is done; an unreadable file stops the engine started beside it."""
    from stoker.config import EngineConfig
    from stoker.server.fleet import Fleet

    fleet = Fleet([ModelSpec("a", str(model_file))], {}, EngineConfig(), _RecordedEngine, lambda t: t)  # type: ignore[arg-type]
    [version] = await fleet.start()
    assert version.digest == model_digest(str(model_file)) and version.engine.events == ["start"]  # type: ignore[attr-defined]

    def unreadable(path: str, cancel: object = None, reuse: bool = False) -> str:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("stoker.server.fleet.model_digest", unreadable)
    gone = Fleet([ModelSpec("b", str(model_file))], {}, EngineConfig(), _RecordedEngine, lambda t: t)  # type: ignore[arg-type]
    with pytest.raises(FleetError, match=r"model b: cannot read .*Permission denied"):
        await gone.start()
    assert gone.initial[0].engine.events[:2] == ["start", "shutdown"]  # type: ignore[attr-defined]
