"""A few training steps of the main job's model (FC-300-100 on the MNIST digits) with
several compressors, with $HVDCOMP_TEST_THREADS threads for everything hvdcomp does
(OMP_NUM_THREADS, set before PyTorch loads, for the exchange's worker threads and the
PyTorch ops they run; the kernels' own count, host.set_num_threads): rank 0 writes the
SHA-256 of the parameters after the steps, per compressor, to $HVDCOMP_TEST_OUT/params.json.
Two runs with different thread counts must write the same file (test_reproducible.py): the
kernels' reductions have a fixed order whatever the thread count.

The model's own forward and backward run on one thread in both runs: PyTorch's CPU GEMMs
are not thread-count invariant (FC-300-100 after 4 SGD steps on one process differs bit-wise
between 1, 2 and 3 threads on the development machine), which is PyTorch's business, not
the exchange's."""
import hashlib
import json
import os
import sys

THREADS = int(os.environ["HVDCOMP_TEST_THREADS"])
os.environ["OMP_NUM_THREADS"] = str(THREADS)     # before OpenMP starts (with torch)

import torch  # noqa: E402
import torch.nn.functional as F

from common import ROOT, say  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "examples"))
from mnist import FC300100, load_digits  # noqa: E402

import hvdcomp.torch as hvd  # noqa: E402
from hvdcomp import backends  # noqa: E402
from hvdcomp.backends import host  # noqa: E402

SPECS = ["alq:bits=3", "qsgd:bits=4,bucket_size=512,entropy=1", "terngrad",
         "topk:density=0.01", "dqsg:bits=4", "signef"]
STEPS = 4


def digest(model) -> str:
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main():
    hvd.init()
    threads = THREADS
    host.set_num_threads(threads)
    torch.set_num_threads(1)                     # the model's forward and backward (above)
    assert backends.kernel_backend("cpu") is host and host.get_num_threads() == threads
    rank, size = hvd.rank(), hvd.size()
    x, y, _, _ = load_digits(0)
    out = {}
    for spec in SPECS:
        torch.manual_seed(0)
        model = FC300100()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression=spec, min_compress_numel=1)
        for step in range(STEPS):
            idx = torch.arange(64) + 64 * (step * size + rank)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        opt.close()
        d = digest(model)
        # every rank holds the same parameters
        ds = hvd.allgather_object(d, name=f"digest.{spec}")
        assert len(set(ds)) == 1, (spec, ds)
        out[spec] = d
    if rank == 0:
        with open(os.path.join(os.environ["HVDCOMP_TEST_OUT"], "params.json"), "w") as f:
            json.dump({"threads": threads, "digests": out}, f, indent=1)
    say(rank, f"threads OK ({threads} threads)")


if __name__ == "__main__":
    main()
