"""Operating hvdcomp (#13): install hints when an optional module is missing (simulated with
``sys.modules[name] = None`` in a fresh interpreter), every message through the "hvdcomp"
logger (nothing printed by the library), the rate limit of repeated warnings,
``StepStats.as_dict()``, the choice of transport, and bf16 refused by Horovod's own
contract."""
import ast
import configparser
import json
import logging
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.exchange import Exchange, StepStats
from hvdcomp.log import RateLimit, warn_limited
from hvdcomp.transport import Transport, select

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _extras():
    """setup.cfg's extras: {name: [requirement, ...]}."""
    cfg = configparser.ConfigParser(interpolation=None)
    assert cfg.read(os.path.join(ROOT, "setup.cfg"))
    return {name: value.split() for name, value in cfg["options.extras_require"].items()}


def _without(modules, code):
    """Run ``code`` in a fresh interpreter where importing any of ``modules`` fails; returns
    what it printed (stdout)."""
    pre = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    p = subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _named_extra(text):
    """The extra named as hvdcomp[NAME] in an error text (it must name one)."""
    m = re.search(r"hvdcomp\[(\w+)\]", text)
    assert m, text
    return m.group(1)


def test_hvdcomp_torch_without_horovod_says_how_to_install():
    out = _without(["horovod", "horovod.torch"], """
try:
    import hvdcomp.torch
    print("IMPORTED")
except ImportError as e:
    print(e)
import hvdcomp                                   # the compressors need no Horovod
print("compressors:", hvdcomp.get("qsgd").spec())
""")
    assert "IMPORTED" not in out
    assert "pip install" in out and "HOROVOD_WITH_PYTORCH=1" in out
    extra = _named_extra(out)
    assert any(d.startswith("horovod") for d in _extras()[extra]), (extra, _extras())
    assert "compressors: qsgd:" in out


def test_cuda_loader_names_the_extra_that_brings_cupy():
    out = _without(["cupy"], """
from hvdcomp.backends import cuda
try:
    cuda.require()
except ImportError as e:
    print(e)
""")
    extra = _named_extra(out)
    deps = _extras()[extra]
    # the message's wheel is the extra's wheel, for the CUDA major version PyTorch has
    wheel = re.search(r"cupy-cuda\d+x", out).group(0)
    assert any(d.startswith(wheel) for d in deps), (out, deps)
    major = (torch.version.cuda or "12").split(".")[0]
    assert extra == f"cuda{major if major in ('12', '13') else '12'}"


def test_mpi4py_is_needed_by_the_mpi_transport_only():
    out = _without(["mpi4py", "mpi4py.MPI"], """
import torch, hvdcomp
from hvdcomp.exchange import Exchange
from hvdcomp.transport import make, select
from hvdcomp.transport.mpi import cuda_aware
print("imports fine; cuda_aware:", cuda_aware())
for build in (lambda: make("mpi"), lambda: select(None)):
    try:
        build()
        print("BUILT")
    except ImportError as e:
        print("ImportError:", e)
""")
    assert "imports fine; cuda_aware: None" in out
    assert "BUILT" not in out
    lines = [ln for ln in out.splitlines() if ln.startswith("ImportError:")]
    assert len(lines) == 2
    for ln in lines:
        assert "transport='horovod'" in ln
        assert any(d.startswith("mpi4py") for d in _extras()[_named_extra(ln)])


def test_the_library_prints_nothing():
    """Every message goes through logging.getLogger("hvdcomp"): no print() call anywhere in
    hvdcomp/ except the command line (cli.py, and selftest.py, whose output is the
    report)."""
    found = []
    for d, _, files in os.walk(os.path.join(ROOT, "hvdcomp")):
        for f in files:
            if not f.endswith(".py") or f in ("cli.py", "selftest.py"):
                continue
            path = os.path.join(d, f)
            with open(path) as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "print"):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
                if isinstance(node, ast.Attribute) and node.attr in ("stderr", "stdout") \
                        and isinstance(node.value, ast.Name) and node.value.id == "sys":
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} sys.{node.attr}")
    assert not found, found


def test_rate_limit_per_kind():
    now = [0.0]
    rl = RateLimit(burst=3, interval=60.0, clock=lambda: now[0])
    shown = [rl.admit(f"ndqsg: 3 of 40 buckets of rank {r} at step {s}")
             for s in range(10) for r in (1,)]
    # the first three of the kind pass (the third says that more are limited); the rest wait
    assert [bool(x) for x in shown] == [True] * 3 + [False] * 7
    assert "at most one per 60 s" in shown[2] and "at most" not in shown[1]
    assert rl.admit("laq: parameter change nan at step 3 not recorded")   # another kind
    now[0] = 59.0
    assert rl.admit("ndqsg: 1 of 40 buckets of rank 3 at step 99") == ""
    now[0] = 61.0
    msg = rl.admit("ndqsg: 1 of 40 buckets of rank 3 at step 100")
    assert msg.endswith("(8 similar held back since the last one)"), msg   # 7 + the one at 59 s
    now[0] = 200.0
    assert rl.admit("ndqsg: 1 of 40 buckets of rank 3 at step 101").endswith("step 101")


def test_warn_limited_logs_on_the_hvdcomp_logger(caplog):
    rl = RateLimit(burst=1, interval=1e9)
    with caplog.at_level(logging.WARNING, logger="hvdcomp"):
        assert warn_limited("odd thing 1", rl)
        assert not warn_limited("odd thing 2", rl)
    recs = [r for r in caplog.records if r.name == "hvdcomp"]
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    assert recs[0].getMessage().startswith("odd thing 1")


def test_step_stats_as_dict():
    st = StepStats(step=4, bytes_sent=250, fp32_bytes=1000, traffic_bytes=375.5,
                   compressors={"w": "qsgd"}, nonfinite=["b"], events=["e"], joined=1,
                   encode_s=0.5, comm_s=0.25, decode_s=0.125)
    d = st.as_dict()
    assert d["ratio"] == 1000 / 250
    for f in ("step", "bytes_sent", "fp32_bytes", "traffic_bytes", "compressors",
              "nonfinite", "events", "joined", "encode_s", "comm_s", "decode_s"):
        assert d[f] == getattr(st, f), f
    assert json.loads(json.dumps(d)) == d
    d["compressors"]["w"] = "changed"                 # a copy: the stats stay as they were
    assert st.compressors == {"w": "qsgd"}
    assert StepStats().as_dict()["ratio"] is None    # nothing sent: no ratio, not inf


class _Echo(Transport):
    """One rank; every other rank sends what this one sends."""
    name = "echo"

    def __init__(self, size):
        super().__init__()
        self.rank, self.size = 0, size

    def _allgather_counts(self, n):
        return [n] * self.size

    def _allgatherv(self, data, counts):
        return [np.array(data, copy=True) for _ in range(self.size)]

    def allreduce_sum(self, arr):
        return np.asarray(arr, dtype=np.float64) * self.size

    def broadcast(self, arr, root=0):
        return arr


def test_exchange_logs_its_start_and_compressor_events(caplog):
    """Rank 0 logs the exchange's start-up facts at INFO and each compressor event at
    WARNING (rate-limited), and keeps every event in StepStats.events."""
    from hvdcomp.compressors.protocols import ReportsEvents

    class Noisy(hvdcomp.QSGD, ReportsEvents):   # a compressor reporting an event per decode
        def _decode(self, msg, key, out):
            self._events = getattr(self, "_events", [])
            self._events.append(f"odd bucket at step {key.step}, rank {msg.rank}")
            return super()._decode(msg, key, out)

    p = torch.nn.Parameter(torch.zeros(40, 40))
    with caplog.at_level(logging.INFO, logger="hvdcomp"):
        ex = Exchange([("w", p)], Noisy(bits=4, bucket_size=64), _Echo(1), seed=1)
        try:
            for step in range(4):
                p.grad = torch.randn(40, 40)
                ex.begin(step)
                ex.ready("w")
                _, stats = ex.finish()
                assert len(stats.events) == 1            # one per rank's message
        finally:
            ex.close()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("1 tensors in 1 buckets, 1 ranks, transport echo" in m for m in infos), infos
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # 4 events of one kind: the first three logged, then held back (one per minute)
    kinds = {RateLimit.kind(w.split(" (")[0]) for w in warns}
    assert len(warns) == 3 and len(kinds) == 1, warns
    assert warns[0].startswith("w: odd bucket at step 0")


def test_cost_model_is_public():
    """optimizer.cost_model / Exchange.cost_model: Auto's measured model, None without."""
    from hvdcomp.auto import Auto, CodecCost, LinkCost
    link = LinkCost(ar_latency=1e-4, ar_per_byte=1e-9, ag_latency=1e-4, ag_per_byte=1e-9)
    codec = CodecCost(encode_fixed=0, encode_per_elem=1e-9, decode_fixed=0,
                      decode_per_elem=1e-9, bytes_fixed=16, bytes_per_elem=0.4,
                      fp16_per_elem=1e-10)
    p = torch.nn.Parameter(torch.zeros(64, 64))
    ex = Exchange([("w", p)], Auto("qsgd:bits=4", link=link, codec=codec), _Echo(2))
    try:
        assert ex.cost_model is ex.auto.model
        assert ex.cost_model.as_dict()["link"]["ag_per_byte"] == 1e-9
    finally:
        ex.close()
    ex = Exchange([("w", p)], hvdcomp.get("qsgd"), _Echo(2))
    try:
        assert ex.cost_model is None
    finally:
        ex.close()


class _FakeHorovod(SimpleNamespace):
    """What select() asks of horovod.torch; allreduce sums this rank's value ``size``
    times unless ``others`` says what the other ranks contribute."""
    Sum = "sum"

    def __init__(self, rank=0, size=1, mpi=False, others=None):
        super().__init__(_rank=rank, _size=size, _mpi=mpi, others=others, calls=[])

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def mpi_enabled(self):
        return self._mpi

    def allreduce(self, t, op, name):
        self.calls.append(name)
        other = self.others if self.others is not None else t
        return t + other * (self._size - 1)


def test_select_by_name_without_horovod_and_bad_names():
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        select("tcp")
    tp = _Echo(3)
    assert select(tp) is tp


def test_select_checks_a_given_transports_world(caplog):
    hvd = _FakeHorovod(rank=0, size=2)
    assert select(_Echo(2), hvd) is not None and len(hvd.calls) == 1
    with pytest.raises(RuntimeError, match="world differs from Horovod's"):
        select(_Echo(3), _FakeHorovod(rank=0, size=2))
    # this rank agrees, another does not: every rank raises (the verdict is everyone's)
    with pytest.raises(RuntimeError, match="world differs"):
        select(_Echo(2), _FakeHorovod(rank=0, size=2, others=torch.tensor([0])))


def test_select_under_gloo_leaves_mpi_alone():
    """No MPI launcher and Horovod on Gloo: the default is Horovod's allgather, and MPI is
    never started; an explicit "mpi" raises, naming the way out.  (A fresh interpreter:
    nothing there has imported mpi4py.MPI.)"""
    out = _without([], """
import os, sys
for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
    os.environ.pop(v, None)
import torch
import hvdcomp.transport as T
class HVD:
    Sum = "sum"
    def rank(self): return 1
    def size(self): return 4
    def mpi_enabled(self): return False
    def allreduce(self, t, op, name): return t * 4
class Fake(T.Transport):
    name = "horovod"
    def __init__(self): self.rank, self.size = 1, 4
T.HorovodTransport = Fake
print("auto:", T.select(None, HVD()).name)
print("mpi started:", "mpi4py.MPI" in sys.modules)
try:
    T.select("mpi", HVD())
except RuntimeError as e:
    print("mpi:", e)
""")
    assert "auto: horovod" in out and "mpi started: False" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("mpi:"))
    assert "horovodrun --gloo" in line and "transport='horovod'" in line


def test_bf16_refused_by_horovods_own_contract():
    with pytest.raises(TypeError, match="hvdcomp.torch.DistributedOptimizer"):
        hvdcomp.get("bf16").compress(torch.ones(4))
    # fp16 keeps working there: compress / sum / decompress is the average
    c = hvdcomp.get("fp16")
    t, ctx = c.compress(torch.full((4,), 3.0))
    assert t.dtype == torch.float16 and torch.equal(c.decompress(t, ctx), torch.full((4,), 3.0))
