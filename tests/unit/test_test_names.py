"""Every test module has a basename of its own: the test directories are not packages, so
pytest imports each module by its basename, and two of the same name stop the whole run at
collection ("import file mismatch")."""
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_test_modules_have_unique_basenames():
    seen = collections.defaultdict(list)
    for d, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                seen[f].append(os.path.relpath(os.path.join(d, f), ROOT))
    assert not {f: p for f, p in seen.items() if len(p) > 1}
    assert len(seen) > 50        # (it looked at the suite)
