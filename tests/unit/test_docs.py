"""The docs build: every relative link in README.md and docs/*.md resolves (to a file, and
a #anchor to one of its headings); every code block marked ``<!-- runs -->`` runs; every
README snippet marked ``<!-- from examples/X.py -->`` is made of lines of that file; the
README's compressor table quotes the registry's defaults and its "Does it pay?" table is
docs/performance.md's; docs/compressors.md's generated half is what docs/gen_compressors.py
gives from the registry.  (The examples themselves run in tests/launch/test_examples.py.)"""
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import hvdcomp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))

_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")
_MARK = re.compile(r"<!--\s*(runs|from\s+(\S+))\s*-->\s*\n```")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _gen():
    spec = importlib.util.spec_from_file_location(
        "gen_compressors", os.path.join(ROOT, "docs", "gen_compressors.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set:
    """Every heading's anchor (repeated headings get -1, -2, ... as on GitHub)."""
    seen, out = {}, set()
    for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _FENCE.sub("", text), re.M):
        s = slug(h.replace("`", ""))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(text: str):
    """Link targets outside code blocks and code spans."""
    prose = re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))
    return [m.group(2) for m in _LINK.finditer(prose)]


def marked_blocks(text: str):
    """(marker, argument, info string, code) of every fenced block right after a marker."""
    out = []
    for m in _MARK.finditer(text):
        block = _FENCE.match(text, m.end() - 3)
        assert block, f"marker {m.group(0)!r} is not followed by a fenced block"
        kind = "runs" if m.group(1) == "runs" else "from"
        out.append((kind, m.group(2), block.group(1).strip(), block.group(2)))
    return out


# --- the link checker itself, on hand-made cases ---------------------------------------------

def test_slug_and_links_on_hand_made_text():
    assert slug("Horovod 0.28.1's shut-down deadlock") == "horovod-0281s-shut-down-deadlock"
    assert slug("Under torchrun (the DDP hook)") == "under-torchrun-the-ddp-hook"
    assert slug("Does it pay?") == "does-it-pay"
    text = "# A b\n\n## A b\n\n```\n# not a heading [x](nowhere.md)\n```\nsee [y](z.md#q) `[w](v)`\n"
    assert anchors(text) == {"a-b", "a-b-1"}
    assert links(text) == ["z.md#q"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    text = _read(page)
    bad = []
    for target in links(text):
        if re.match(r"[a-z]+:", target):              # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(dest):
            bad.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(_read(dest)):
            bad.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not bad, "\n".join(bad)


# --- code blocks -------------------------------------------------------------------------------

RUNNABLE = [(os.path.relpath(p, ROOT), i, info, code)
            for p in PAGES for i, (kind, _, info, code) in enumerate(marked_blocks(_read(p)))
            if kind == "runs"]


def test_some_blocks_are_marked_runnable():
    assert len(RUNNABLE) >= 2, RUNNABLE


@pytest.mark.parametrize("page,i,info,code", RUNNABLE, ids=lambda v: str(v)[:30])
def test_marked_block_runs(page, i, info, code):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if info.split()[0] == "python":
        cmd = [sys.executable, "-c", code]
    elif info.split()[0] in ("bash", "sh"):
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        pytest.fail(f"{page}: block {i} is marked runnable but its language is {info!r}")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{page}, block {i}:\n{code}\n{p.stdout[-2000:]}{p.stderr[-3000:]}"


def test_readme_snippets_are_lines_of_the_examples():
    blocks = [(arg, code) for kind, arg, _, code in marked_blocks(_read(PAGES[0]))
              if kind == "from"]
    assert sorted(a for a, _ in blocks) == ["examples/minimal_ddp.py",
                                            "examples/minimal_horovod.py"]
    for path, code in blocks:
        lines = {ln.rstrip() for ln in _read(os.path.join(ROOT, path)).splitlines()}
        missing = [ln for ln in code.splitlines() if ln.strip() and ln.rstrip() not in lines]
        assert not missing, f"README lines not in {path}:\n" + "\n".join(missing)


# --- the compressors ---------------------------------------------------------------------------

def _own():
    return [n for n in hvdcomp.available()
            if type(hvdcomp.get(n)).__module__.startswith("hvdcomp.")]


def test_compressors_page_is_what_the_generator_gives():
    gen = _gen()
    head, tail = gen.page_parts(_read(os.path.join(ROOT, "docs", "compressors.md")))
    assert tail == gen.render(), "run: python docs/gen_compressors.py"
    for name in _own():                  # every compressor has its section and its defaults
        assert f"\n### {name}\n" in tail
        assert f"`{hvdcomp.get(name).spec()}`" in tail


def test_generator_reads_settings_from_docstrings():
    """Args items, continuation lines, a paragraph entry ending at its sentence, an entry
    named mid-line, and two settings sharing one entry; hand-worked."""
    doc = '''Summary.

    Args:
      bits: code width,
        sign included.
      a, b: shared text.
    grad: not a setting.

    mode: "x" or
    "y" (default).  norm: "l2".
    Other prose.
    '''
    got = _gen().setting_docs(doc, ["bits", "a", "b", "mode", "norm"])
    assert got == {"bits": "code width, sign included.", "a": "shared text.",
                   "b": "shared text.", "mode": '"x" or "y" (default).', "norm": '"l2".'}


def _readme_section(title):
    text = _read(PAGES[0])
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_readme_compressor_table_quotes_the_registry():
    rows = [ln for ln in _readme_section("Compressors").splitlines()
            if ln.startswith("| `")]
    listed = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([a-z0-9]+)`", cells[0])
        listed += names
        for key, value, only in re.findall(r"`(\w+)=([^`]+)`(?: \((\w+)\))?", cells[-1]):
            for name in ([only] if only else names):
                settings = hvdcomp.get(name).settings()
                assert key in settings, (name, key)
                v = settings[key]
                shown = "/".join(map(str, v)) if isinstance(v, tuple) else str(v)
                assert shown == value, f"README: {name} {key}={value}, registry: {shown}"
    assert sorted(listed) == sorted(_own())


def test_readme_does_it_pay_table_is_the_performance_page_s():
    """One table (issue 20, item 5): the real task's time to accuracy against fp16 and
    PowerSGD (issue 21); every row is docs/performance.md's, to the letter."""
    rows = [ln for ln in _readme_section("Does it pay?").splitlines() if ln.startswith("|")]
    headers = [r for i, r in enumerate(rows) if i + 1 < len(rows)
               and set(rows[i + 1]) <= set("|-: ")]
    assert len(headers) == 1 and "PowerSGD" in headers[0], headers
    assert 3 <= len(rows) <= 6, rows
    perf = _read(os.path.join(ROOT, "docs", "performance.md")).splitlines()
    for row in rows:
        assert row in perf, row


def test_compressors_page_what_each_sends_lists_every_compressor():
    text = _read(os.path.join(ROOT, "docs", "compressors.md"))
    start = text.index("\n## What each one sends\n")
    section = text[start:text.index("\n## ", start + 1)]
    listed = [n for row in section.splitlines() if row.startswith("| `")
              for n in re.findall(r"`([a-z0-9]+)`", row.split("|")[1])]
    assert sorted(listed) == sorted(_own())


def test_compressors_page_spec_prefixes_table_lists_every_prefix():
    """Newcomer trial item 3: the "Spec prefixes" table names the prefixes the exchange
    reads (hvdcomp.compressors.prefixes), each once, in their order."""
    from hvdcomp.compressors import prefixes
    text = _read(os.path.join(ROOT, "docs", "compressors.md"))
    start = text.index("\n### Spec prefixes\n")
    section = text[start:text.index("\n## ", start + 1)]
    listed = [row.split("|")[1].strip().strip("`") for row in section.splitlines()
              if row.startswith("| `")]
    assert listed == list(prefixes.MEANING)
    assert prefixes.ORDER in section


def test_settings_page_signatures_and_hierarchy_default_match_the_code():
    """Newcomer trial item 6: the signatures docs/settings.md shows carry the code's
    defaults, and the hierarchy's default is described as the code resolves it (None: the
    spec string's prefix, else "auto")."""
    import inspect
    hvd = pytest.importorskip("hvdcomp.torch")
    from hvdcomp.ddp import HookState
    from hvdcomp.exchange.driver import merge_hierarchy
    text = _read(os.path.join(ROOT, "docs", "settings.md"))
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    opt_src, hook_src = block.split("hvdcomp.ddp.HookState(")
    for src, fn in ((opt_src, hvd.DistributedOptimizer), (hook_src, HookState)):
        shown = dict(re.findall(r"(\w+)=([^,)\n]+)", src))
        params = inspect.signature(fn).parameters
        assert shown and set(shown) <= set(params), (fn, set(shown) - set(params))
        for name, default in shown.items():
            assert eval(default, {"hvd": hvd}) == params[name].default, (fn, name)
    assert merge_hierarchy(None, "alq:bits=3") == "auto"
    assert merge_hierarchy(None, "host+alq:bits=3") == "host"
    assert ("the default, `None`, takes the spec string's prefix, else `\"auto\"`"
            in " ".join(text.split()))


def test_readme_is_short():
    """Issue 20, item 5: a README a newcomer reads in two minutes (at most ~150 lines, with
    room for a new compressor's row; everything else lives in docs/)."""
    assert len(_read(os.path.join(ROOT, "README.md")).splitlines()) <= 160
