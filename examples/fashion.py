"""The real task's data and models: Fashion-MNIST (Xiao, Rasul & Vollgraf, arXiv 1708.07747:
60,000 training and 10,000 test images of clothing, 28x28 grey levels, 10 classes) read
from its four IDX files with gzip + NumPy (no download, no torchvision), and two networks:

* :class:`FashionCNN`: two 5x5 convolutions (32, 64 channels, each followed by 2x2 max
  pooling) and a 1024-unit fully connected layer: 3,274,634 parameters, 98 % of them in the
  fully connected layers, so its gradient is large against its compute (the shape of
  AlexNet/VGG in the compression papers' experiments);
* :class:`FashionResNet`: a small residual network (He et al., CVPR 2016: 3x3 basic
  blocks with batch normalization, identity shortcuts, 1x1 projections where the width or
  stride changes): 308,074 parameters.

Where the files are: ``$HVDCOMP_FASHION_MNIST`` (a directory), else Debian's
``dataset-fashion-mnist`` package (/usr/share/datasets/fashion-mnist, which launch/setup
installs with apt-get when it can).  Elsewhere, the four files
(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz,
t10k-labels-idx1-ubyte.gz) come from https://github.com/zalandoresearch/fashion-mnist
(data/fashion); point ``HVDCOMP_FASHION_MNIST`` at their directory.

hvdcomp itself never imports this module: it serves the examples and the benchmarks.
"""
from __future__ import annotations

import gzip
import os
import zlib
from typing import Optional, Tuple

import numpy as np
import torch
from torch import nn

__all__ = ["DataError", "data_dir", "read_idx", "load", "normalize", "FashionCNN",
           "FashionResNet", "MODELS", "CLASSES", "ENV", "DEBIAN_DIR", "FILES"]

ENV = "HVDCOMP_FASHION_MNIST"
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
           "Sneaker", "Bag", "Ankle boot")
# mean and standard deviation of the 60,000 training images' pixels in [0, 1]
MEAN, STD = 0.2860, 0.3530
HOW_TO_GET = (f"install Debian's dataset-fashion-mnist package (launch/setup does, as root "
              f"with apt-get), or download the four files {', '.join(sum(FILES.values(), ()))} "
              f"from https://github.com/zalandoresearch/fashion-mnist (data/fashion) and set "
              f"{ENV}=<their directory>")


class DataError(RuntimeError):
    """A data file is missing, unreadable, truncated or not the IDX file it should be; the
    message names the path."""


def data_dir(directory: Optional[str] = None) -> str:
    """The directory of the four IDX files: ``directory``, else ``$HVDCOMP_FASHION_MNIST``,
    else Debian's /usr/share/datasets/fashion-mnist."""
    return directory or os.environ.get(ENV) or DEBIAN_DIR


def read_idx(path: str, ndim: int) -> np.ndarray:
    """The array of a gzipped IDX file of unsigned bytes (LeCun's MNIST format: two zero
    bytes, type code 0x08, the number of dimensions, each dimension as a big-endian uint32,
    then the data in C order).  Returns a uint8 array with ``ndim`` dimensions.

    Raises DataError (naming ``path``) when the file is missing or unreadable, not gzip,
    has another type or number of dimensions, or holds fewer or more bytes than its header
    announces (a truncated download)."""
    if not os.path.exists(path):
        raise DataError(f"Fashion-MNIST file not found: {path}; {HOW_TO_GET}")
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:   # gzip.BadGzipFile is an OSError
        raise DataError(f"Fashion-MNIST file {path} cannot be read as gzip ({e}): "
                        f"truncated or damaged; {HOW_TO_GET}") from None
    head = 4 + 4 * ndim
    if len(raw) < head or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] != ndim:
        raise DataError(f"{path} is not an IDX file of unsigned bytes with {ndim} "
                        f"dimension(s) (header {raw[:4].hex() or 'empty'}, expected "
                        f"000008{ndim:02x}); {HOW_TO_GET}")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    want = int(np.prod(dims, dtype=np.int64))
    if len(raw) - head != want:
        raise DataError(f"{path} holds {len(raw) - head} data bytes, its header announces "
                        f"{want} ({'x'.join(map(str, dims))}): truncated or damaged; "
                        f"{HOW_TO_GET}")
    return np.frombuffer(raw, np.uint8, want, head).reshape(dims)


def _split(directory: str, split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    img_name, lab_name = FILES[split]
    img_path, lab_path = os.path.join(directory, img_name), os.path.join(directory, lab_name)
    images, labels = read_idx(img_path, 3), read_idx(lab_path, 1)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{img_path}: images of {images.shape[1]}x{images.shape[2]} pixels, "
                        f"expected 28x28")
    if len(images) != len(labels):
        raise DataError(f"{img_path} has {len(images)} images but {lab_path} has "
                        f"{len(labels)} labels")
    if len(labels) and labels.max() >= len(CLASSES):
        raise DataError(f"{lab_path}: label {int(labels.max())} outside 0..9")
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


def load(directory: Optional[str] = None):
    """``(x_train, y_train, x_test, y_test)``: uint8 images of shape (n, 28, 28) (60,000 and
    10,000 in the published set) and int64 labels 0..9 (:data:`CLASSES`), from
    :func:`data_dir`.  Raises DataError (naming the file) as :func:`read_idx`, or when the
    images and labels of a split disagree."""
    d = data_dir(directory)
    return _split(d, "train") + _split(d, "test")


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (n, 28, 28) -> float32 (n, 1, 28, 28), standardized with the training
    set's pixel mean and standard deviation."""
    return ((images.to(torch.float32) / 255.0 - MEAN) / STD).unsqueeze(1)


class FashionCNN(nn.Sequential):
    """conv5x5(32, same) - ReLU - maxpool2 - conv5x5(64, same) - ReLU - maxpool2 -
    fc(3136 -> 1024) - ReLU - fc(1024 -> 10): input (n, 1, 28, 28) float32, output (n, 10)
    logits; 3,274,634 parameters (13.1 MB in fp32)."""

    def __init__(self):
        super().__init__(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


class _Block(nn.Module):
    """He et al.'s basic block: conv3x3 - BN - ReLU - conv3x3 - BN, plus the shortcut
    (identity, or conv1x1 - BN where the width or the stride changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class FashionResNet(nn.Module):
    """A small ResNet for 28x28 images: conv3x3(32, stride 2) - BN - ReLU, then one basic
    block per stage at widths 32, 64, 128 (strides 1, 2, 2: 14x14, 7x7, 4x4), global
    average pooling, fc(128 -> 10).  Input (n, 1, 28, 28) float32, output (n, 10) logits;
    308,074 parameters (batch normalization's running statistics are buffers, not
    exchanged)."""

    def __init__(self, widths=(32, 64, 128)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, widths[0], 3, 2, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(_Block(cin, w, 1 if i == 0 else 2))
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, 10)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


MODELS = {"cnn": FashionCNN, "resnet": FashionResNet}
