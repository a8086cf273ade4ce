"""The exchange core and the doors know compressors only through the contract: no module under
hvdcomp/exchange, hvdcomp/auto.py, hvdcomp/ddp/ or hvdcomp/torch/ imports a concrete
compressor class (issue 20, item 2).  What they may take from hvdcomp.compressors: the base
contract (Compressor, TensorKey and its AVERAGE_SUFFIX, the ABSENT_* values of
``Compressor.absent_rank``), the
registry functions (get, available, parse_spec, register, registry, examples), and the
helper modules that hold no compressor (protocols, state, settings, prefixes).  Everything
else a core module needs is a declared property of the compressor (hvdcomp/compressors/base.py).

The source is read with ``ast`` (nothing is executed): ``from ... import`` statements,
``import`` statements, and attribute access on a name bound to a compressors module.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = "hvdcomp.compressors"
CONTRACT = {"Compressor", "TensorKey", "get", "available", "parse_spec", "register",
            "registry", "examples", "ABSENT_ZEROS", "ABSENT_LAST", "ABSENT_REFUSE",
            "AVERAGE_SUFFIX"}
# {module: names allowed from it (None: any)}
ALLOWED = {PKG: CONTRACT, PKG + ".base": CONTRACT, PKG + ".protocols": None,
           PKG + ".state": None, PKG + ".settings": None, PKG + ".prefixes": None}


def _core_modules():
    """{module name: path} of the modules that must not name a compressor class."""
    out = {}
    for sub in ("exchange", "torch", "ddp"):
        d = os.path.join(ROOT, "hvdcomp", sub)
        for f in sorted(os.listdir(d)):
            if f.endswith(".py"):
                name = f"hvdcomp.{sub}" + ("" if f == "__init__.py" else "." + f[:-3])
                out[name] = os.path.join(d, f)
    out["hvdcomp.auto"] = os.path.join(ROOT, "hvdcomp", "auto.py")
    return out


def _absolute(module_name, is_pkg, node):
    """The absolute module of an ImportFrom node inside ``module_name``."""
    if not node.level:
        return node.module or ""
    base = module_name.split(".") if is_pkg else module_name.split(".")[:-1]
    pkg = ".".join(base[:len(base) - node.level + 1])
    return pkg + ("." + node.module if node.module else "")


def violations(module_name, source, is_pkg=False):
    """The imports of a concrete compressor (or of a family module) in ``source``."""
    bad, bound = [], {}             # bound: local name -> compressors module it stands for
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(module_name, is_pkg, node)
            for a in node.names:
                full = mod + "." + a.name
                if full == PKG or (mod == PKG and full in ALLOWED):
                    bound[a.asname or a.name] = full        # a module: its attributes checked
                elif mod == PKG or mod.startswith(PKG + "."):
                    allowed = ALLOWED.get(mod, set())        # a family module: nothing
                    if allowed is not None and a.name not in allowed:
                        bad.append(f"from {mod} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PKG + ".") and a.name not in ALLOWED:
                    bad.append(f"import {a.name}")
                elif a.name in ALLOWED and a.asname:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound):
            allowed = ALLOWED.get(bound[node.value.id], set())
            if allowed is not None and node.attr not in allowed:
                bad.append(f"{node.value.id}.{node.attr} ({bound[node.value.id]})")
    return bad


@pytest.mark.parametrize("name,path", sorted(_core_modules().items()))
def test_core_module_imports_no_compressor_class(name, path):
    src = open(path).read()
    assert violations(name, src, path.endswith("__init__.py")) == []


def test_the_walk_finds_each_way_of_naming_a_class():
    m = "hvdcomp.exchange.x"
    assert violations(m, "from ..compressors import FP16, Compressor, get") == [
        "from hvdcomp.compressors import FP16"]
    assert violations(m, "from ..compressors.quantizers import Finer") == [
        "from hvdcomp.compressors.quantizers import Finer"]
    assert violations(m, "from hvdcomp.compressors.psq import rows_of") == [
        "from hvdcomp.compressors.psq import rows_of"]
    assert violations(m, "import hvdcomp.compressors.sparsifiers") == [
        "import hvdcomp.compressors.sparsifiers"]
    assert violations(m, "from .. import compressors\nx = compressors.LAQ") == [
        "compressors.LAQ (hvdcomp.compressors)"]
    assert violations(m, "import hvdcomp.compressors as c\nc.get('none'); c.DGC") == [
        "c.DGC (hvdcomp.compressors)"]
    assert violations("hvdcomp.auto", "from .compressors import TensorKey, NoneCompressor") \
        == ["from hvdcomp.compressors import NoneCompressor"]
    # what the contract allows
    assert violations(m, "from ..compressors import Compressor, TensorKey, get, ABSENT_LAST\n"
                         "from ..compressors.protocols import AdaptiveLevels\n"
                         "from ..compressors.state import finite") == []
