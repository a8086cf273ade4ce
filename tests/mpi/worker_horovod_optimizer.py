"""Horovod's own DistributedOptimizer with hvdcomp's summable cast: compression=
hvdcomp.get("fp16") gives the average of every rank's gradient (Horovod's contract:
compress, allreduce, decompress), also for a bfloat16 model whose gradients go beyond
fp16's 65504 (they travel as float32: the average comes back finite, equal to Horovod's
own optimizer's with Compression.none on the same gradients, #24 item 6); compression=hvdcomp.get("bf16") raises hvdcomp's TypeError on every
rank at the first backward pass (Horovod 0.28.1 rejects bfloat16), and no rank hangs."""
import copy

import torch

from common import say

import horovod.torch as hvd
import hvdcomp


def data(rank):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(16, 30, generator=g), torch.randint(0, 5, (16,), generator=g)


def local_grads(model, rank):
    m = copy.deepcopy(model)
    x, y = data(rank)
    torch.nn.functional.cross_entropy(m(x), y).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def big_bf16_backward(model, rank):
    """A backward pass of the bfloat16 ``model`` on ``rank``'s data with the loss scaled by
    1e8: gradients of order 1e6, beyond fp16's 65504 even after the division by the world
    size."""
    x, y = data(rank)
    loss = torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
    (loss * 1e8).backward()


def bf16_beyond_fp16(model, rank, size):
    """#24 item 6: Horovod's own optimizer, hvdcomp's fp16, a bf16 model: the average of
    every rank's gradient (computed here from each rank's data), finite, within bf16's
    rounding."""
    m = copy.deepcopy(model).to(torch.bfloat16)
    per_rank = []
    for r in range(size):
        mc = copy.deepcopy(m)
        big_bf16_backward(mc, r)
        per_rank.append({n: p.grad.double() for n, p in mc.named_parameters()})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=[(f"big.{n}", p)
                                                     for n, p in m.named_parameters()],
                                   compression=hvdcomp.get("fp16"))
    big_bf16_backward(m, rank)
    opt.synchronize()
    largest = 0.0
    for n, p in m.named_parameters():
        assert p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all(), n
        stack = torch.stack([g[n] for g in per_rank])
        mean, scale = stack.mean(0), stack.abs().max(0).values
        # float32 sums of the shares (a few float32 ulps of the largest), then one rounding
        # to bf16 (8 significant bits: a relative error of at most 2**-8)
        tol = mean.abs() * 2.0 ** -8 + scale * 2.0 ** -20
        err = (p.grad.double() - mean).abs()
        assert bool((err <= tol).all()), (n, float((err - tol).max()))
        largest = max(largest, float(mean.abs().max()))
    assert largest > 65504 * size, largest      # the case fp16 alone would turn into Inf
    ref = horovod_none_average(m, rank)
    for n, p in m.named_parameters():
        if size == 2:
            # float32 sums of g/2 and of g, both scaled by powers of two, then one rounding
            # to bf16: bit for bit (the sum of two floats is the same in either order)
            assert torch.equal(p.grad, ref[n]), (n, float((p.grad.float() - ref[n].float())
                                                          .abs().max()))
        else:
            tol = ref[n].float().abs() * 2.0 ** -7 + 2.0 ** -60
            assert bool(((p.grad.float() - ref[n].float()).abs() <= tol).all()), n
    # plain torch SGD on a bf16 copy with Horovod's average: the same parameters
    plain = copy.deepcopy(m)
    for n, p in plain.named_parameters():
        p.grad = ref[n].clone()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    with opt.skip_synchronize():
        opt.step()
    for (n, p), q in zip(m.named_parameters(), plain.parameters()):
        if size == 2:
            assert torch.equal(p.detach(), q.detach()), n


def horovod_none_average(m, rank):
    """The reference for :func:`bf16_beyond_fp16`: Horovod's own DistributedOptimizer with
    Compression.none over float32 leaves whose gradients are this rank's bf16 gradients of
    ``m`` (Horovod 0.28.1's CPU allreduce rejects bfloat16 tensors, so the bf16 values go
    as float32, exactly), its average cast to bf16."""
    mc = copy.deepcopy(m)
    for p in mc.parameters():
        p.grad = None
    big_bf16_backward(mc, rank)
    leaves = [(f"ref.{n}", torch.zeros(p.shape, requires_grad=True))
              for n, p in mc.named_parameters()]
    ropt = hvd.DistributedOptimizer(torch.optim.SGD([q for _, q in leaves], lr=0.1),
                                    named_parameters=leaves,
                                    compression=hvd.Compression.none)
    sum((q * p.grad.float()).sum() for (_, q), p in zip(leaves, mc.parameters())).backward()
    ropt.synchronize()
    return {n: q.grad.to(torch.bfloat16)
            for (_, q), (n, _) in zip(leaves, mc.named_parameters())}


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # the average, computed independently: every rank's gradient from its own data
    per_rank = [local_grads(model, r) for r in range(size)]
    mean = {n: sum(g[n] for g in per_rank) / size for n in per_rank[0]}

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvdcomp.get("fp16"))
    x, y = data(rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    for n, p in model.named_parameters():
        # each rank's share g/size is rounded to fp16 once, then summed in fp16: error below
        # size ulps of fp16 at the gradients' scale
        scale = max(float(g[n].abs().max()) for g in per_rank)
        tol = size * scale * 2.0 ** -10
        err = float((p.grad - mean[n]).abs().max())
        assert err <= tol, (n, err, tol)
    with opt.skip_synchronize():
        opt.step()

    bf16_beyond_fp16(model, rank, size)

    m2 = copy.deepcopy(model)
    named = [(f"bf.{n}", p) for n, p in m2.named_parameters()]
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1),
                                    named_parameters=named, compression=hvdcomp.get("bf16"))
    try:
        torch.nn.functional.cross_entropy(m2(x), y).backward()
        opt2.synchronize()
        raise AssertionError("bf16 went through Horovod's allreduce")
    except TypeError as e:
        assert "hvdcomp's bf16 cannot go through Horovod's own allreduce" in str(e), e
    hvd.allreduce(torch.zeros(1), name="done")   # every rank is still in step
    say(rank, "horovod optimizer OK")


if __name__ == "__main__":
    main()
