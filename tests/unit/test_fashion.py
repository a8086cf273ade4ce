"""The real task's loader, models and bad input (#21 items 1-2): examples/fashion.py reads
small IDX files this test writes itself (hand-made bytes, hand-computed arrays), refuses
missing, truncated and foreign files with a message naming the path; the models have the
parameter counts their layer formulas give; examples/train_fashion.py ends with one clear
line (exit 2) on a missing data directory, a --compression typo, a PyTorch hook setting
typo, and more ranks than training batches per epoch.  One-process runs only (the job's
torchrun path on a 1-process Gloo group); tests/mpi/test_train_fashion.py runs 2 ranks."""
import gzip
import os
import socket

import numpy as np
import pytest
import torch

import fashion                      # examples/ is on sys.path (tests/conftest.py)
import train_fashion


def _idx(path, payload: bytes, header: bytes):
    with gzip.open(path, "wb") as f:
        f.write(header + payload)


def _be(*dims) -> bytes:
    return b"".join(d.to_bytes(4, "big") for d in dims)


def _write_set(d, n_train=3, n_test=2):
    """Images whose pixel (i, r, c) is (i * 7 + r * 28 + c) % 256; labels 3, 0, 9, ..."""
    for split, n in (("train", n_train), ("test", n_test)):
        img, lab = fashion.FILES[split]
        pixels = bytes((i * 7 + r * 28 + c) % 256 for i in range(n) for r in range(28)
                       for c in range(28))
        _idx(os.path.join(d, img), pixels, b"\x00\x00\x08\x03" + _be(n, 28, 28))
        labels = bytes([3, 0, 9, 5, 1][:n])
        _idx(os.path.join(d, lab), labels, b"\x00\x00\x08\x01" + _be(n))


def test_reads_hand_made_idx_files(tmp_path):
    _write_set(tmp_path)
    x_tr, y_tr, x_te, y_te = fashion.load(str(tmp_path))
    assert x_tr.dtype == torch.uint8 and x_tr.shape == (3, 28, 28)
    assert x_te.shape == (2, 28, 28) and y_tr.dtype == torch.int64
    assert y_tr.tolist() == [3, 0, 9] and y_te.tolist() == [3, 0]
    # hand-computed pixels: image 2, row 1, column 5 -> 14 + 28 + 5 = 47; image 1, row 9,
    # column 27 -> (7 + 252 + 27) % 256 = 30
    assert x_tr[2, 1, 5].item() == 47 and x_tr[1, 9, 27].item() == 30
    assert x_te[0, 0, 0].item() == 0 and x_te[1, 0, 3].item() == 10


def test_environment_variable_names_the_directory(tmp_path, monkeypatch):
    _write_set(tmp_path, n_train=1, n_test=1)
    monkeypatch.setenv(fashion.ENV, str(tmp_path))
    assert fashion.data_dir() == str(tmp_path)
    assert fashion.load()[1].tolist() == [3]
    monkeypatch.delenv(fashion.ENV)
    assert fashion.data_dir() == fashion.DEBIAN_DIR


def test_normalize():
    x = torch.tensor([[[0, 255] + [0] * 26] * 28], dtype=torch.uint8)
    out = fashion.normalize(x)
    assert out.shape == (1, 1, 28, 28) and out.dtype == torch.float32
    assert out[0, 0, 0, 1].item() == pytest.approx((1.0 - 0.2860) / 0.3530)
    assert out[0, 0, 0, 0].item() == pytest.approx(-0.2860 / 0.3530)


def _error(path, ndim):
    with pytest.raises(fashion.DataError) as e:
        fashion.read_idx(str(path), ndim)
    assert str(path) in str(e.value)
    # no numpy/gzip exception chained to it
    assert e.value.__cause__ is None
    assert e.value.__context__ is None or e.value.__suppress_context__
    return str(e.value)


def test_missing_file(tmp_path):
    msg = _error(tmp_path / "train-images-idx3-ubyte.gz", 3)
    assert "not found" in msg and fashion.ENV in msg and "dataset-fashion-mnist" in msg


def test_truncated_data(tmp_path):
    p = tmp_path / "t.gz"
    _idx(p, bytes(28 * 28 * 2 - 5), b"\x00\x00\x08\x03" + _be(2, 28, 28))
    msg = _error(p, 3)
    assert f"holds {28 * 28 * 2 - 5} data bytes" in msg and f"announces {2 * 28 * 28}" in msg


def test_truncated_gzip_stream(tmp_path):
    p = tmp_path / "t.gz"
    _idx(p, bytes(range(256)) * 40, b"\x00\x00\x08\x01" + _be(10240))
    raw = p.read_bytes()
    p.write_bytes(raw[:len(raw) // 2])
    assert "cannot be read as gzip" in _error(p, 1)


def test_not_gzip_and_wrong_header(tmp_path):
    p = tmp_path / "plain"
    p.write_bytes(b"\x00\x00\x08\x01" + _be(1) + b"\x05")      # IDX, but not gzipped
    assert "cannot be read as gzip" in _error(p, 1)
    q = tmp_path / "floats.gz"
    _idx(q, bytes(4), b"\x00\x00\x0d\x01" + _be(1))             # type 0x0d: float32
    assert "not an IDX file of unsigned bytes" in _error(q, 1)
    assert "not an IDX file" in _error(q, 3)                    # labels where images belong


def test_images_and_labels_disagree(tmp_path):
    _write_set(tmp_path)
    _idx(tmp_path / fashion.FILES["train"][1], bytes([1, 2]), b"\x00\x00\x08\x01" + _be(2))
    with pytest.raises(fashion.DataError, match="has 3 images but .* has 2 labels"):
        fashion.load(str(tmp_path))


def test_published_files_when_installed():
    """The Debian package's files: 60,000 + 10,000 images, 6,000 / 1,000 of each class (the
    data set's published balance)."""
    if not os.path.exists(os.path.join(fashion.DEBIAN_DIR, fashion.FILES["test"][1])):
        pytest.skip("dataset-fashion-mnist not installed (launch/setup installs it)")
    x_tr, y_tr, x_te, y_te = fashion.load(fashion.DEBIAN_DIR)
    assert x_tr.shape == (60000, 28, 28) and x_te.shape == (10000, 28, 28)
    assert torch.bincount(y_tr).tolist() == [6000] * 10
    assert torch.bincount(y_te).tolist() == [1000] * 10


def test_model_sizes_and_shapes():
    conv = lambda cin, cout, k, bias=True: cin * cout * k * k + (cout if bias else 0)  # noqa
    fc = lambda i, o: i * o + o  # noqa: E731
    bn = lambda c: 2 * c  # noqa: E731
    cnn = conv(1, 32, 5) + conv(32, 64, 5) + fc(64 * 7 * 7, 1024) + fc(1024, 10)
    block = lambda ci, co: (conv(ci, co, 3, False) + bn(co) + conv(co, co, 3, False) + bn(co)  # noqa
                            + (conv(ci, co, 1, False) + bn(co) if ci != co else 0))
    resnet = (conv(1, 32, 3, False) + bn(32) + block(32, 32) + block(32, 64) + block(64, 128)
              + fc(128, 10))
    assert cnn == 3274634 and resnet == 308074                 # the docstrings' figures
    for cls, n in ((fashion.FashionCNN, cnn), (fashion.FashionResNet, resnet)):
        m = cls()
        assert sum(p.numel() for p in m.parameters()) == n
        assert m(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_torch_hook_specs():
    import hvdcomp
    assert train_fashion.parse_torch_hook("alq:bits=3") is None
    assert train_fashion.parse_torch_hook("torch-fp16") == ("torch-fp16", {})
    name, s = train_fashion.parse_torch_hook("torch-powersgd:rank=4,start_iter=50")
    assert name == "torch-powersgd" and s == dict(rank=4, start_iter=50, warm_start=1,
                                                  min_compression_rate=2.0)
    for bad, text in (("torch-powersg", "valid: torch-fp16, torch-powersgd"),
                      ("torch-powersgd:rnk=2", "valid: rank=<int>, start_iter=<int>"),
                      ("torch-powersgd:rank=two", "rank='two' is not int"),
                      ("torch-powersgd:rank=0", "rank must be >= 1"),
                      ("torch-powersgd:start_iter=1", "start_iter must be >= 2")):
        with pytest.raises(hvdcomp.ConfigError, match=text):
            train_fashion.parse_torch_hook(bad)


@pytest.fixture
def one_rank(monkeypatch):
    """torchrun's environment for a 1-process job (process-wide settings restored)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                     WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _exit_line(capsys, argv):
    with pytest.raises(SystemExit) as e:
        train_fashion.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train_fashion.py: "), err
    return err[0]


def test_bad_input_one_clear_line(one_rank, capsys, tmp_path):
    missing = tmp_path / "nowhere"
    line = _exit_line(capsys, ["--data", str(missing), "--no-progress"])
    assert os.path.join(str(missing), "train-images-idx3-ubyte.gz") in line
    assert "not found" in line and fashion.ENV in line
    # a truncated file among the four: named
    _write_set(tmp_path)
    lab = tmp_path / fashion.FILES["test"][1]
    raw = lab.read_bytes()
    lab.write_bytes(raw[:len(raw) - 12])
    line = _exit_line(capsys, ["--data", str(tmp_path), "--no-progress"])
    assert str(lab) in line and ("gzip" in line or "truncated" in line)
    line = _exit_line(capsys, ["--compression", "alq:bitz=3", "--data", str(tmp_path)])
    assert "unknown setting 'bitz'" in line and "valid: alq:bits=3" in line
    line = _exit_line(capsys, ["--compression", "alqq", "--data", str(tmp_path)])
    assert "unknown compressor 'alqq'" in line and "dgc:density=" in line
    line = _exit_line(capsys, ["--compression", "torch-powersgd:rnk=1"])
    assert "valid: rank=<int>" in line


def test_more_ranks_than_batches(one_rank, capsys, tmp_path):
    """1 rank, 3 training images, batch 64: no full batch for the rank."""
    _write_set(tmp_path)
    line = _exit_line(capsys, ["--launcher", "torchrun", "--data", str(tmp_path),
                               "--no-progress", "--compression", "none", "--batch-size", "64"])
    assert "3 training images make 0 batches of 64, fewer than the 1 ranks" in line
    import torch.distributed as dist
    assert not dist.is_initialized()            # the job left its process group


def test_one_rank_job_runs(one_rank, tmp_path):
    """A few steps on the hand-made set: the JSON has one row per evaluation, the step
    count, and the fp32 payload = 4 bytes x parameters x steps (``none``)."""
    _write_set(tmp_path, n_train=5, n_test=2)
    js = tmp_path / "r.json"
    train_fashion.main(["--launcher", "torchrun", "--data", str(tmp_path), "--no-progress",
                        "--compression", "none",
                        "--batch-size", "2", "--epochs", "2", "--json", str(js)])
    import json
    r = json.loads(js.read_text())
    assert r["steps_per_epoch"] == 2 and r["steps"] == 4 and r["ranks"] == 1
    assert [e["step"] for e in r["evals"]] == [2, 4]
    fp32 = 4 * 3274634 * 4                      # 4 bytes x parameters x steps
    assert r["evals"][-1]["fp32_bytes"] == fp32
    # the allreduced fp32 buffers plus the exchange's few count slots per tensor group
    assert fp32 <= r["evals"][-1]["bytes_per_rank"] <= fp32 + 4 * 1024
    assert r["evals"][-1]["test_acc"] in (0.0, 50.0, 100.0)
