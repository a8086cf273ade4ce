"""hvdcomp's modules import each other without cycles, and its layers point one way.

Every import statement counts, wherever it stands (module level or inside a function: an
import moved into a function to dodge a cycle is still a cycle).  The graph is built from
the source with ``ast``, so no module is executed.
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "hvdcomp")

# Lower layers must not import higher ones (docs/design.md, "Layers"); the same table.
LAYERS = [  # top first
    {"hvdcomp.torch", "hvdcomp.ddp", "hvdcomp.cli", "hvdcomp.__main__", "hvdcomp.selftest"},
    {"hvdcomp.exchange", "hvdcomp.auto"},
    {"hvdcomp.transport"},
    {"hvdcomp.compressors"},
    {"hvdcomp.codecs", "hvdcomp.levels"},
    {"hvdcomp.ops"},
    {"hvdcomp.backends"},
    {"hvdcomp.wire", "hvdcomp.philox", "hvdcomp.errors", "hvdcomp.log"},  # every layer's
]


def _design_layers():
    """The modules of each row of the "Layers" table of docs/design.md, top first."""
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| layer ")]
    return [set(re.findall(r"`(hvdcomp[\w.]*)`", cell)) for cell in rows]


def _modules():
    """{module name: path} of every .py file under hvdcomp/."""
    mods = {}
    for d, _, files in os.walk(PKG):
        if "__pycache__" in d:
            continue
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                mods[".".join(rel)] = os.path.join(d, f)
    return mods


def _imports(name, path, mods):
    """The hvdcomp modules that ``name`` imports anywhere in its source."""
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = ".".join(base[:len(base) - node.level + 1])
                mod = pkg + ("." + node.module if node.module else "")
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule sub when it is one.
            targets = [mod + "." + a.name if mod + "." + a.name in mods else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:          # `import hvdcomp.x.y` -> the module that exists
                t = t.rpartition(".")[0]
            if t.startswith("hvdcomp") and t != name:
                out.add(t)
    return out


def _graph():
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _layer(mod):
    for i, layer in enumerate(LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in layer):
            return i
    return None


def test_the_checker_finds_a_cycle_and_a_function_level_import(tmp_path):
    """The checker itself: a two-module cycle hidden inside a function is found."""
    g = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycles(g) == [["a", "b"]]
    pkg = tmp_path / "hvdcomp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("from . import y\n")
    (pkg / "y.py").write_text("def f():\n    from .x import g\n")
    mods = {"hvdcomp": str(pkg / "__init__.py"), "hvdcomp.x": str(pkg / "x.py"),
            "hvdcomp.y": str(pkg / "y.py")}
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert graph["hvdcomp.x"] == {"hvdcomp.y"} and graph["hvdcomp.y"] == {"hvdcomp.x"}
    assert _cycles(graph) == [["hvdcomp.x", "hvdcomp.y"]]


def test_the_layers_are_the_design_docs_table():
    """LAYERS is the table of docs/design.md, "Layers", row for row (the entry point
    ``hvdcomp.__main__`` is left out of the table: it sits with the doors)."""
    assert _design_layers() == [layer - {"hvdcomp.__main__"} for layer in LAYERS]


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 40          # the walk found the package
    assert _cycles(graph) == []


@pytest.mark.parametrize("low", range(1, len(LAYERS)))
def test_layers_point_down(low):
    """No module of a layer imports a module of a higher layer."""
    bad = [(m, t) for m, ts in _graph().items() if _layer(m) == low
           for t in ts if _layer(t) is not None and _layer(t) < low]
    assert bad == []
