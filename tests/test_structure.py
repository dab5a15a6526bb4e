"""The shape of the code: no import circle in the engine or the nodes (imports inside functions count too), and the
detector that says so finds a circle when there is one."""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = ("tpu_runtime", "nodes")


def module_names(root: Path, packages) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under ``packages`` (a package is its ``__init__``)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports, from the source: every ``import`` and ``from ... import``
    anywhere in the file (inside functions too), relative ones resolved. ``from P import name`` is an import of
    ``P.name`` when that is a module, else of ``P``; importing a module does not count as importing its parent
    package (Python runs the parent's ``__init__`` first, but depends on nothing the module names)."""
    modules = module_names(root, packages)
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                for alias in node.names:
                    full = f"{prefix}.{alias.name}"
                    targets.append(full if full in modules else prefix)
            for target in targets:
                while target and target not in modules:  # "a.b.c" of an import of a name inside a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_pack():
    graph = import_graph(ROOT)
    assert len(graph) > 30  # the walk really saw the package
    assert "tpu_runtime.engine.runtime" in graph["tpu_runtime.engine.family"]
    assert cycles(graph) == []


def test_the_engine_imports_only_the_multihost_hook():
    """The engine knows no family and, of the multi-host layer, only the small hook module."""
    graph = import_graph(ROOT)
    for module, imports in graph.items():
        if module.startswith("tpu_runtime.engine"):
            assert not any(m.startswith("tpu_runtime.families") for m in imports), module
            assert {m for m in imports if m.startswith("tpu_runtime.multihost")} <= {"tpu_runtime.multihost.hooks"}, \
                module


def test_the_detector_finds_a_circle(tmp_path):
    """A synthetic package: a -> b at module level, b -> a inside a function (relative), c -> a; and a package
    whose __init__ imports a submodule that imports the package's other module back."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import thing\n    return thing\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "sub" / "__init__.py").write_text("from .x import y\n")
    (pkg / "sub" / "x.py").write_text("from ..sub.z import w\n")
    (pkg / "sub" / "z.py").write_text("def g():\n    from pkg.sub import x\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.c"] == {"pkg.a"}
    found = cycles(graph)
    assert ["pkg.a", "pkg.b"] in found
    assert ["pkg.sub.x", "pkg.sub.z"] in found
    (pkg / "b.py").write_text("def f():\n    return 1\n")
    (pkg / "sub" / "z.py").write_text("w = 1\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == []
