"""Parameter shapes of ResNet-50 (torchvision layout: 161 tensors, 25,557,032 parameters)
and BERT-base (uncased: 199 tensors, 109,482,240 parameters), built from their structure
so the benchmarks need neither torchvision nor transformers."""
from __future__ import annotations

from typing import List, Tuple

Shape = Tuple[int, ...]


def resnet50() -> List[Tuple[str, Shape]]:
    out: List[Tuple[str, Shape]] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)),
                                    ("bn1.bias", (64,))]
    inplanes = 64
    for li, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}."
            out += [(p + "conv1.weight", (planes, inplanes, 1, 1)), (p + "bn1.weight", (planes,)),
                    (p + "bn1.bias", (planes,)),
                    (p + "conv2.weight", (planes, planes, 3, 3)), (p + "bn2.weight", (planes,)),
                    (p + "bn2.bias", (planes,)),
                    (p + "conv3.weight", (planes * 4, planes, 1, 1)),
                    (p + "bn3.weight", (planes * 4,)), (p + "bn3.bias", (planes * 4,))]
            if b == 0:
                out += [(p + "downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                        (p + "downsample.1.weight", (planes * 4,)),
                        (p + "downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    out += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return out


def bert_base() -> List[Tuple[str, Shape]]:
    h, ff, vocab = 768, 3072, 30522
    out: List[Tuple[str, Shape]] = [
        ("embeddings.word_embeddings.weight", (vocab, h)),
        ("embeddings.position_embeddings.weight", (512, h)),
        ("embeddings.token_type_embeddings.weight", (2, h)),
        ("embeddings.LayerNorm.weight", (h,)), ("embeddings.LayerNorm.bias", (h,))]
    for i in range(12):
        p = f"encoder.layer.{i}."
        for m in ("query", "key", "value"):
            out += [(p + f"attention.self.{m}.weight", (h, h)),
                    (p + f"attention.self.{m}.bias", (h,))]
        out += [(p + "attention.output.dense.weight", (h, h)),
                (p + "attention.output.dense.bias", (h,)),
                (p + "attention.output.LayerNorm.weight", (h,)),
                (p + "attention.output.LayerNorm.bias", (h,)),
                (p + "intermediate.dense.weight", (ff, h)), (p + "intermediate.dense.bias", (ff,)),
                (p + "output.dense.weight", (h, ff)), (p + "output.dense.bias", (h,)),
                (p + "output.LayerNorm.weight", (h,)), (p + "output.LayerNorm.bias", (h,))]
    out += [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]
    return out


def numel(shapes) -> int:
    n = 0
    for _, s in shapes:
        k = 1
        for d in s:
            k *= d
        n += k
    return n


if __name__ == "__main__":
    for name, fn in (("resnet50", resnet50), ("bert_base", bert_base)):
        s = fn()
        print(name, len(s), "tensors", numel(s), "parameters")


def synthetic_params(shapes: List[Tuple[str, Shape]], rank: int):
    """``[(name, parameter)]`` of ``shapes`` with synthetic gradients for ``rank``: the
    parameters are expanded zeros (an exchange reads only their shapes), each gradient a
    view of one random bank of at most 2^25 floats (N(0, 1e-6), seeded by the rank), at
    offsets that differ per tensor: a BERT-sized set per rank would not fit 8 ranks in
    the development machine's memory."""
    import math
    import torch
    total = sum(math.prod(s) for _, s in shapes)
    bank = torch.randn(min(total, 1 << 25), generator=torch.Generator().manual_seed(100 + rank))
    bank *= 1e-3
    params, off = [], 0
    for i, (name, shape) in enumerate(shapes):
        n = math.prod(shape)
        p = torch.nn.Parameter(torch.zeros(()).expand(shape))
        o = (off * 7 + i * 4099) % max(len(bank) - n, 1)
        p.grad = bank[o:o + n].view(shape)
        off += n
        params.append((name, p))
    return params
