"""A truncated checkpoint is a file's content problem: named, with what to do, never a bare OSError
(torch's zip reader raises `[Errno 22] Invalid argument` without a file name for some truncation points)."""
import pytest
import torch

from edgebayes.errors import CorruptFileError
from edgebayes.provenance import atomic_torch_save, load_checkpoint


def test_truncated_checkpoint_is_named(tmp_path):
    path = tmp_path / "checkpoint.pt"
    atomic_torch_save({"model": {f"w{i}": torch.randn(64, 64) for i in range(8)}, "epoch": 3}, path)
    data = path.read_bytes()
    for size in (10, len(data) // 5, len(data) // 2, len(data) - 100):
        path.write_bytes(data[:size])
        with pytest.raises(CorruptFileError, match="checkpoint.pt: not a checkpoint edgebayes can load"):
            load_checkpoint(path)


def test_missing_checkpoint_stays_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.pt")
