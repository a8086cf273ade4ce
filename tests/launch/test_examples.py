"""The README's two examples run as the README says: examples/minimal_horovod.py on 2 ranks
under mpirun (launch/run), examples/minimal_ddp.py on 2 processes under torchrun (Gloo).

Each rank trains on its own synthetic batches (the first losses differ), so parameters
that end identical, bit for bit, on both ranks were updated with the same averages; the
loss falls; and the bytes each rank reports match a count made here: the ratio is the
model's fp32 gradient bytes over the bytes sent, and ALQ's 3 bits send less than a fifth."""
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("horovod")

# the examples' model: Linear(64, 128), ReLU, Linear(128, 10); float32 gradients
FP32_BYTES = 4 * (64 * 128 + 128 + 128 * 10 + 10)


def _run(cmd, timeout=600, **extra_env) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **extra_env)
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} hung for {timeout} s:\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{cmd} failed (rc {p.returncode}):\n{out[-6000:]}"
    return p.stdout


def _check(out: str):
    out = re.sub(r"^\[default\d+\]:", "", out, flags=re.M)   # torchrun --tee's rank prefix
    ranks = re.findall(r"^rank (\d+): loss ([\d.]+) -> ([\d.]+), params ([0-9a-f]+)$", out, re.M)
    sent = re.findall(r"^(\d+) ([\d.]+)$", out, re.M)
    assert sorted(r for r, *_ in ranks) == ["0", "1"] and len(sent) == 2, out
    (_, first0, last0, params0), (_, first1, last1, params1) = ranks
    assert first0 != first1, "both ranks saw the same data"
    assert params0 == params1, "the ranks' parameters differ after training"
    for first, last in ((first0, last0), (first1, last1)):
        assert float(last) < 0.9 * float(first), (first, last)
    for nbytes, ratio in sent:
        assert 0 < int(nbytes) < FP32_BYTES / 5
        assert float(ratio) == pytest.approx(FP32_BYTES / int(nbytes), rel=1e-12)


@pytest.mark.skipif(not HAVE_MPI, reason="mpirun or Horovod missing (launch/setup installs them)")
def test_minimal_horovod_example(tmp_path):
    # launch/run starts the ranks unbuffered, so their lines can interleave mid-line on
    # mpirun's stdout (as torchrun's did below): each rank's output goes to its own file
    # (Open MPI's --output-filename DIR writes DIR/1/rank.R/stdout).
    _run([os.path.join(ROOT, "launch", "run"), "-np", "2", sys.executable,
          os.path.join(ROOT, "examples", "minimal_horovod.py")],
         HVDCOMP_MPIRUN_ARGS=f"--output-filename {tmp_path}")
    files = sorted(glob.glob(os.path.join(str(tmp_path), "**", "rank.*", "stdout"),
                             recursive=True))
    assert len(files) == 2, files
    _check("".join(open(f).read() for f in files))


def test_minimal_ddp_example():
    # torchrun starts its workers with `python -u`, so print() leaves in pieces (text, then
    # "\n") and two workers sharing one pipe interleave mid-line (seen in CI: "4354", "4354",
    # " 8.8..." read as "43544354 8.8...").  With --tee the agent alone writes the workers'
    # lines, whole, each prefixed with its rank.
    _check(_run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", "2", "--tee", "1",
                 os.path.join(ROOT, "examples", "minimal_ddp.py")]))
