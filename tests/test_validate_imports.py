"""validate/'s modules import one another without cycles (issue 15 item 7): a module that needs
another's piece takes it from where it lives, lazily or not, never round a loop."""

from __future__ import annotations

import ast
import os

VALIDATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "validate")


def imports() -> dict:
    """module -> the validate modules it imports anywhere (module level or inside functions)."""
    modules = {f[:-3] for f in os.listdir(VALIDATE) if f.endswith(".py")}
    graph = {}
    for m in modules:
        with open(os.path.join(VALIDATE, f"{m}.py")) as fh:
            tree = ast.parse(fh.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("validate."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.ImportFrom) and node.module == "validate":
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("validate.")}
        graph[m] = found & modules
    return graph


def cycle(graph: dict) -> list | None:
    """One import cycle as a list of modules, or None."""
    state: dict = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_cycles_in_validate():
    assert cycle(imports()) is None


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
