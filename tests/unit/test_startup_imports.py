"""What start-up imports, and what it may not (docs/perf/startup.md).

The front end imports its app before it spawns the engine, so whatever that
import pulls in delays the engine's start: torch and transformers (1-3 s)
must stay out of it. The engine imports torch, but not dynamo and inductor
(~1 s more; llguidance.torch pulls them in through a torch.compile
decorator).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _modules_after(imports: str) -> set[str]:
    code = f"import sys\n{imports}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True)
    return set(done.stdout.split())


def test_the_front_end_imports_neither_torch_nor_transformers_before_it_spawns_the_engine() -> None:
    modules = _modules_after("import stoker.cli, stoker.server.cli, stoker.server.app")
    assert "torch" not in modules
    assert "transformers" not in modules
    assert "llguidance" in modules  # the grammar check is there, only its torch half is not


def test_the_engine_core_does_not_import_torch_compile() -> None:
    modules = _modules_after("import stoker.engine.core")
    assert "torch" in modules
    assert "torch._dynamo" not in modules
    assert "torch._inductor" not in modules
