"""Horovod on an MPI that does not provide MPI_THREAD_MULTIPLE (#13, bad input).

HOROVOD_MPI_THREADS_DISABLE=1 makes Horovod start MPI with MPI_THREAD_SINGLE, as an MPI
library built without thread support leaves it.  hvdcomp's mpi transport needs
MPI_THREAD_MULTIPLE next to Horovod's background thread (hvdcomp.transport.mpi), so

* the drop-in optimizer's default transport is Horovod's allgather, chosen on every rank and
  logged with the reason (INFO, rank 0), and a step averages the ranks' gradients exactly;
* an explicit ``transport="mpi"`` raises one RuntimeError on every rank when the optimizer
  is built, naming the level MPI provides and the level needed; the script catches it and
  leaves it in its marker file for the test.
"""
import logging
import os

os.environ["HOROVOD_MPI_THREADS_DISABLE"] = "1"       # read by hvd.init()

import torch  # noqa: E402

import hvdcomp.torch as hvd  # noqa: E402
from common import say  # noqa: E402


def model_and_optimizer(transport):
    """Linear(64, 32) at zero, SGD(lr=1), "none" through the wire messages (no allreduce)."""
    model = torch.nn.Linear(64, 32)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression="none", allreduce_summable=False,
                                   transport=transport)
    return model, opt


def main():
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    hvd.init()
    from mpi4py import MPI                  # MPI runs already: mpi4py only reads its level
    assert MPI.Query_thread() < MPI.THREAD_MULTIPLE, MPI.Query_thread()
    rank, size = hvd.rank(), hvd.size()

    model, opt = model_and_optimizer(None)
    assert opt.transport == "horovod", opt.transport
    # this rank's gradient: (rank + 1) * (0, 1, 2, ...), small integers, so the average
    # (size + 1) / 2 * (0, 1, 2, ...) is exact in float32 in any summation order
    loss = sum(((p * torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape))
                * (rank + 1)).sum() for p in model.parameters())
    loss.backward()
    opt.step()
    for p in model.parameters():
        want = -(size + 1) / 2 * torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
        assert torch.equal(p.detach(), want), (p.detach() - want).abs().max()
    opt.close()

    try:
        model_and_optimizer("mpi")
    except RuntimeError as e:
        msg = str(e)
    else:
        raise AssertionError("transport='mpi' was accepted on an MPI without "
                             "MPI_THREAD_MULTIPLE")
    say(rank, f"thread level OK: transport {opt.transport}; transport='mpi': {msg}")


if __name__ == "__main__":
    main()
