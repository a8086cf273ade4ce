"""examples/train_fashion.py on 2 ranks for a few steps (#21 item 2), under mpirun
(launch/run), horovodrun and torchrun, on the real Fashion-MNIST files:

* fp32 (``none``) under mpirun and horovodrun: the loss rank 0 reports and the test accuracy
  equal those of a single-process reference written here (plain SGD with momentum and the
  cosine schedule on the union of the two ranks' batches: the average of two half-batch
  mean gradients is the full batch's mean gradient);
* PyTorch's PowerSGD hook under torchrun: the bytes counted per rank equal the formula of
  Vogels et al.'s algorithm as PyTorch implements it (fp32 allreduce for the first
  start_iter steps; then the 1-D tensors in fp32 and, per weight matrix of n x m, P and Q
  of (n + m) x rank floats);
* more ranks than training batches per epoch: one clear line, a failing exit status.
"""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import fashion  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "train_fashion.py")
PY = sys.executable
HAVE_DATA = os.path.exists(os.path.join(fashion.data_dir(), fashion.FILES["test"][1]))
pytestmark = pytest.mark.skipif(not HAVE_DATA, reason="Fashion-MNIST not installed "
                                "(launch/setup installs dataset-fashion-mnist)")
HAVE_HOROVOD = (shutil.which("mpirun") is not None
                and importlib.util.find_spec("horovod") is not None)
LAUNCH = {"mpirun": [os.path.join(ROOT, "launch", "run"), "-np", "2"],
          "horovodrun": [os.path.join(ROOT, "launch", "run"), "--horovodrun", "-np", "2"],
          "torchrun": [PY, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node", "2"]}
TRAIN, TEST, BATCH, STEPS, LR, SEED = 1024, 500, 32, 4, 0.05, 3


def run(launcher, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # (torchrun takes the script; mpirun and horovodrun the interpreter and the script)
    cmd = (LAUNCH[launcher] + ([] if launcher == "torchrun" else [PY])
           + [SCRIPT, "--no-progress", *map(str, args)])
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} hung for {timeout} s:\n{e.stdout}\n{e.stderr}")
    return p.returncode, p.stdout + p.stderr


def reference():
    """(rank 0's mean loss over the steps, test accuracy %) of the 2-rank fp32 job, computed
    in one process."""
    torch.manual_seed(SEED)
    model = fashion.FashionCNN()
    x_tr, y_tr, x_te, y_te = fashion.load()
    x_tr, y_tr, x_te, y_te = x_tr[:TRAIN], y_tr[:TRAIN], x_te[:TEST], y_te[:TEST]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    per_epoch = TRAIN // 2 // BATCH
    perm = torch.randperm(TRAIN, generator=torch.Generator().manual_seed(SEED * 1000 + 1))
    shards = [perm[r::2][:per_epoch * BATCH].split(BATCH) for r in range(2)]
    losses = []
    for t in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = LR * 0.5 * (1 + math.cos(math.pi * t / STEPS))
        opt.zero_grad()
        total = 0
        for r in range(2):
            idx = shards[r][t]
            loss = F.cross_entropy(model(fashion.normalize(x_tr[idx])), y_tr[idx])
            (loss / 2).backward()
            if r == 0:
                losses.append(loss.item())
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(fashion.normalize(x_te)).argmax(1) == y_te).float().mean().item() * 100
    return sum(losses) / len(losses), acc


@pytest.mark.skipif(not HAVE_HOROVOD, reason="mpirun or Horovod missing (launch/setup)")
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_fp32_matches_single_process_reference(launcher, tmp_path):
    js = tmp_path / "r.json"
    rc, out = run(launcher, "--compression", "none", "--train-images", TRAIN, "--test-images",
                  TEST, "--batch-size", BATCH, "--max-steps", STEPS, "--lr", LR, "--seed",
                  SEED, "--json", js)
    assert rc == 0, out[-6000:]
    r = json.loads(js.read_text())
    assert r["ranks"] == 2 and r["steps"] == STEPS and r["steps_per_epoch"] == 16
    assert "Horovod" in r["launcher"]
    loss, acc = reference()
    e = r["evals"][-1]
    assert e["train_loss"] == pytest.approx(loss, rel=1e-4), (e["train_loss"], loss)
    # float sums in another order may flip an image at the decision boundary: 1 of 500
    assert abs(e["test_acc"] - acc) <= 100 / TEST + 1e-9, (e["test_acc"], acc)
    assert e["fp32_bytes"] == 4 * 3274634 * STEPS


def test_powersgd_hook_bytes_under_torchrun(tmp_path):
    js = tmp_path / "r.json"
    rank, start = 2, 2
    rc, out = run("torchrun", "--compression", f"torch-powersgd:rank={rank},start_iter={start}",
                  "--train-images", TRAIN, "--test-images", TEST, "--batch-size", BATCH,
                  "--max-steps", STEPS, "--json", js)
    assert rc == 0, out[-6000:]
    r = json.loads(js.read_text())
    assert r["steps"] == STEPS and r["launcher"] == "torch.distributed (PyTorch hook)"
    floats_fp32, floats_psgd = 0, 0
    for p in fashion.FashionCNN().parameters():
        floats_fp32 += p.numel()
        if p.dim() <= 1:
            floats_psgd += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        k = min(n, m, rank)
        # PyTorch compresses a matrix when (n + m) k * min_compression_rate (2) < n m
        floats_psgd += (n + m) * k if (n + m) * k * 2 < n * m else n * m
    want = 4 * (start * floats_fp32 + (STEPS - start) * floats_psgd)
    assert r["evals"][-1]["bytes_per_rank"] == want
    assert r["evals"][-1]["fp32_bytes"] == 4 * floats_fp32 * STEPS
    assert r["evals"][-1]["test_acc"] > 10        # above chance after 4 steps


@pytest.mark.skipif(not HAVE_HOROVOD, reason="mpirun or Horovod missing (launch/setup)")
def test_more_ranks_than_batches(tmp_path):
    rc, out = run("mpirun", "--compression", "none", "--train-images", 100, "--batch-size",
                  64, timeout=300)
    assert rc != 0
    line = "100 training images make 1 batches of 64, fewer than the 2 ranks"
    assert out.count(line) == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
