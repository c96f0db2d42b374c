"""Datasets as in-memory tensors with seeded train / val / test splits (and an optional OOD set).

- digits: scikit-learn's 8x8 digits (1797 images, shipped inside the wheel): the embedded default, offline.
- mnist, fashion-mnist (IDX files read directly, .gz or not), cifar10 (torchvision): from a root folder (data.root, else $EDGEBAYES_DATA,
  else ./data). Nothing is downloaded unless data.download is true; absent files give one clear error.

Images are float32 in [0, 1], shape (C, H, W). Validation is carved out of the training split with a
generator seeded by the run's seed, so a split never changes between runs.
"""

import dataclasses
import gzip
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch


from edgebayes.errors import InputError


class DataError(InputError):
    """The data set cannot be loaded; the message says which files and how to fix it."""


@dataclass
class Splits:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: list
    ood_x: Optional[torch.Tensor] = None

    @property
    def input_shape(self):
        return tuple(self.train_x.shape[1:])


TORCHVISION = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10"}
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]


def data_root(cfg) -> Path:
    return Path(cfg.root or os.environ.get("EDGEBAYES_DATA") or "data")


def _digits():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    return x, y, [str(c) for c in bunch.target_names]


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format), gzipped or not: magic (2 zero bytes, dtype, ndim), dims, data."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4: 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _idx_file(raw: Path, stem: str):
    for candidate in (raw / stem, raw / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _mnist_like(name, cfg, train):
    """MNIST / Fashion-MNIST from root/<MNIST|FashionMNIST>/raw, gzipped or extracted.

    Read directly: torchvision 0.29 insists on extracted files, which a read-only shared copy of the
    original .gz files does not have. torchvision is only used to download, when the config allows it.
    """
    raw = data_root(cfg) / TORCHVISION[name] / "raw"
    prefix = "train" if train else "t10k"
    stems = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
    images, labels = (_idx_file(raw, s) for s in stems)
    if (images is None or labels is None) and cfg.download:
        _torchvision(name, cfg, train)
        images, labels = (_idx_file(raw, s) for s in stems)
    if images is None or labels is None:
        raise DataError(
            f"data set {name!r}: {prefix}-images-idx3-ubyte(.gz) and {prefix}-labels-idx1-ubyte(.gz) not found "
            f"in {raw.resolve()}. Point data.root or EDGEBAYES_DATA at the folder that holds "
            f"{TORCHVISION[name]}/raw, or set data.download: true where there is internet")
    x = torch.tensor(_read_idx(images), dtype=torch.float32).unsqueeze(1) / 255.0
    y = torch.tensor(_read_idx(labels), dtype=torch.int64)
    classes = [str(i) for i in range(10)] if name == "mnist" else FASHION_CLASSES
    return x, y, classes


def _torchvision(name, cfg, train):
    import torchvision

    root = data_root(cfg)
    cls = getattr(torchvision.datasets, TORCHVISION[name])
    try:
        ds = cls(root=str(root), train=train, download=cfg.download)
    except RuntimeError as e:
        raise DataError(
            f"data set {name!r}: files not found under {root.resolve()} ({e}). Point data.root or "
            f"EDGEBAYES_DATA at the folder that holds them, or set data.download: true where there is internet"
        ) from None
    data = ds.data if isinstance(ds.data, np.ndarray) else ds.data.numpy()
    x = torch.tensor(data, dtype=torch.float32) / 255.0
    x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # (N, H, W[, C]) -> (N, C, H, W)
    y = torch.tensor(np.asarray(ds.targets), dtype=torch.int64)
    return x, y, [str(c) for c in ds.classes]


# Loaders of the data sets that live under the data root (digits ships with scikit-learn).
LOADERS = {"mnist": _mnist_like, "fashion-mnist": _mnist_like, "cifar10": _torchvision}


def _split(n, fraction, generator):
    perm = torch.randperm(n, generator=generator)
    k = int(round(n * fraction))
    return perm[k:], perm[:k]


def load_data(cfg, seed: int) -> Splits:
    """Load the configured data set with seeded splits."""
    g = torch.Generator().manual_seed(seed)
    if cfg.dataset == "digits":
        x, y, classes = _digits()
        rest, test = _split(len(x), cfg.test_fraction, g)
        test_x, test_y = x[test], y[test]
        x, y = x[rest], y[rest]
    else:
        load = LOADERS[cfg.dataset]
        x, y, classes = load(cfg.dataset, cfg, train=True)
        test_x, test_y, _ = load(cfg.dataset, cfg, train=False)
    train, val = _split(len(x), cfg.val_fraction, g)
    train = train[: cfg.train_subset]  # a quick run's subset (None: all); validation and test stay whole
    splits = Splits(x[train], y[train], x[val], y[val], test_x, test_y, classes)
    if cfg.ood:
        splits.ood_x = _ood_set(cfg, splits, g)
    return splits


def _ood_set(cfg, splits, generator):
    """Out-of-distribution inputs of the same shape: uniform noise images, or another data set."""
    n = len(splits.test_x)
    if cfg.ood == "noise":
        return torch.rand((n,) + splits.input_shape, generator=generator)
    if cfg.ood == "digits":
        x = _digits()[0]
    else:
        x = LOADERS[cfg.ood](cfg.ood, dataclasses.replace(cfg, dataset=cfg.ood, ood=None), train=False)[0]
    if tuple(x.shape[1:]) != splits.input_shape:
        raise DataError(f"data.ood: {cfg.ood} images have shape {tuple(x.shape[1:])}, "
                        f"but {cfg.dataset} has {splits.input_shape}")
    return x[torch.randperm(len(x), generator=generator)[:n]]
