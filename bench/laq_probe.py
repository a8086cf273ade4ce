"""Why LAQ diverges on the real task's CNN (bench/results/real_task.md, claims): one rank of
LAQ on Fashion-MNIST, the example's CNN, SGD with momentum 0.9 and lr 0.05 (the real task's
peak), batch 64; prints the loss and, for the three largest weights, LAQ's (uploads, skips)
and the first step's upload test (||delta||^2 against 3||eps||^2, Sun et al., NeurIPS 2019,
Eq. 7 with no history).  Single process: world size 1, so the average is the aggregate.

    .venv/bin/python bench/laq_probe.py --spec laq:bits=4,alpha=0.05 --steps 80
"""
import argparse
import os
import sys

import torch

import hvdcomp
from hvdcomp.compressors.base import TensorKey
from hvdcomp.ops.laq import encode_innovation

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import fashion  # noqa: E402

WATCH = ("7.weight", "9.weight", "3.weight")


def first_step_test(grad: torch.Tensor, bits: int):
    """(max/rms, ||delta||^2, 3||eps||^2) of LAQ's grid on ``grad`` with no previous upload
    (Qprev = 0), through the op LAQ itself uses (hvdcomp.ops.laq.encode_innovation)."""
    x = grad.detach().reshape(-1).to(torch.float32)
    inn = encode_innovation(x, None, bits)
    return (float(x.abs().max() / x.pow(2).mean().sqrt()), inn.delta_sq, 3 * inn.eps_sq)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="laq:bits=4,alpha=0.05")
    ap.add_argument("--steps", type=int, default=80)
    args = ap.parse_args()
    torch.manual_seed(0)
    x, y, _, _ = fashion.load()
    model = fashion.FashionCNN()
    laq = hvdcomp.get(args.spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(args.steps):
        idx = torch.randint(0, x.shape[0], (64,))
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(fashion.normalize(x[idx])), y[idx])
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                if name in WATCH:
                    r, d, e = first_step_test(p.grad, laq.bits)
                    print(f"step 0 {name}: {p.numel()} elements, max/rms {r:.1f}, "
                          f"||delta||^2 {d:.3g}, 3||eps||^2 {e:.3g}")
        before = [p.detach().clone() for p in model.parameters()]
        for i, (name, p) in enumerate(model.named_parameters()):
            key = TensorKey(name=name, tensor_id=i, step=step, rank=0, world_size=1)
            msg = laq.encode(p.grad, key)
            out = torch.zeros(p.numel())
            laq.combine([msg], [key], out)
            p.grad.copy_(out.view_as(p))
        opt.step()
        laq.after_step(step, sum(float((p.detach() - b).pow(2).sum())
                                 for p, b in zip(model.parameters(), before)))
        for event in laq.drain_events():
            print(f"step {step:3d} event: {event}")
        if step % 10 == 0 or step == args.steps - 1:
            counts = laq.counts()
            print(f"step {step:3d} loss {loss.item():.3g} (uploads, skips): "
                  + ", ".join(f"{n} {counts[n]}" for n in WATCH))


if __name__ == "__main__":
    main()
