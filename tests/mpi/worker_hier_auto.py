"""Auto's flat-or-hierarchical choice (hvdcomp/exchange/hier_choice.py) under mpirun, hosts
pretended by $HVDCOMP_TEST_HOSTS (2 hosts x 2 ranks, set by test_mpi_hier.py), through the
drop-in optimizer: every rank makes the same choice (``opt.hierarchy_choice``), which is
decide()'s on the costs it recorded, the tensors' paths follow it, and the step it runs
leaves the same parameters on every rank."""
import torch
import torch.nn.functional as F

from cases import case, run

import horovod.torch as horovod
import hvdcomp
import hvdcomp.torch as hvd
from hvdcomp.exchange.hier_choice import decide


def model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.Tanh(),
                               torch.nn.Linear(300, 40))


def batch(rank):
    g = torch.Generator().manual_seed(10 * rank)
    return torch.randn(8, 200, generator=g), torch.randint(0, 40, (8,), generator=g)


@case.each(["auto+alq:bits=3", "auto+dgc:density=0.01"])
def auto_choice(spec):
    """The choice: the same on every rank, decide()'s on its recorded costs; the paths
    follow it; one step leaves the same parameters everywhere."""
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), compression=spec,
                                   transport="mpi", min_compress_numel=16,
                                   hierarchy="auto")
    x, y = batch(horovod.rank())
    F.cross_entropy(m(x), y).backward()
    opt.step()
    c = opt.hierarchy_choice
    assert c is not None and (c.hosts, c.ranks_per_host) == (2, 2), c
    ex = opt._driver.exchange
    sizes = {"0.weight": 200 * 300, "2.weight": 300 * 40}
    allowed = list(ex.auto.fallbacks) + ["allgather", "reduce_scatter"]
    again = decide(sizes, ex.auto.model, allowed, c.host, c.cross, 2, 2, len(ex.buckets))
    assert again.as_dict() == c.as_dict(), (again, c)
    paths = opt.paths
    for name in ("0.weight", "2.weight"):
        assert (paths[name] == "hierarchical") == (c.paths.get(name) == "hierarchical"), \
            (paths, c)
    assert all(paths[b] != "hierarchical" for b in ("0.bias", "2.bias")), paths
    got = horovod.allgather_object((c.as_dict(), sorted(paths.items()),
                                    [p.detach().tolist() for p in m.parameters()]))
    assert all(g == got[0] for g in got), "ranks differ"
    print(f"rank {horovod.rank()} {spec}: {c.reason}", flush=True)


if __name__ == "__main__":
    run()
