"""Nodes joining and leaving a job under torchrun's elastic agent (issue 24, item 1): two
torchrun agents on this machine are two nodes of one job (``--nnodes 1:2 --nproc-per-node
2``, c10d rendezvous on 127.0.0.1), running examples/elastic_ddp.py with hvdcomp's hook.

Node A starts alone (world 2, flat exchange) and holds after the checkpoint of step 10;
node B starts, torchrun stops A's workers and starts the group again at world 4 (2 hosts
x 2 ranks: the hierarchical exchange where the compressor allows it), which resumes from
step 10's checkpoint and holds after step 30's; node B dies (its agent and workers,
SIGKILL), A's workers fail in their next barrier, and A's agent (``--max-restarts 1``)
starts them again at world 2, which resume from step 30's checkpoint and finish at step 40.
Every phase ends at a checkpoint, so no step is lost or repeated: the job trains steps
0-9 on 2 ranks, 10-29 on 4, 30-39 on 2.
"""
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "elastic_ddp.py")
TIMEOUT = 300            # the whole job; a hang past it is a failure
# Short rendezvous: a round that has --nnodes' minimum closes 1 s after its last node
# joined, and a node without a heartbeat (sent every second) for 4 s is dead.  (Not 2:
# torchrun's first heartbeat after a round can come 2 s after its last one, and a live
# node declared dead stays out of the rendezvous for good.)
RDZV = ("join_timeout=120,last_call_timeout=1,close_timeout=10,keep_alive_interval=1,"
        "keep_alive_max_attempt=4")
SCHEDULE = [2] * 10 + [4] * 20 + [2] * 10          # the world size of each step


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One torchrun agent with 2 workers; its output in ``<tmp>/<name>.log``."""

    def __init__(self, name, tmp, port, args, host):
        self.name, self.path, self.killed = name, tmp / f"{name}.log", False
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1",
                   # a store per attempt: PyTorch issue 135712 (examples/elastic_ddp.py)
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        conf = RDZV if host else RDZV + ",is_host=false"     # A hosts the rendezvous store
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "nodes", "--rdzv-conf", conf, EXAMPLE, *map(str, args)]
        with open(self.path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self):
        with open(self.path) as f:
            return f.read()

    def kill(self):
        """The whole node at once: the agent and its workers (torchrun starts each worker
        in a session of its own), SIGKILL; nothing once the agent has exited (its pid may
        be another process's by then)."""
        self.killed = True
        if self.proc.poll() is not None:
            return
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()


def resize_job(tmp, compression):
    """Run the job on 2, then 4, then 2 ranks (module docstring): (both nodes' output, the
    final {"params", "hook"} of the 2 ranks)."""
    port, ck = free_port(), tmp / "ck"
    args = ["--dir", ck, "--out", tmp / "out", "--compression", compression,
            "--hold", "10:2", "--hold", "30:4"]
    deadline = time.monotonic() + TIMEOUT
    nodes = []

    def wait_for(what, done):
        while not done():
            if time.monotonic() > deadline or any(      # (or a node ended too soon)
                    not n.killed and n.proc.poll() is not None for n in nodes):
                for n in nodes:
                    n.kill()
                pytest.fail(f"waiting for {what}:\n" + "\n".join(
                    f"--- node {n.name} (rc {n.proc.returncode})\n{n.log()[-6000:]}"
                    for n in nodes))
            time.sleep(0.1)

    def latest():
        try:
            with open(ck / "latest") as f:
                return int(f.read())
        except (OSError, ValueError):
            return -1

    try:
        nodes.append(Node("A", tmp, port, args, host=True))
        wait_for("node A's checkpoint of step 10", lambda: latest() == 10)
        nodes.append(Node("B", tmp, port, args, host=False))
        wait_for("the checkpoint of step 30 at world 4", lambda: latest() == 30)
        nodes[1].kill()
        wait_for("node A to finish", lambda: nodes[0].proc.poll() == 0)
    finally:
        for n in nodes:
            n.kill()
    out = "\n".join(n.log() for n in nodes)
    for r in range(4):         # every phase resumed where the one before it stopped
        assert f"rank {r}: resumed at step 10 (saved by 2 ranks, now 4)" in out, out[-8000:]
    for r in range(2):
        assert f"rank {r}: resumed at step 30 (saved by 4 ranks, now 2)" in out, out[-8000:]
    # one host of 2 ranks: a flat exchange; 2 hosts of 2: hierarchical, rank r holding the
    # state of piece r % 2 (docs/settings.md, hierarchy); a flat one again at the end
    def layouts(step, n):
        return [torch.load(ck / f"step-{step}" / f"hook.{r}.pt", weights_only=False)
                .get("hierarchy") for r in range(n)]
    assert layouts(10, 2) == layouts(40, 2) == [None, None]
    assert layouts(20, 4) == [[2, 2, r % 2] for r in range(4)]
    finals = [torch.load(tmp / "out" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for f in finals:
        assert f["hook"]["step"] == 40 and f["hook"]["world_size"] == 2
        assert all(torch.isfinite(p).all() for p in f["params"])
        assert all(torch.equal(x, y) for x, y in zip(f["params"], finals[0]["params"]))
    return out, finals


def reference(schedule):
    """examples/elastic_ddp.py's training in one process, every step's gradient the mean
    over the ranks of a world of ``schedule[step]`` ranks (rank r's batch of step s drawn
    from seed 1000 s + r, as the example draws it): the final parameters."""
    torch.manual_seed(0)
    teacher = torch.randn(64, 10)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, size in enumerate(schedule):
        grads = []
        for r in range(size):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1000 * step + r))
            loss = torch.nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
        for p, *g in zip(model.parameters(), *grads):
            p.grad = torch.stack(g).mean(0)
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_a_joining_and_a_leaving_node_reset_the_per_rank_state_only(tmp_path):
    """TopK at density 1 keeps a residual per rank (reset at each resize, with the
    warning) and loses nothing: the job's parameters are the plain average's of the same
    schedule."""
    out, finals = resize_job(tmp_path, "topk:density=1.0")
    for r in range(4):
        assert (f"hvdcomp rank {r}: checkpoint of world size 2 loaded into a world of 4: "
                f"per-rank state reset (topk: residuals); shared state kept (none)") in out
    for r in range(2):
        assert (f"hvdcomp rank {r}: checkpoint of world size 4 loaded into a world of 2: "
                f"per-rank state reset (topk: residuals); shared state kept (none)") in out
    assert finals[0]["hook"]["compressor_state"]["residuals"]   # error feedback running
    want = reference(SCHEDULE)
    for p, w in zip(finals[0]["params"], want):
        torch.testing.assert_close(p, w, rtol=1e-4, atol=1e-5)
    # not vacuous: the 20 steps on 4 ranks moved the parameters elsewhere than 2 ranks would
    assert max((a - b).abs().max() for a, b in zip(want, reference([2] * 40))) > 1e-2
