"""compile_cache.memo: a successful check is answered from the cache under the same inputs,
a failed one runs every time, and a changed input runs again."""
import compile_cache


def test_memo_keeps_successes_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDCOMP_CACHE", str(tmp_path))
    monkeypatch.delenv("HVDCOMP_NO_COMPILE_CACHE", raising=False)
    calls = []

    def check(rc):
        def run():
            calls.append(rc)
            return rc, f"log {rc}"
        return run

    assert compile_cache.memo(["a", "-O1"], check(0)) == (0, "log 0", False)
    assert compile_cache.memo(["a", "-O1"], check(0)) == (0, "log 0", True)
    assert calls == [0]
    assert compile_cache.memo(["a", "-O2"], check(0)) == (0, "log 0", False)   # new input
    assert compile_cache.memo(["b"], check(3)) == (3, "log 3", False)
    assert compile_cache.memo(["b"], check(3)) == (3, "log 3", False)          # not kept
    assert calls == [0, 0, 3, 3]
    monkeypatch.setenv("HVDCOMP_NO_COMPILE_CACHE", "1")
    assert compile_cache.memo(["a", "-O1"], check(0)) == (0, "log 0", False)
    assert calls == [0, 0, 3, 3, 0]
