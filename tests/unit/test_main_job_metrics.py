"""The main job's per-epoch metrics (#13 item 4): examples/train_mnist.py --log-dir writes
one CSV row per epoch and, when the tensorboard package is present, the same numbers as
TensorBoard scalars (tag = column, step = epoch).

tensorboard is not a dependency (and launch/setup does not install it), so its path runs
here with a stand-in ``torch.utils.tensorboard`` module that records what the job writes.
The job runs in this process for 2 short epochs on one rank (the DDP hook over a 1-process
Gloo group: no launcher needed).

Also the job's banner and ``final:`` line (newcomer trial item 2): they name the user's
--compression when it has exchange prefixes (``auto+``...), not Auto's inner compressor
alone, and a per-layer Auto logs no plan before it has one."""
import csv
import json
import logging
import socket
import sys
import types

import pytest
import torch

import hvdcomp
import train_mnist                   # examples/ is on sys.path (tests/conftest.py)
from mnist import FC300100


class _Writer:
    """Records SummaryWriter's calls the job makes."""
    made = []

    def __init__(self, log_dir=None, **kw):
        self.log_dir, self.scalars, self.flushes, self.closed = log_dir, [], 0, False
        _Writer.made.append(self)

    def add_scalar(self, tag, value, global_step=None, **kw):
        self.scalars.append((tag, value, global_step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank(monkeypatch):
    """torchrun's environment for a 1-process job; the job's process-wide settings (torch
    threads, the root logger) restored afterwards."""
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                     WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    root = logging.getLogger()
    threads, level, handlers = torch.get_num_threads(), root.level, list(root.handlers)
    yield
    torch.set_num_threads(threads)
    root.setLevel(level)
    root.handlers[:] = handlers


@pytest.mark.parametrize("tensorboard", [True, False])
def test_metrics_csv_and_tensorboard_scalars(tensorboard, one_rank, tmp_path, monkeypatch):
    if tensorboard:
        fake = types.ModuleType("torch.utils.tensorboard")
        fake.SummaryWriter = _Writer
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    else:           # as without the tensorboard package, whether or not it is installed
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    _Writer.made = []
    logdir, js = tmp_path / "logs", tmp_path / "run.json"
    epochs, batch, train = 2, 1000, 4000          # 4 steps per epoch on one rank
    train_mnist.main(["--launcher", "torchrun", "--epochs", str(epochs), "--batch-size",
                      str(batch), "--no-progress", "--log-dir", str(logdir), "--json",
                      str(js)])

    with open(logdir / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    # the CSV: one row per epoch, in order, with the job's own results
    assert [int(r["epoch"]) for r in rows] == list(range(1, epochs + 1))
    steps = -(-train // batch)
    assert [int(r["steps"]) for r in rows] == [steps * e for e in range(1, epochs + 1)]
    n_params = sum(p.numel() for p in FC300100().parameters())
    history = json.loads(js.read_text())["epochs"]
    for r, h in zip(rows, history):
        assert float(r["fp32_bytes"]) == 4 * n_params * steps       # fp32 gradients sent
        assert 0 < float(r["bytes_per_rank"]) < float(r["fp32_bytes"])
        assert float(r["ratio"]) == float(r["fp32_bytes"]) / float(r["bytes_per_rank"])
        for key in ("test_acc", "bytes_per_rank", "fp32_bytes", "ratio"):
            assert float(r[key]) == h[key], key

    if not tensorboard:
        assert _Writer.made == [] and sorted(p.name for p in logdir.iterdir()) == ["metrics.csv"]
        return
    # TensorBoard: the same numbers, one scalar per CSV column but the epoch, step = epoch
    (w,) = _Writer.made
    assert w.log_dir == str(logdir) and w.closed and w.flushes == epochs
    want = [(col, float(r[col]), int(r["epoch"])) for r in rows for col in header
            if col != "epoch"]
    assert [(tag, float(v), step) for tag, v, step in w.scalars] == want


ALQ3 = hvdcomp.get("alq:bits=3").spec()      # "alq:bits=3,bucket_size=8192,..."


@pytest.mark.parametrize("spec, want", [
    ("alq:bits=3", ALQ3),
    ("  alq:bits=3 ", ALQ3),
    ("auto+alq:bits=3", f"auto+alq:bits=3 ({ALQ3})"),
    ("auto+layer+alq:bits=3", f"auto+layer+alq:bits=3 ({ALQ3})"),
    ("rs+alq:bits=3", f"rs+alq:bits=3 ({ALQ3})"),
    ("host+auto+ag+alq:bits=3", f"host+auto+ag+alq:bits=3 ({ALQ3})"),
    ("flat+alq:bits=3", f"flat+alq:bits=3 ({ALQ3})"),
])
def test_compression_label_names_the_users_spec(spec, want):
    assert train_mnist.compression_label(spec, hvdcomp.get("alq:bits=3")) == want


def _banner_and_final(capsys, spec):
    train_mnist.main(["--launcher", "torchrun", "--epochs", "1", "--max-steps", "2",
                      "--no-progress", "--compression", spec])
    out = capsys.readouterr().out.splitlines()
    banner = [x for x in out if x.startswith("hvdcomp main job:")]
    final = [x for x in out if x.startswith("final:")]
    assert len(banner) == len(final) == 1, out
    return banner[0], final[0]


@pytest.mark.parametrize("spec, shown", [
    ("alq:bits=3", ALQ3),
    ("auto+layer+alq:bits=3", f"auto+layer+alq:bits=3 ({ALQ3})"),
])
def test_banner_and_final_line_name_the_users_spec(spec, shown, one_rank, capsys, caplog):
    caplog.set_level(logging.INFO, logger="hvdcomp")
    banner, final = _banner_and_final(capsys, spec)
    assert banner == (f"hvdcomp main job: FC-300-100, 4000 train / 1000 test MNIST digits, "
                      f"1 ranks, torch.distributed (DDP hook), compression {shown}, "
                      f"collective allgather")
    assert f", compression {shown}, ratio " in final, final
    logs = [r.getMessage() for r in caplog.records if r.name == "hvdcomp"]
    if spec.startswith("auto+layer+"):
        # no "Auto's plan" before the plan exists: the first step is labelled as fp32,
        # then the per-layer plan once decided
        assert not any(x.startswith("Auto's plan") for x in logs), logs
        pending = [i for i, x in enumerate(logs) if x.startswith(
            "Auto per layer: plan pending; the first step sends every tensor as fp32 "
            "(tensors per path in it: {'none': 6}), the plan chosen from its gradients is "
            "logged after it")]
        decided = [i for i, x in enumerate(logs) if x.startswith("Auto per layer: budget")]
        assert len(pending) == len(decided) == 1 and pending[0] < decided[0], logs
