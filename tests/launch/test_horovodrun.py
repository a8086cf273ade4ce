"""Launching like a Horovod user (#13 item 1): horovodrun with Horovod's MPI controller and
with Gloo, on 2 and 4 ranks of this machine.

* the exchange's bit-exactness check (tests/mpi/worker_exchange.py) passes under both, with
  the transport chosen by default ("mpi" under the MPI controller, "horovod" under Gloo, an
  explicit "mpi" under Gloo refused on every rank);
* the main job gives, for a few steps at the same seed, the same accuracy, bytes and ratio
  under launch/run (mpirun), horovodrun and horovodrun --gloo (on 4 ranks with
  --no-allreduce: Gloo sums the uncompressed tensors in its own order);
* Horovod's own DistributedOptimizer with compression=hvdcomp.get("fp16") averages, and
  with "bf16" raises hvdcomp's error;
* bad input ends quickly with one clear message: -np larger than the hosts' slots, a
  script that never calls hvd.init(), and an MPI without MPI_THREAD_MULTIPLE (the default
  transport falls back to Horovod's allgather, an explicit transport='mpi' is refused).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPI_DIR = os.path.join(ROOT, "tests", "mpi")
RUN = os.path.join(ROOT, "launch", "run")
PY = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PY), "horovodrun")

hvd = pytest.importorskip("horovod.torch")
pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None or not os.path.exists(HOROVODRUN),
    reason="needs mpirun and horovodrun (launch/setup installs both)")

MODES = {"mpirun": [RUN], "horovodrun": [RUN, "--horovodrun"],
         "horovodrun --gloo": [RUN, "--horovodrun", "--gloo"]}


def _run(cmd, outdir=None, timeout=400):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MPI_DIR, ROOT]))
    if outdir:
        env["HVDCOMP_TEST_OUT"] = str(outdir)
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{e.stdout}\n{e.stderr}")
    return p.returncode, p.stdout + p.stderr


# (4 ranks under horovodrun's MPI mode is mpirun underneath, which tests/mpi runs at 4
# ranks throughout; Gloo's 4 ranks are its own transport)
@pytest.mark.parametrize("mode,n", [("horovodrun", 2), ("horovodrun --gloo", 2),
                                    ("horovodrun --gloo", 4)])
def test_exchange_bit_exact_under_horovodrun(mode, n, tmp_path):
    worker = os.path.join(MPI_DIR, "worker_horovodrun.py")
    rc, out = _run(MODES[mode] + ["-np", str(n), PY, worker], tmp_path)
    assert rc == 0, out[-6000:]
    for r in range(n):
        f = tmp_path / f"rank{r}.ok"
        assert f.exists() and f.read_text().startswith("exchange OK"), (r, out[-4000:])


def _main_job(mode, n, tmp_path, *extra):
    js = tmp_path / f"{mode.replace(' ', '_')}-{n}.json"
    rc, out = _run(MODES[mode] + ["-np", str(n), PY, "examples/train_mnist.py", "--epochs",
                                  "1", "--max-steps", "6", "--no-progress", "--json", str(js),
                                  *extra])
    assert rc == 0, out[-6000:]
    return json.loads(js.read_text()), out


@pytest.mark.parametrize("n", [2, 3])
def test_main_job_same_results_under_every_launcher(n, tmp_path):
    """The same accuracy, bytes and ratio under every launcher.  The compressed tensors'
    averages are bit-identical on any transport (decoded in rank order).  2 ranks: the
    default path, the uncompressed tensors through Horovod's allreduce (a sum of two floats
    is the same in either order, so Gloo's equals MPI's).  3 ranks: --no-allreduce, every
    tensor as wire messages (Gloo's allreduce may add three floats in another order than
    MPI's: the last bits of the biases would differ and the accuracy drift,
    docs/reproducibility.md)."""
    extra = ("--no-allreduce",) if n > 2 else ()
    got = {m: _main_job(m, n, tmp_path, *extra) for m in MODES}
    ref, _ = got["mpirun"]
    assert ref["ranks"] == n and ref["transport"] == "mpi"
    for mode, (res, out) in got.items():
        assert res["ranks"] == n, mode
        # the transport chosen by default, and said so at INFO on rank 0
        want = "horovod" if "gloo" in mode else "mpi"
        assert res["transport"] == want, (mode, res["transport"])
        assert f"transport {want} (" in out, out[-3000:]
        for key in ("test_acc", "bytes_per_rank", "fp32_bytes", "ratio"):
            assert res["epochs"][-1][key] == ref["epochs"][-1][key], (mode, key, res, ref)


def test_main_job_writes_metrics_csv(tmp_path):
    import csv
    logdir = tmp_path / "logs"
    res, _ = _main_job("horovodrun --gloo", 2, tmp_path, "--log-dir", str(logdir))
    rows = list(csv.DictReader(open(logdir / "metrics.csv")))
    assert len(rows) == 1
    row, ep = rows[0], res["epochs"][0]
    for key in ("epoch", "test_acc", "bytes_per_rank", "fp32_bytes", "ratio"):
        assert float(row[key]) == pytest.approx(ep[key], rel=1e-12), key
    assert int(row["steps"]) == 6
    assert float(row["fp32_bytes"]) / float(row["bytes_per_rank"]) == pytest.approx(ep["ratio"])
    try:
        import tensorboard  # noqa: F401
        assert any(f.name.startswith("events.out.tfevents") for f in logdir.iterdir())
    except ImportError:
        assert sorted(f.name for f in logdir.iterdir()) == ["metrics.csv"]


@pytest.mark.parametrize("n", [2, 4])
def test_horovods_own_optimizer_with_hvdcomp_casts(n, tmp_path):
    rc, out = _run([RUN, "-np", str(n), PY, os.path.join(MPI_DIR, "worker_horovod_optimizer.py")],
                   tmp_path)
    assert rc == 0, out[-6000:]
    for r in range(n):
        assert (tmp_path / f"rank{r}.ok").read_text().startswith("horovod optimizer OK")


@pytest.mark.parametrize("gloo", [False, True])
def test_more_ranks_than_slots(gloo, tmp_path):
    """-np 4 on hosts with 2 slots: launch/run refuses up front; horovodrun itself (and
    mpirun under it) also ends, with a message naming the slots, and starts nothing."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    flag = ["--gloo"] if gloo else []
    script = [PY, "-c", "import time; time.sleep(600)"]
    for cmd in ([RUN, "--horovodrun", *flag, "-np", "4", "-H", "localhost:2", *script],
                [RUN, "--horovodrun", *flag, "-np", "4", "--hostfile", str(hostfile), *script]):
        rc, out = _run(cmd, timeout=60)
        assert rc == 2 and "-np 4" in out and "offer 2 slots" in out, out
        assert out.count("\n") == 1, out                  # one message
    rc, out = _run([HOROVODRUN, *flag, "-np", "4", "-H", "localhost:2", *script], timeout=120)
    assert rc != 0 and "slots" in out.lower(), out[-3000:]


def test_script_without_hvd_init(tmp_path):
    rc, out = _run([RUN, "-np", "2", PY, os.path.join(MPI_DIR, "worker_no_init.py")],
                   timeout=120)
    assert rc != 0
    assert "call hvd.init() before creating the DistributedOptimizer" in out, out[-3000:]


def test_mpi_without_thread_multiple(tmp_path):
    """Horovod on an MPI that provides less than MPI_THREAD_MULTIPLE (worker_thread_level.py:
    HOROVOD_MPI_THREADS_DISABLE=1, so Horovod starts MPI with MPI_THREAD_SINGLE): the
    default transport falls back to Horovod's allgather, says why, and averages exactly; an
    explicit transport='mpi' gives one clear error per rank, and the job ends."""
    rc, out = _run([RUN, "-np", "2", PY, os.path.join(MPI_DIR, "worker_thread_level.py")],
                   tmp_path, timeout=300)
    assert rc == 0, out[-6000:]
    assert "transport horovod (hvdcomp: the MPI library provides MPI_THREAD_SINGLE" in out, \
        out[-3000:]
    for r in range(2):
        text = (tmp_path / f"rank{r}.ok").read_text()
        assert text.startswith("thread level OK: transport horovod; transport='mpi': "), text
        assert ("provides MPI_THREAD_SINGLE; the mpi transport needs MPI_THREAD_MULTIPLE"
                in text and "HOROVOD_MPI_THREADS_DISABLE is set" in text
                and "transport='horovod'" in text and "\n" not in text), text
