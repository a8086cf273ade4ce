"""docs/adding-a-compressor.md, part B, lists every file a compressor shipped with hvdcomp
touches: add one to a temporary copy of the checkout by editing exactly those files, and
check that (1) before the listed edits the registry's own checks fail, (2) after them they
pass, the new compressor's tests pass, and every list that the tests, the DDP golden run,
bench/codec_speed.py and the selftest run holds it, and (3) the files changed are the
table's, no more and no fewer."""
import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DOC = os.path.join(ROOT, "docs", "adding-a-compressor.md")

NAME, FAMILY, CODEC = "signl1", "signl1", 28      # the next free id below 128

# what the checks below need of the checkout
COPIED = ["hvdcomp", "kernels", "docs", "bench/codec_speed.py", "pyproject.toml", "README.md",
          "tests/unit/test_docs.py",
          "tests/conftest.py", "tests/unit/test_codec_ids.py",
          "tests/unit/test_core_names_no_compressor.py", "tests/ddp/golden.py"]

MODULE = f'''"""Scaled sign with one l1 scale per tensor (Bernstein et al. 2018, signSGD, Sec. 3): a
tensor g of n elements is sent as s = mean(|g|) (float32) and the bits g_i >= 0."""
import numpy as np
import torch

from ..errors import WireFormatError
from .base import Compressor, numel_of, register


@register("{NAME}", codec={CODEC})
class SignL1(Compressor):
    """grad: any shape, floating dtype.  Payload: 4 + ceil(numel / 8) bytes."""
    example = "{NAME}"

    def __init__(self):
        pass

    def shard_unit(self, shape) -> int:
        return 1

    def _header_fields(self):
        return {{"bits": 1, "bucket_size": 0, "level_version": 0}}

    def message_bytes(self, shape) -> int:
        return 4 + (numel_of(shape) + 7) // 8

    def _encode(self, grad, key):
        g = grad.detach().reshape(-1).to(torch.float32).cpu().numpy()
        scale = np.float32(np.abs(g).mean()) if g.size else np.float32(0)
        bits = np.packbits(g >= 0, bitorder="little")
        return self._new_message(grad, key, (np.array([scale]).view(np.uint8), bits))

    def _decode(self, msg, key, out):
        msg.expect(nsections=2)
        msg.section_size_check(0, 4, "scale")
        msg.section_size_check(1, (msg.numel + 7) // 8, "sign bits")
        scale = np.frombuffer(bytes(msg.sections[0]), dtype=np.float32)[0]
        if not np.isfinite(scale) or scale < 0:
            raise WireFormatError("{NAME}: bad scale")
        bits = np.unpackbits(np.frombuffer(bytes(msg.sections[1]), dtype=np.uint8),
                             count=msg.numel, bitorder="little")
        out.add_(torch.from_numpy(bits.astype(np.float32) * 2 - 1).to(out.device)
                 * float(scale))
'''

TEST = f'''import torch

import hvdcomp
from hvdcomp.wire import Message


def test_hand_worked(make_key):
    c = hvdcomp.get("{NAME}")
    key = make_key()
    msg = Message.from_bytes(c.encode(torch.tensor([0.5, -1.5, 0.0, 2.0, -1.0]), key).to_bytes())
    assert msg.codec == {CODEC} and bytes(msg.sections[1]) == bytes([0b01101])
    out = torch.zeros(5)
    c.decode(msg, key, out)
    assert out.tolist() == [1.0, -1.0, 1.0, 1.0, -1.0]
'''

LISTS = f'''import sys
sys.argv = ["x"]
sys.path[:0] = ["tests/ddp", "bench"]
import hvdcomp, hvdcomp.selftest, golden, codec_speed
from hvdcomp.compressors import examples
from hvdcomp.exchange.shards import refusal
assert examples()["{NAME}"] == "{NAME}"
assert "{NAME}" in golden.COMPRESSORS and "{NAME}" in hvdcomp.selftest.SPECS
assert "{NAME}" in codec_speed.METHODS
assert refusal(hvdcomp.get("{NAME}")) is None
print("lists OK")
'''


def _table_files():
    """The files of part B's first table (``<family>`` as FAMILY)."""
    text = open(DOC).read()
    part = text[text.index("## B."):]
    part = part[:part.index("Optional:")]
    return {m.replace("<family>", FAMILY) for m in re.findall(r"^\| `([^`]+)` \|", part, re.M)}


def _digests(root):
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", ".pytest_cache")]
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _run(copy, *args):
    env = dict(os.environ, PYTHONPATH=copy)
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=600)


def _pytest(copy, *paths):
    return _run(copy, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths)


def test_the_listed_files_are_all_a_new_compressor_touches(tmp_path):
    copy = str(tmp_path / "checkout")
    for rel in COPIED:
        src, dst = os.path.join(ROOT, rel), os.path.join(copy, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.isdir(src):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst)
    before = _digests(copy)

    # the class, in a family module of its own
    with open(os.path.join(copy, "hvdcomp", "compressors", f"{FAMILY}.py"), "w") as f:
        f.write(MODULE)
    # (1) the registry's checks fail until the listed edits are made
    p = _pytest(copy, "tests/unit/test_codec_ids.py")
    assert p.returncode != 0 and "test_builtin_ids_are_the_frozen_table" in p.stdout, \
        p.stdout[-3000:]
    assert "test_wire_format_doc_holds_the_registrys_codec_table" in p.stdout

    # (2) the listed edits: the frozen id, the wire format's codec table and section, tests
    ids = os.path.join(copy, "tests", "unit", "test_codec_ids.py")
    src = open(ids).read()
    assert '    "coo": 25,\n' in src
    open(ids, "w").write(src.replace('    "coo": 25,\n', f'    "coo": 25, "{NAME}": {CODEC},\n'))
    table = _run(copy, "-c", "from hvdcomp.compressors.listing import wire_codec_table as t; "
                             "print(t())")
    assert table.returncode == 0, table.stderr
    doc = os.path.join(copy, "docs", "wire-format.md")
    text = open(doc).read()
    begin = text.index("<!-- codec table")
    end = text.index("<!-- end of codec table -->") + len("<!-- end of codec table -->")
    text = text[:begin] + table.stdout.strip() + text[end:]
    text = text.replace("## Sections by codec\n\n", "## Sections by codec\n\n"
                        f"* `{NAME}`: 0. the scale, float32; 1. the sign bits.\n", 1)
    open(doc, "w").write(text)
    os.makedirs(os.path.join(copy, "tests", "compressors"), exist_ok=True)
    with open(os.path.join(copy, "tests", "compressors", f"test_{FAMILY}.py"), "w") as f:
        f.write(TEST)

    # the README's table, the compressors page's table and its generated settings section
    readme = os.path.join(copy, "README.md")
    text = open(readme).read()
    row = "| `topk`, `randk` |"
    assert row in text
    open(readme, "w").write(text.replace(
        row, f"| `{NAME}` | signs and one l1 scale | Bernstein et al. 2018 | none |\n" + row, 1))
    page = os.path.join(copy, "docs", "compressors.md")
    text = open(page).read()
    row = "| `topk`, `randk` |"
    assert row in text
    open(page, "w").write(text.replace(
        row, f"| `{NAME}` | signs and one l1 scale | | 1 bit |\n" + row, 1))
    gen = _run(copy, "docs/gen_compressors.py")
    assert gen.returncode == 0, gen.stderr

    p = _pytest(copy, "tests/unit/test_codec_ids.py", "tests/unit/test_core_names_no_compressor.py",
                f"tests/compressors/test_{FAMILY}.py", "tests/unit/test_docs.py", "-k",
                f"not relative_links and not marked_block and not snippets and not does_it_pay")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = _run(copy, "-c", LISTS)
    assert p.returncode == 0 and "lists OK" in p.stdout, p.stdout + p.stderr[-3000:]

    # (3) exactly the table's files were changed or added
    after = _digests(copy)
    changed = {f for f in after if before.get(f) != after[f]}
    assert changed == _table_files(), (sorted(changed), sorted(_table_files()))


def test_the_table_names_the_files_this_test_edits():
    assert _table_files() == {f"hvdcomp/compressors/{FAMILY}.py", "tests/unit/test_codec_ids.py",
                              "docs/wire-format.md", f"tests/compressors/test_{FAMILY}.py",
                              "README.md", "docs/compressors.md"}
