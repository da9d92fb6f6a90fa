"""Each API route file translates its body into the shared job and the job's
outputs back; the plumbing they share (admission, running, streaming, the
finished hooks) lives in stoker/server/serving/. A route file that imports
another, or reports to the finished hooks itself, puts plumbing back in one
API's room."""

from __future__ import annotations

import ast
import pathlib

import stoker.server.routes
import stoker.server.serving

ROUTES = pathlib.Path(stoker.server.routes.__file__).parent
SERVING = pathlib.Path(stoker.server.serving.__file__).parent
GENERATION_ROUTES = ("openai.py", "anthropic.py", "responses.py")


def imported_modules(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def finished_hook_calls(path: pathlib.Path) -> int:
    return sum(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "run_finished"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_no_route_file_imports_another():
    for path in sorted(ROUTES.glob("*.py")):
        others = {m for m in imported_modules(path) if m.startswith("stoker.server.routes")}
        assert not others, f"routes/{path.name} imports {sorted(others)}: shared plumbing belongs in serving/"


def test_a_generation_request_reaches_the_finished_hooks_from_one_place():
    for name in GENERATION_ROUTES:
        assert finished_hook_calls(ROUTES / name) == 0, f"routes/{name} reports to the finished hooks itself"
    assert sum(finished_hook_calls(path) for path in SERVING.glob("*.py")) == 1
