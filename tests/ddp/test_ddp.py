"""The DDP communication hook, launched with torchrun from pytest on 2 and 4 CPU processes
(Gloo): the same averages as the drop-in optimizer under mpirun, bit for bit, for every
compressor and both DDP bucket sizes; the hook's cases against independent references;
checkpoint and resume in new processes; the main job and the Lightning example."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import golden  # noqa: E402

HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("horovod")


def launch(cmd, outdir, timeout=900, **extra_env) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1",
               HVDCOMP_TEST_OUT=str(outdir), PYTHONUNBUFFERED="1", **extra_env)
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} hung for {timeout} s:\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{cmd} failed (rc {p.returncode}):\n{out[-8000:]}"
    return out


def torchrun(n, script, *args, outdir, timeout=900) -> str:
    return launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(n), os.path.join(HERE, script), *map(str, args)],
                  outdir, timeout)


def mpirun(n, script, *args, outdir, timeout=900) -> str:
    return launch([os.path.join(ROOT, "launch", "run"), "-np", str(n), sys.executable,
                   os.path.join(HERE, script), *map(str, args)], outdir, timeout)


def test_golden_covers_every_compressor():
    """The bit-for-bit comparison below runs every registered compressor."""
    import hvdcomp
    # (hvdcomp's own: other test modules register compressors of their own)
    assert {s.split(":")[0] for s in golden.COMPRESSORS} == {
        n for n in hvdcomp.available()
        if type(hvdcomp.get(n)).__module__.startswith("hvdcomp.")}


@pytest.fixture(scope="module", params=[2, 4])
def cases_run(request, tmp_path_factory):
    """worker_cases.py under torchrun on n ranks: the hook's cases, then the first part of
    the checkpoint test (worker_resume.run("first"): N + K steps, a checkpoint after N)."""
    n = request.param
    out = tmp_path_factory.mktemp(f"ddp{n}")
    return n, out, torchrun(n, "worker_cases.py", outdir=out)


@pytest.fixture(scope="module")
def ddp_runs(cases_run):
    """worker_ddp.py under torchrun on the same ranks: the golden training through the hook
    (DDP buckets small and large on 2 ranks, small on 4: many buckets and DDP's rebuild
    after the first iteration); then, these being new processes, the second part of the
    checkpoint test (worker_resume.run("resume") of cases_run's checkpoint).  Results saved
    per rank."""
    n, out, _ = cases_run
    tags = ("small", "large") if n == 2 else ("small",)
    torchrun(n, "worker_ddp.py", out, ",".join(tags), "resume", outdir=out)
    return n, out, tags


@pytest.fixture(scope="module")
def golden_runs(ddp_runs):
    """The golden training of every compressor through the drop-in optimizer (mpirun) too."""
    if not HAVE_MPI:
        pytest.skip("mpirun or Horovod missing (launch/setup installs them)")
    n, out, tags = ddp_runs
    mpirun(n, "worker_hvd.py", out, outdir=out)
    return n, out, tags


@pytest.mark.parametrize("spec", golden.COMPRESSORS)
def test_hook_gives_the_optimizers_averages_bit_for_bit(golden_runs, spec):
    n, out, tags = golden_runs
    for r in range(n):
        hvd = torch.load(golden.out_path(out, "hvd", spec, n, r))
        for tag in tags:
            ddp = torch.load(golden.out_path(out, "ddp", spec, n, r, tag))
            assert ddp["step"] == golden.STEPS
            for k in range(golden.STEPS):
                for name in golden.SPECS:
                    a, b = hvd["grads"][k][name], ddp["grads"][k][name]
                    assert a.dtype == b.dtype == golden.SPECS[name][1]
                    assert torch.equal(torch.nan_to_num(a, nan=7.5),
                                       torch.nan_to_num(b, nan=7.5)), (r, tag, k, name)
            # the NaN on rank 1 at the last step made the tensor NaN on every rank
            assert hvd["nonfinite"] == ddp["nonfinite"] == ["nan.weight"]
            assert torch.isnan(ddp["grads"][-1]["nan.weight"]).all()
            for name, p in hvd["params"].items():
                assert torch.equal(torch.nan_to_num(p), torch.nan_to_num(ddp["params"][name]))
        # the parameter unused on rank 1 in one step: that rank counted as zeros
        if spec == "none":
            k = golden.ABSENT_STEP
            want = sum(golden.golden_grad(golden.ABSENT, q, k) for q in range(n) if q != 1) / n
            assert torch.allclose(hvd["grads"][k][golden.ABSENT], want, rtol=1e-6, atol=1e-8)
        # not a vacuous comparison: the compressed averages moved the parameters
        assert hvd["grads"][0]["fc1.weight"].abs().sum() > 0
        assert hvd["params"]["conv.weight"].abs().sum() > 0


def test_hook_cases(cases_run):
    """Transport, stateless compressors against a single-process reference, the summable
    path, static_graph, an unused and a frozen parameter, no_sync, Auto, the errors; issue
    14's training loops (GradScaler, clipping, closures, a GAN's two DDP models, sparse
    embeddings refused, Join with uneven inputs, casts that keep range, DGC with two param
    groups and LambdaLR) against plain torch."""
    n, out, log = cases_run
    for r in range(n):
        f = out / f"rank{r}.ok"
        assert f.exists(), f"rank {r} did not finish:\n{log[-4000:]}"
        assert f.read_text().startswith("ddp cases OK")


def test_checkpoint_resumes_exactly_in_new_processes(ddp_runs):
    """The run of worker_cases' launch checkpointed after N steps and went on K more; the
    processes of worker_ddp's launch load the checkpoint and take the K steps: the same
    parameters, bit for bit."""
    import worker_resume
    n, out, _ = ddp_runs
    for spec in worker_resume.SPECS:
        for r in range(n):
            full = torch.load(golden.out_path(out, "full", spec, n, r))
            resumed = torch.load(golden.out_path(out, "resume", spec, n, r))
            for name, p in full.items():
                assert torch.equal(p, resumed[name]), (spec, r, name)


def _epochs(out: str):
    """(epoch, accuracy, MB sent per rank, ratio) from the main job's output."""
    return re.findall(r"epoch +(\d+) +test acc +([\d.]+) %.*?sent/rank +([\d.]+) MB.*?"
                      r"ratio +([\d.]+)x", out)


@pytest.mark.skipif(not HAVE_MPI, reason="mpirun or Horovod missing")
def test_main_job_under_torchrun_matches_mpirun(tmp_path):
    """Same seed, same accuracy, bytes and ratio: everything as wire messages (the
    uncompressed tensors too), so the averages are the same bits on both paths."""
    args = ["--epochs", "2", "--no-progress", "--compression", "alq:bits=3",
            "--no-allreduce"]
    script = os.path.join(ROOT, "examples", "train_mnist.py")
    via_mpi = launch([os.path.join(ROOT, "launch", "run"), "-np", "2", sys.executable,
                      script, *args], tmp_path)
    via_ddp = launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2", script, *args], tmp_path)
    assert "torch.distributed (DDP hook)" in via_ddp and "Horovod" in via_mpi
    a, b = _epochs(via_mpi), _epochs(via_ddp)
    assert len(a) == 2 and a == b, (a, b)
    assert float(a[-1][1]) > 80 and float(a[-1][3]) > 5


@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None,
                    reason="PyTorch Lightning missing (launch/setup installs it)")
def test_lightning_example(tmp_path):
    """examples/lightning_mnist.py: DDPStrategy with hvdcomp's hook on 2 CPU processes,
    logging the loss with sync_dist=True in every step (#24 item 5)."""
    out = launch([sys.executable, os.path.join(ROOT, "examples", "lightning_mnist.py"),
                  "--epochs", "2", "--json", str(tmp_path / "res.json")], tmp_path)
    import json
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["world_size"] == 2 and res["steps"] > 0, out[-3000:]
    assert res["test_acc"] > 80, res
    assert res["compression"].startswith("alq") and res["ratio"] > 5, res
    # every rank's exchange ran once per optimizer step
    assert res["hook_steps"] == [res["steps"]] * 2, res
    # Lightning's sync_dist all-reduce of the loss next to the exchange, every step: the
    # processes' mean (checked in the example against every process's own loss)
    assert res["sync_dist_steps"] == res["steps"], res
    # fit then validate and test with the same trainer and HookState (#24 item 3): they run
    # (the exchange does not: the example checks the hook's step) and agree with the
    # accuracy computed directly on the 1,000 test digits
    assert abs(res["validate_acc"] - res["test_acc"]) < 1e-3, res
    assert abs(res["test_acc_lightning"] - res["test_acc"]) < 1e-3, res


def test_backend_rules():
    """CUDA parameters without nccl (and CPU ones without gloo, or both kinds at once) are
    refused at set-up with the backend named; the valid pairs pass."""
    from hvdcomp.ddp import check_backend
    check_backend({"cpu"}, "gloo")
    check_backend({"cuda"}, "nccl")
    for devices, backend, text in (({"cuda"}, "gloo", "CUDA parameters need the nccl"),
                                   ({"cpu"}, "nccl", "CPU parameters need the gloo"),
                                   ({"cpu", "cuda"}, "nccl", "several device types")):
        with pytest.raises(ValueError, match=text):
            check_backend(devices, backend)
