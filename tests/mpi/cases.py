"""Named cases for the multi-rank worker scripts.

A worker script declares its checks as functions::

    from cases import case, run

    @case
    def overlap(): ...                        # one case: "overlap"

    @case.each(SPECS, TRANSPORTS)             # one case per combination: "step[qsgd-mpi]"
    def step(spec, transport): ...

    if __name__ == "__main__":
        run()

and runs under mpirun (``launch/run -np N python worker_x.py [case ...]``; naming cases runs
only those).  :func:`run` initializes Horovod, then runs every case of the script itself
(not those of a worker it imports helpers from) on every rank in declaration order,
catching what each raises, and appends one JSON line per event to
``$HVDCOMP_TEST_OUT/rank<r>.jsonl`` as it goes (so a crash or a hang still leaves what each
rank had done, and which case it was in).  After each case the ranks meet in a barrier (a
Horovod allreduce of its own name), so no rank starts the next case's collectives while
another is still in this one; a rank that waits there longer than ``$HVDCOMP_CASE_WAIT``
seconds (default 120: some rank is stuck, typically in a collective that a failed rank
left) records that and aborts the job.

The pytest side (test_multirank.py) finds the case names without importing the worker
(:func:`discover` reads its source: ``case.each`` takes module-level literal lists), launches
each worker once per rank count, and turns every case into one pytest case that fails with
the ranks and messages of its failure (:class:`Report`).
"""
from __future__ import annotations

import ast
import itertools
import json
import os
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["case", "run", "registered", "discover", "launch", "Report"]

_REGISTRY: List[Tuple[str, Callable, tuple]] = []


def case_id(name: str, values: Sequence = ()) -> str:
    """``name`` or ``name[v1-v2...]``: the id of one case, on both sides."""
    return f"{name}[{'-'.join(str(v) for v in values)}]" if values else name


class _Case:
    """The ``@case`` decorator and its ``@case.each(*lists)`` form."""

    def __call__(self, fn: Callable) -> Callable:
        _REGISTRY.append((case_id(fn.__name__), fn, ()))
        return fn

    def each(self, *lists: Sequence) -> Callable:
        """One case per element of the product of ``lists`` (module-level literal lists of
        strings or numbers, or dicts: their keys); the function receives one element of
        each."""
        def register(fn: Callable) -> Callable:
            for values in itertools.product(*lists):
                _REGISTRY.append((case_id(fn.__name__, values), fn, values))
            return fn
        return register


case = _Case()


def registered(module: str) -> List[Tuple[str, Callable, tuple]]:
    """``(case id, function, values)`` of the cases the module named ``module`` declares, in
    order (for a script that runs another worker's cases itself: ``fn(*values)``)."""
    return [c for c in _REGISTRY if c[1].__module__ == module]


# --------------------------------------------------------------------------------------------
# under mpirun
# --------------------------------------------------------------------------------------------

class _Log:
    """This rank's event file: one JSON object a line, flushed at once."""

    def __init__(self, rank: int):
        out = os.environ.get("HVDCOMP_TEST_OUT")
        self.f = open(os.path.join(out, f"rank{rank}.jsonl"), "a") if out else None

    def write(self, **rec) -> None:
        if self.f is not None:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()


def _barrier(hvd, name: str, wait: float) -> bool:
    """All ranks meet: a Horovod allreduce of one element, polled; False if it has not
    completed within ``wait`` seconds.  (Through Horovod's thread: an MPI barrier called
    from this thread while Horovod's thread also calls MPI crashes Open MPI 4.1 now and
    then.)"""
    import torch
    handle = hvd.allreduce_async(torch.zeros(1), name=name)
    deadline = time.monotonic() + wait
    while not hvd.poll(handle):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    hvd.synchronize(handle)
    return True


def run(argv: Optional[Sequence[str]] = None) -> None:
    """Run the registered cases (all, or those named in ``argv``) on this rank; exit 1 if
    one failed here, 0 otherwise."""
    import horovod.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    names = list(sys.argv[1:] if argv is None else argv)
    # the cases of the script run (a worker may import another's helpers, and with them
    # its cases: those are not its own; discover() reads the script alone likewise)
    cases = [c for c in _REGISTRY if c[1].__module__ == "__main__"]
    known = [n for n, _, _ in cases]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; this worker has {known}")
    wait = float(os.environ.get("HVDCOMP_CASE_WAIT", "120"))
    log = _Log(rank)
    failed = 0
    for k, (name, fn, values) in enumerate(cases):
        if names and name not in names:
            continue
        log.write(event="start", case=name)
        t0 = time.perf_counter()
        try:
            fn(*values)
            ok, error, tb = True, "", ""
        except Exception as e:                  # noqa: BLE001  (reported, then on to the next)
            ok, error, tb = False, f"{type(e).__name__}: {e}", traceback.format_exc()
            failed += 1
            print(f"[rank {rank}/{size}] FAILED {name}: {error}\n{tb}", file=sys.stderr,
                  flush=True)
        log.write(event="end", case=name, ok=ok, error=error, traceback=tb,
                  seconds=round(time.perf_counter() - t0, 3))
        if not _barrier(hvd, f"hvdcomp.tests.case.{k}", wait):
            log.write(event="abandoned", case=name, waited=wait)
            print(f"[rank {rank}/{size}] other ranks did not finish {name} within {wait:.0f} s "
                  f"of this one: aborting", file=sys.stderr, flush=True)
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(3)
    log.write(event="done", failed=failed)
    print(f"[rank {rank}/{size}] {sys.argv[0]}: {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


# --------------------------------------------------------------------------------------------
# on the pytest side
# --------------------------------------------------------------------------------------------

def discover(path: str) -> List[str]:
    """The case ids a worker script declares, in order, read from its source."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    ids = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for d in node.decorator_list:
            if isinstance(d, ast.Name) and d.id == "case":
                ids.append(case_id(node.name))
            elif isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) \
                    and d.func.attr == "each" and isinstance(d.func.value, ast.Name) \
                    and d.func.value.id == "case":
                lists = []
                for a in d.args:
                    if isinstance(a, ast.Name) and a.id in consts:
                        lists.append(consts[a.id])
                    else:
                        try:
                            lists.append(ast.literal_eval(a))
                        except ValueError:
                            raise ValueError(f"{path}:{node.lineno}: case.each takes literal "
                                             f"lists or module-level names bound to them")
                ids += [case_id(node.name, v) for v in itertools.product(*lists)]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: repeated case ids {sorted(i for i in ids if ids.count(i) > 1)}")
    return ids


class Report:
    """What the ranks of one worker run left behind, and the verdict per case.

    rc: mpirun's exit status (None if it was killed for running past the timeout);
    output: its stdout and stderr together; records[r]: rank r's events, in order.
    """

    def __init__(self, script: str, n: int, outdir: str, rc: Optional[int], output: str,
                 timeout: float):
        self.script, self.n, self.rc, self.output, self.timeout = script, n, rc, output, timeout
        self.records: Dict[int, List[dict]] = {}
        for r in range(n):
            p = os.path.join(outdir, f"rank{r}.jsonl")
            lines = open(p).read().splitlines() if os.path.exists(p) else []
            self.records[r] = [json.loads(x) for x in lines if x.strip()]

    def _how_it_ended(self) -> str:
        if self.rc is None:
            how = f"was killed after running {self.timeout:.0f} s"
        else:
            how = f"exited with status {self.rc}"
        return f"{self.script} on {self.n} ranks {how}; output tail:\n{self.output[-4000:]}"

    def _last(self, r: int, event: str) -> Optional[dict]:
        return next((x for x in reversed(self.records[r]) if x["event"] == event), None)

    def _find(self, r: int, event: str, name: str) -> Optional[dict]:
        return next((x for x in self.records[r] if x["event"] == event and x["case"] == name),
                    None)

    def failure(self, name: str) -> Optional[str]:
        """None if ``name`` passed on every rank, else what went wrong, rank by rank."""
        problems, tb, incomplete = [], "", False
        for r in range(self.n):
            end, gave_up = self._find(r, "end", name), self._find(r, "abandoned", name)
            if end is not None:
                if end["ok"] and gave_up is None:
                    continue
                text = end["error"] or "passed here"
                if gave_up is not None:
                    text += (f" (then it waited {gave_up['waited']:.0f} s for the other ranks "
                             f"to finish this case, and aborted the job)")
                tb = tb or (end["traceback"] and f"traceback on rank {r}:\n{end['traceback']}")
            elif self._find(r, "start", name) is not None:
                incomplete = True
                text = ("started this case and never finished it (hung in a collective that "
                        "another rank left, or crashed)")
            else:
                incomplete = True
                last = self._last(r, "start")
                text = "never ran this case (" + (f"it was still in {last['case']}" if last
                                                  else "it never started a case") + ")"
            problems.append(f"rank {r}: {text}")
        if not problems:
            return None
        return (f"{name} failed on {len(problems)} of {self.n} ranks:\n  "
                + "\n  ".join(problems) + (f"\n{tb}" if tb else "")
                + (f"\n{self._how_it_ended()}" if incomplete else ""))

    def exit_failure(self) -> Optional[str]:
        """None if every rank ran to the end and mpirun's status says what the cases say."""
        unfinished = [r for r in range(self.n) if self._last(r, "done") is None]
        failed = any(x["event"] == "end" and not x["ok"] for recs in self.records.values()
                     for x in recs)
        if unfinished:
            return f"ranks {unfinished} did not reach the end: " + self._how_it_ended()
        if self.rc != 0 and not failed:
            return "every case passed, yet " + self._how_it_ended()
        return None


def launch(script: str, n: int, cases: Sequence[str], outdir: str, timeout: int,
           **extra_env: str) -> "Report":
    """The pytest side: run ``script`` under launch/run on ``n`` ranks (only ``cases`` if
    given; a timeout ends it as a hang) and read what its ranks left in ``outdir``."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, root]), HVDCOMP_TEST_OUT=outdir,
               **extra_env)
    cmd = [os.path.join(root, "launch", "run"), "-np", str(n), sys.executable, script, *cases]
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                           timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                for x in (e.stdout, e.stderr)]
        rc, out = None, "".join(text)
    return Report(os.path.basename(script), n, outdir, rc, out, timeout)


def pytest_module(script: str, n: int, timeout: int, **extra_env: str) -> dict:
    """The pytest side of a whole test module: ``script``'s named cases run once under
    launch/run on ``n`` ranks (only the selected ones, :func:`launch`), each one pytest
    case, plus ``test_exit`` (every rank ran to the end; the exit status agrees).  Returns
    the module's names (``CASES``, ``pytestmark``, the ``report`` fixture, ``test_case``,
    ``test_exit``): ``globals().update(cases.pytest_module(...))``."""
    import shutil

    import pytest

    names = discover(script)
    ran = {}

    @pytest.fixture
    def report(request, tmp_path_factory):
        """The worker's report: it runs once per session, with the cases selected."""
        if "r" not in ran:
            wanted = [i.callspec.params["case"] for i in request.session.items
                      if getattr(i, "originalname", None) == "test_case"
                      and i.module is request.module]
            outdir = str(tmp_path_factory.mktemp(os.path.basename(script)[:-3]))
            ran["r"] = launch(script, n, [] if wanted == names else wanted, outdir, timeout,
                              **extra_env)
        return ran["r"]

    @pytest.mark.parametrize("case", names)
    def test_case(case, report):
        problem = report.failure(case)
        if problem:
            pytest.fail(problem, pytrace=False)

    def test_exit(report):
        """Every rank ran to the end (no hang, no crash), and the exit status agrees."""
        problem = report.exit_failure()
        if problem:
            pytest.fail(problem, pytrace=False)

    mark = pytest.mark.skipif(shutil.which("mpirun") is None,
                              reason="mpirun not found (launch/setup installs Open MPI)")
    return {"CASES": names, "pytestmark": mark, "report": report, "test_case": test_case,
            "test_exit": test_exit}
