"""The import graph of perfsim/ and validate/, read with `ast` (imports at module level and inside
functions alike): no circle between modules, one door from perfsim to validate (perfsim/harness.py),
so the edge between the packages points from validate to perfsim everywhere else, and no file of
perfsim/, validate/, tests/ or benchmarks/ taking another module's underscore name (a name used
across modules is public)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("perfsim", "validate")
SCRIPTS = ("tests", "benchmarks")  # their files import their folder's helpers by bare name (conftest, browser)
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


def _imports(module: str, path: pathlib.Path, tree: ast.AST | None = None):
    """(imported module, imported name or None, line, the name the file binds to it or None) of every
    import statement in the file, and of importlib.import_module / __import__ calls given a literal name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree or ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno, alias.asname or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                yield base, alias.name, node.lineno, alias.asname or alias.name
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield node.args[0].value, None, node.lineno, None


def _edges(module: str) -> set:
    targets = set()
    for base, name, _, _ in _imports(module, MODULES[module]):
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
                for base, _, line, _ in _imports(m, MODULES[m]) if base.split(".")[0] == "validate"]
    assert not crossing, "perfsim reaches validate/ only through perfsim/harness.py:\n" + "\n".join(crossing)


def _underscore_uses(path: pathlib.Path, module: str, known: dict, root: pathlib.Path = ROOT) -> list:
    """Where the file takes an underscore name from another module of `known` (dotted name -> path):
    `from X import _name`, and `alias._name` where alias is a module of `known` it imported
    (`import X as alias`, `from P import X`, `import P.X` then `P.X._name`)."""
    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, aliases = [], {}  # aliases: a name the file binds -> the module of `known` it stands for
    for base, name, line, bound in _imports(module, path, tree):
        if name is None:
            target = base.split(".")[0] if bound == base.split(".")[0] else base  # `import P.X` binds P
        else:
            target = f"{base}.{name}"
            if private(name) and target not in known and owner(base) not in (None, module):
                found.append(f"{path.relative_to(root)}:{line} imports {name} from {base}")
        if bound and target in known:
            aliases[bound] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                dotted = ".".join([aliases[value.id]] + chain)
                if dotted in known and dotted != module:
                    found.append(f"{path.relative_to(root)}:{node.lineno} uses {dotted}.{node.attr}")
    return found


def test_the_underscore_check_sees_both_forms(tmp_path):
    """A check on the check: an underscore name imported, or read off an imported module, is caught."""
    (tmp_path / "helper.py").write_text("_x = 1\n")
    user = tmp_path / "user.py"
    user.write_text("import perfsim.search\nfrom helper import _x\nimport helper as h\n"
                    "print(h._x, perfsim.search._hidden, h.__name__)\n")
    known = {**MODULES, "helper": tmp_path / "helper.py", "user": user}
    assert _underscore_uses(user, "user", known, tmp_path) == [
        "user.py:2 imports _x from helper", "user.py:4 uses helper._x", "user.py:4 uses perfsim.search._hidden"]


def test_no_file_takes_another_modules_underscore_name():
    files = [(path, module, MODULES) for module, path in MODULES.items()]
    for folder in SCRIPTS:
        local = {path.stem: path for path in sorted((ROOT / folder).glob("*.py"))}
        files += [(path, stem, {**MODULES, **local}) for stem, path in local.items()]
    found = [use for path, module, known in files for use in _underscore_uses(path, module, known)]
    assert not found, "names used across modules are public; make these so:\n" + "\n".join(found)
