"""The shape of the code, measured: no import circle in the engine or the nodes (imports inside functions count
too), and the detector that says so finds a circle when there is one; no import running back up the layers; the
modules every family shares name no family; no class over 400 lines, no function over 80."""

import ast
import io
import re
import tokenize
from pathlib import Path

from conftest import ROOT

PACKAGES = ("tpu_runtime", "nodes")

# The layers, lowest first: a module imports only its own layer's and lower ones. The native bridge (ComfyUI's own
# models on the runtime) sits on the engine and the multi-host layer; the package's own __init__ and __main__ are
# the entry points above all.
LAYERS = {"errors": 0, "_torchax_compat": 0, "engine": 1, "families": 2, "multihost": 3, "bridge": 4, "tools": 5,
          "nodes": 6}
# What every family shares: no family is named in their code or messages.
SHARED = ("tpu_runtime/engine", "tpu_runtime/multihost", "tpu_runtime/tools", "nodes")
# The native bridge's own modules (it runs ComfyUI's model classes, which carry the models' names), counted apart:
# its structure is its own issue's.
BRIDGE = ("tpu_runtime/bridge/", "nodes/bridge.py", "nodes/comfy_bridge.py", "tpu_runtime/multihost/bridge.py",
          "tpu_runtime/tools/plan_native.py", "tpu_runtime/tools/bench_native.py")
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 80


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


def layer(module: str) -> str | None:
    parts = module.split(".")
    return "nodes" if parts[0] == "nodes" else parts[1] if len(parts) > 1 else None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, what it imports) for every import of a higher layer than the module's own."""
    return sorted((m, t) for m, imports in graph.items() for t in imports
                  if layer(m) in LAYERS and layer(t) in LAYERS and LAYERS[layer(t)] > LAYERS[layer(m)])


def test_no_import_runs_back_up_the_layers():
    """The engine knows no family, no multi-host layer, no bridge, no tool; the families know no tool, and so on."""
    graph = import_graph(ROOT)
    assert "tpu_runtime.families.registry" in graph["tpu_runtime.multihost.worker"]  # the walk saw the layers
    assert upward_imports(graph) == []
    assert upward_imports({"tpu_runtime.engine.x": {"tpu_runtime.multihost.y"}}) == [
        ("tpu_runtime.engine.x", "tpu_runtime.multihost.y")]


def family_words(text: str) -> set[str]:
    """The words of a name or a message: identifiers split at underscores, case changes and digits."""
    return {w.lower() for w in re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+", text)}


def names_a_family(text: str, names: list[str]) -> bool:
    """Whether ``text`` names one of the families ``names`` (each family's name and display name): a long name
    anywhere in it once separators are dropped ("LTX-2" in "LTX2Family"), a short one as a word ("Wan" in "Wan2.1"
    but not in "swan")."""
    joined = re.sub(r"[^a-z0-9]", "", text.lower())
    words = family_words(text)
    return any(n in joined if len(n) >= 4 else n in words for n in names)


def family_mentions(path: Path, names: list[str]) -> list[tuple[int, str]]:
    """(line, token) for every identifier and string (docstrings aside) of the module ``path`` naming a family."""
    source = path.read_text()
    docstrings = {node.body[0].lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                  and isinstance(node.body[0].value.value, str)}
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type in (tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1))
            and not (tok.type == tokenize.STRING and tok.start[0] in docstrings) and names_a_family(tok.string, names)]


def shared_modules_naming_a_family(root: Path = ROOT) -> dict[str, list]:
    from tpu_runtime.families import registry

    names = sorted({re.sub(r"[^a-z0-9]", "", n.lower()) for s in registry.FAMILIES for n in (s.name, s.display_name)})
    found = {}
    for folder in SHARED:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            mentions = family_mentions(path, names)
            if mentions and not relative.startswith(BRIDGE):
                found[relative] = mentions
    return found


def test_at_most_two_shared_modules_name_a_family():
    """A family is a package and a declaration: at most two of the modules every family shares name one (in code
    or in a message), so a new family changes none of them."""
    found = shared_modules_naming_a_family()
    assert len(found) <= 2, found
    assert names_a_family("LTX2Family", ["ltx2"]) and names_a_family('"Wan2.1-FLF2V"', ["wan"])
    assert not names_a_family("answer", ["wan"]) and not names_a_family("LTX-Video", ["ltx2"])


def sizes(root: Path = ROOT, packages=PACKAGES) -> tuple[list, list]:
    """(lines, "file:name") of every class and every function of ``packages`` (the bridge's apart), longest
    first."""
    classes, functions = [], []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.relative_to(root).as_posix().startswith(BRIDGE):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                entry = (node.end_lineno - node.lineno + 1, f"{path.relative_to(root)}:{node.name}") \
                    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
                if isinstance(node, ast.ClassDef):
                    classes.append(entry)
                elif entry is not None:
                    functions.append(entry)
    return sorted(classes, reverse=True), sorted(functions, reverse=True)


def test_no_class_over_400_lines_and_no_function_over_80():
    classes, functions = sizes()
    assert classes and functions
    assert [c for c in classes if c[0] > MAX_CLASS_LINES] == []
    assert [f for f in functions if f[0] > MAX_FUNCTION_LINES] == []


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
