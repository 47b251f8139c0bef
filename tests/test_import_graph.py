"""The import graph of perfsim/ and validate/, read with `ast` (imports at module level and inside
functions alike): no circle between modules, no perfsim module importing another's underscore name, and
one door from perfsim to validate (perfsim/harness.py), so the edge between the packages points
from validate to perfsim everywhere else."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("perfsim", "validate")
HARNESS = "perfsim.harness"  # the only perfsim module that may name validate


def _modules() -> dict:
    """dotted module name -> path, for every .py file of the packages (a package is its __init__)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _module_of(name: str) -> str | None:
    """The module of the packages that `name` (a module, or a name inside one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: pathlib.Path):
    """(imported module, imported name or None, line) of every import statement in the file, and of
    importlib.import_module / __import__ calls given a literal name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                yield base, alias.name, node.lineno
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield node.args[0].value, None, node.lineno


def _edges(module: str) -> set:
    targets = set()
    for base, name, _ in _imports(module, MODULES[module]):
        target = _module_of(f"{base}.{name}") if name and f"{base}.{name}" in MODULES else _module_of(base)
        if target and target != module:
            targets.add(target)
    return targets


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walk_sees_the_known_edges():
    """The walk reads function-level imports and relative ones (a check on the test itself)."""
    assert "perfsim.predict" in _edges("perfsim")  # perfsim/__init__.py, module level
    assert "perfsim.spec.case" in _edges("perfsim.commands.flags")  # inside a function
    assert "perfsim.cli" not in _edges("perfsim.spec.case")
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circle_of_imports():
    graph = {module: _edges(module) for module in MODULES}
    circles = _circles(graph)
    assert not circles, "import circles (each line: modules that import each other round a loop):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_perfsim_reaches_validate_only_through_the_harness():
    crossing = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {base}"
                for m in MODULES if m.startswith("perfsim") and m != HARNESS
                for base, _, line in _imports(m, MODULES[m]) if base.split(".")[0] == "validate"]
    assert not crossing, "perfsim reaches validate/ only through perfsim/harness.py:\n" + "\n".join(crossing)


def test_no_perfsim_module_imports_another_modules_underscore_name():
    found = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {name} from {base}"
             for m in MODULES if m.startswith("perfsim") for base, name, line in _imports(m, MODULES[m])
             if name and name.startswith("_") and not name.startswith("__")
             and _module_of(base) not in (None, m) and base.split(".")[0] in PACKAGES]
    assert not found, "\n".join(found)
