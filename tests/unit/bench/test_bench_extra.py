"""`stoker bench` without the bench extra says in one line what to install (exit 2)."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from stoker.cli import main


def test_bench_without_matplotlib_names_the_extra_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec_without_matplotlib(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "matplotlib" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec_without_matplotlib)
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err == "stoker bench needs its extra dependencies (matplotlib missing): pip install 'stoker[bench]'\n"
