"""``hvdcomp selftest``: a 2-rank exchange of every registered compressor of hvdcomp (its
example spec, :func:`hvdcomp.compressors.examples`) through every transport this machine
offers, each checked bit for bit, with PASS/FAIL per item.

The command starts its own processes:

* ``mpirun -np 2``: the "mpi" transport (mpi4py) and, when Horovod is installed with MPI,
  the "horovod" transport (Horovod's allgather over its MPI controller);
* ``horovodrun --gloo -np 2 -H localhost:2``, when Horovod is built with Gloo: the
  "horovod" transport over Gloo (no MPI world there).

On every rank each item builds an :class:`hvdcomp.exchange.Exchange` of a few tensors,
gives it seeded per-rank gradients, and compares the averages it returns with what one
process computes from the same inputs: every rank's gradient encoded with a fresh
compressor and that rank's key, the messages round-tripped through bytes and combined in
rank order, then finalized (the wire format's promise: every rank gets the same average,
bit for bit); for a compressor summed in rounds (powersgd), the rounds played by one
process in rank order (:func:`hvdcomp.exchange.rounds.simulate`).  An item passes when it matches on every rank.  The workers print one line
per item, ``HVDCOMP-SELFTEST {json}``, from rank 0; the command collects them.

Exit status: 0 when every item passed, 1 when one failed or a launcher could not run, 2
when no launcher is available at all (no mpirun, no horovodrun).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from .compressors import examples, registry

__all__ = ["SPECS", "main", "run", "launchers"]

# every compressor of hvdcomp's registry, by its example spec, and one entropy-coded
SPECS = [spec for name, spec in examples().items()
         if registry()[name].__module__.startswith("hvdcomp.")]
SPECS.append("qsgd:bits=3,bucket_size=256,entropy=1")
SHAPES = {"conv.weight": (8, 3, 5, 5), "fc.weight": (100, 57), "head.weight": (10, 100)}
MARK = "HVDCOMP-SELFTEST "
SEED = 11


def _grad(name: str, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g) * (1 + rank)


def _expected(spec: str, names: Sequence[str], tensor_ids: Dict[str, int], size: int,
              rank: int) -> Dict[str, "object"]:
    """One process's average of every rank's encoded gradient (module docstring)."""
    import torch

    import hvdcomp
    from hvdcomp.compressors.protocols import SummedRounds
    from hvdcomp.exchange.rounds import simulate
    out = {}
    for name in names:
        if isinstance(hvdcomp.get(spec), SummedRounds):   # no messages: the rounds
            keys = [hvdcomp.TensorKey(name, tensor_ids[name], 0, r, size, SEED,
                                      shape=SHAPES[name], dtype=torch.float32)
                    for r in range(size)]
            out[name] = simulate([hvdcomp.get(spec) for _ in range(size)],
                                 [_grad(name, r) for r in range(size)], keys)[rank]
            continue
        keys = [hvdcomp.TensorKey(name, tensor_ids[name], 0, r, size, SEED)
                for r in range(size)]
        msgs = [hvdcomp.Message.from_bytes(hvdcomp.get(spec).encode(_grad(name, r), keys[r])
                                           .to_bytes()) for r in range(size)]
        acc = torch.zeros(_grad(name, 0).numel(), dtype=torch.float32)
        rx = hvdcomp.get(spec)
        rx.combine(msgs, keys, acc)
        out[name] = rx.finalize(acc, keys[rank])
    return out


def _item(spec: str, transport) -> Optional[str]:
    """None when the exchange through ``transport`` matches the reference on this rank,
    else what differed."""
    import torch

    import hvdcomp
    from hvdcomp.exchange import Exchange
    params = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]
    ex = Exchange(params, hvdcomp.get(spec), transport, fusion_bytes=40000,
                  min_compress_numel=16, seed=SEED)
    try:
        for n, p in params:
            p.grad = _grad(n, transport.rank)
        ex.begin(0)
        for n, _ in params:
            ex.ready(n)
        got, _ = ex.finish()
    finally:
        ex.close()
    ids = {n: e.tensor_id for n, e in ex.entries.items()}
    want = _expected(spec, [n for n, _ in params], ids, transport.size, transport.rank)
    for n in want:
        if not torch.equal(got[n], want[n]):
            return (f"{n}: max |difference| {(got[n] - want[n]).abs().max().item():.3g} "
                    f"from the one-process reference")
    return None


def worker(transports: Sequence[str], launcher: str) -> int:
    """Run every item on this rank; rank 0 prints the results (module docstring)."""
    import numpy as np

    hvd = None
    if "horovod" in transports:
        import horovod.torch as hvd
        hvd.init()
    from hvdcomp.transport import make
    ok_all = True
    for tname in transports:
        try:
            tp = make(tname)
        except Exception as e:          # noqa: BLE001 - reported as the item's result
            tp, error = None, f"{type(e).__name__}: {e}"
        for spec in SPECS:
            if tp is not None:
                try:
                    problem = _item(spec, tp)
                except Exception as e:  # noqa: BLE001 - reported as the item's result
                    problem = f"{type(e).__name__}: {e}"
                # every rank's verdict (the count of ranks with a problem)
                bad = int(tp.allreduce_sum(np.array([float(problem is not None)]))[0])
                rank, size = tp.rank, tp.size
            else:
                problem, bad, rank, size = error, 1, (hvd.rank() if hvd else 0), 0
            ok_all &= bad == 0
            if rank == 0:
                print(MARK + json.dumps({"launcher": launcher, "transport": tname,
                                         "compressor": spec, "ranks": size,
                                         "passed": bad == 0, "ranks_failed": bad,
                                         "detail": problem or ""}), flush=True)
    return 0 if ok_all else 1


# --- the command ------------------------------------------------------------------------

def _have(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def launchers(np_: int = 2) -> List[dict]:
    """What this machine can start: [{"name", "cmd" (argv prefix), "transports"}], and a
    "missing" entry (with "why") for each launcher it cannot use."""
    out = []
    horovod = _have("horovod.torch")
    why_hvd = "Horovod is not installed"
    built = {}
    if horovod:
        try:
            import horovod.torch as hvd
            built = {"mpi": hvd.mpi_built(), "gloo": hvd.gloo_built()}
        except Exception as e:          # noqa: BLE001 - reported
            horovod, why_hvd = False, f"horovod.torch does not import: {e}"
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        out.append({"name": "mpirun", "why": "mpirun not found"})
    else:
        ts = (["mpi"] if _have("mpi4py") else []) + (["horovod"] if built.get("mpi") else [])
        if not ts:
            out.append({"name": "mpirun", "why": "neither mpi4py nor Horovod with MPI"})
        else:
            args = [mpirun, "-np", str(np_)]
            v = subprocess.run([mpirun, "--version"], capture_output=True, text=True)
            if "open mpi" in (v.stdout + v.stderr).lower():
                if os.geteuid() == 0:
                    args.append("--allow-run-as-root")
                args += ["--oversubscribe", "--bind-to", "none"]
            out.append({"name": "mpirun", "cmd": args, "transports": ts})
    hr = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    hr = hr if os.path.exists(hr) else shutil.which("horovodrun")
    if not horovod:
        out.append({"name": "horovodrun --gloo", "why": why_hvd})
    elif not built.get("gloo"):
        out.append({"name": "horovodrun --gloo", "why": "Horovod is built without Gloo"})
    elif hr is None:
        out.append({"name": "horovodrun --gloo", "why": "horovodrun not found"})
    else:
        out.append({"name": "horovodrun --gloo",
                    "cmd": [hr, "--gloo", "-np", str(np_), "-H", f"localhost:{np_}"],
                    "transports": ["horovod"]})
    return out


def run(np_: int = 2, timeout: float = 300.0, out=None) -> int:
    """Start every available launcher's workers, print PASS/FAIL per item to ``out``
    (default stdout); returns the exit status (module docstring)."""
    out = out or sys.stdout
    status, ran = 0, 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for la in launchers(np_):
        if "cmd" not in la:
            print(f"SKIP  {la['name']:<18} {la['why']}", file=out)
            continue
        ran += 1
        cmd = la["cmd"] + [sys.executable, "-m", "hvdcomp.selftest", "--worker",
                           "--transports", ",".join(la["transports"]),
                           "--launcher", la["name"]]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            text, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            text = f"{e.stdout or ''}{e.stderr or ''}"
            text = text.decode() if isinstance(text, bytes) else text
            rc = f"timed out after {timeout:g} s"
        items = [json.loads(line.split(MARK, 1)[1]) for line in text.splitlines()
                 if MARK in line]
        for it in items:
            verdict = "PASS" if it["passed"] else "FAIL"
            print(f"{verdict}  {la['name']:<18} {it['transport']:<8} {it['compressor']:<40}"
                  + (f" bit-exact on {it['ranks']} ranks" if it["passed"]
                     else f" {it['detail']}"), file=out)
            if not it["passed"]:
                status = 1
        if rc != 0 or len(items) != len(SPECS) * len(la["transports"]):
            status = 1
            tail = "\n".join(text.strip().splitlines()[-15:])
            print(f"FAIL  {la['name']:<18} the workers ended with status {rc} after "
                  f"{len(items)} of {len(SPECS) * len(la['transports'])} items; their last "
                  f"output:\n{tail}", file=out)
    if not ran:
        print("FAIL  no launcher available (mpirun or horovodrun): nothing was tested",
              file=out)
        return 2
    print("selftest: " + ("all passed" if status == 0 else "FAILED"), file=out)
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvdcomp.selftest")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--transports", default="mpi", help=argparse.SUPPRESS)
    ap.add_argument("--launcher", default="", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.transports.split(","), args.launcher)
    return run(timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
