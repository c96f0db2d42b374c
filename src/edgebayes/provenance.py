"""What produced a result (commit, config hash, versions, machine) and atomic file writes.

Every results file carries a provenance block. Files are written to a temporary path in the same folder
and renamed into place, so an interrupted run never leaves a half-written artifact behind.
"""

import datetime
import json
import os
import platform
import subprocess
import tempfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from edgebayes.deploy.runner import device_info

ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("torch", "numpy", "onnx", "onnxruntime", "scikit-learn", "edgebayes")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def provenance(config_hash: str) -> dict:
    return {"git_commit": git_commit(), "config_hash": config_hash, "versions": versions(), "machine": device_info(),
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


@contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:  # on disk before the rename, so a crash cannot leave an empty file
            os.fsync(f.fileno())
        # mkstemp creates 0600; artifacts get the usual umask-based permissions.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path, obj):
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path):
    return json.loads(Path(path).read_text())


def atomic_torch_save(obj, path):
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
