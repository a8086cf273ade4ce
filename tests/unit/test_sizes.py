"""The size limits of issue 20 stay in place: no class in hvdcomp/ over 250 lines, and no
module of a door (hvdcomp/torch/, hvdcomp/ddp/: the wiring of the drop-in optimizer and of
the DDP hook; the lifecycle they share lives in hvdcomp/exchange/) over 300 lines.

A class's length is its span in the source, decorators excluded: ``end_lineno - lineno + 1``
of its ``ast.ClassDef`` (nested classes count inside their parent too).  Read with ``ast``:
no module is imported.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "hvdcomp")
MAX_CLASS_LINES = 250
MAX_DOOR_LINES = 300
DOORS = ("torch", "ddp")


def class_spans(source: str, path: str = "<source>"):
    """[(lines, name, first line)] of every class in ``source``."""
    return [(n.end_lineno - n.lineno + 1, n.name, n.lineno)
            for n in ast.walk(ast.parse(source, path)) if isinstance(n, ast.ClassDef)]


def _sources(top):
    for d, _, files in os.walk(top):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    yield os.path.relpath(path, ROOT), fh.read()


def test_class_spans_counts_lines_as_the_limit_means():
    src = ("import x\n"
           "@decorated\n"
           "class A:\n"              # line 3
           "    '''doc'''\n"
           "\n"
           "    class B:\n"          # line 6
           "        y = 1\n"         # line 7
           "    def f(self):\n"
           "        return 2\n"      # line 9: A ends here
           "z = 3\n")
    assert sorted(class_spans(src)) == [(2, "B", 6), (7, "A", 3)]


def test_no_class_over_the_limit():
    over = [f"{path}:{line} {name}: {n} lines"
            for path, src in _sources(PKG) for n, name, line in class_spans(src, path)
            if n > MAX_CLASS_LINES]
    assert not over, f"classes over {MAX_CLASS_LINES} lines (split them): {over}"


def test_no_door_module_over_the_limit():
    modules = [(path, len(src.splitlines()))
               for door in DOORS for path, src in _sources(os.path.join(PKG, door))]
    assert any(p.endswith(os.path.join("torch", "optimizer.py")) for p, _ in modules)
    assert any(p.endswith(os.path.join("ddp", "state.py")) for p, _ in modules)
    over = [f"{path}: {n} lines" for path, n in modules if n > MAX_DOOR_LINES]
    assert not over, (f"door modules over {MAX_DOOR_LINES} lines (the shared lifecycle "
                      f"belongs in hvdcomp/exchange): {over}")
