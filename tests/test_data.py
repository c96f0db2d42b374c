"""Data loading: IDX files (MNIST format, gzipped or not), seeded splits, OOD set."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from edgebayes.config import DataConfig
from edgebayes.data import DataError, load_data

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"


def _write_idx(path, array, gz):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    (gzip.open if gz else open)(path, "wb").write(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize("gz", [True, False])
def test_idx_files_load_with_values_and_labels(tmp_path, gz):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = {p: rng.integers(0, 256, (n, 28, 28)) for p, n in (("train", 50), ("t10k", 20))}
    labels = {p: rng.integers(0, 10, n) for p, n in (("train", 50), ("t10k", 20))}
    suffix = ".gz" if gz else ""
    for p in ("train", "t10k"):
        _write_idx(raw / f"{p}-images-idx3-ubyte{suffix}", images[p], gz)
        _write_idx(raw / f"{p}-labels-idx1-ubyte{suffix}", labels[p], gz)
    splits = load_data(DataConfig(dataset="fashion-mnist", root=str(tmp_path), val_fraction=0.2), seed=0)
    assert splits.input_shape == (1, 28, 28)
    assert len(splits.train_x) == 40 and len(splits.val_x) == 10 and len(splits.test_x) == 20
    assert torch.equal(splits.test_x[:, 0], torch.tensor(images["t10k"] / 255.0, dtype=torch.float32))
    assert torch.equal(splits.test_y, torch.tensor(labels["t10k"]))
    assert splits.classes[0] == "T-shirt/top"


def test_missing_idx_files_name_the_folder(tmp_path):
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*FashionMNIST/raw"):
        load_data(DataConfig(dataset="fashion-mnist", root=str(tmp_path)), seed=0)


def test_digits_splits_are_seeded_and_cover_the_set():
    cfg = DataConfig(dataset="digits", ood="noise")
    a, b, c = load_data(cfg, 0), load_data(cfg, 0), load_data(cfg, 1)
    assert torch.equal(a.train_x, b.train_x) and not torch.equal(a.train_x, c.train_x)
    assert len(a.train_x) + len(a.val_x) + len(a.test_x) == 1797
    assert a.ood_x.shape == a.test_x.shape and float(a.ood_x.min()) >= 0


@pytest.mark.skipif(not (SHARED / "MNIST" / "raw").is_dir(), reason="the shared MNIST copy is not beside the repo")
def test_shared_mnist_gz_files_load():
    splits = load_data(DataConfig(dataset="mnist", root=str(SHARED), val_fraction=5000 / 60000), seed=0)
    assert len(splits.train_x) + len(splits.val_x) == 60000 and len(splits.test_x) == 10000
    assert splits.test_y[:5].tolist() == [7, 2, 1, 0, 4]  # MNIST's first test labels


def test_train_subset_keeps_the_first_training_images_and_whole_val_and_test():
    full, part = load_data(DataConfig(), 0), load_data(DataConfig(train_subset=100), 0)
    assert torch.equal(part.train_x, full.train_x[:100]) and torch.equal(part.train_y, full.train_y[:100])
    assert torch.equal(part.val_x, full.val_x) and torch.equal(part.test_x, full.test_x)
