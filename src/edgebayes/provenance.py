"""What produced a result (commit, code version, config hash, versions, machine), atomic file writes and
reads that name the file when its content is bad.

Every results file carries a provenance block. Files are written with the one atomic writer
(ondevice/atomic.py, shared with the device: a temporary path in the same folder renamed into place), so an
interrupted run never leaves a half-written artifact behind.
"""

import contextlib
import datetime
import errno
import fcntl
import functools
import hashlib
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from edgebayes.errors import CorruptFileError
from edgebayes.ondevice.atomic import atomic_path, write_json  # noqa: F401 (the one atomic writer)
from edgebayes.ondevice.machine import device_info

ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("torch", "numpy", "onnx", "onnxruntime", "scikit-learn", "edgebayes")


def git_commit() -> str:
    """HEAD (with -dirty for uncommitted changes to tracked files), or the commit in $EDGEBAYES_GIT_COMMIT where
    whoever copied the tree elsewhere (a container, a lent GPU machine) says which it is: such a copy's own .git,
    where it has one, can be older than its files."""
    if os.environ.get("EDGEBAYES_GIT_COMMIT"):
        return os.environ["EDGEBAYES_GIT_COMMIT"]
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


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """edgebayes's version + a hash of its source files, computed once per process.

    Part of every stage's fingerprint (stages.Context.fingerprint), so that artifacts made by other code,
    an upgrade or a local edit, are not reused silently. Reading the ~60 files takes a few milliseconds.
    """
    import edgebayes

    package = Path(edgebayes.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{edgebayes.__version__}+{digest.hexdigest()[:12]}"


# Modules whose imports inside functions are not followed: config.py's lazy imports check settings of
# other stages' code (the architecture, the data files, ssh), they do not shape what a stage computes.
LEAF_MODULES = ("config.py",)


def _imported(path: Path, package: Path) -> set:
    """The edgebayes modules a source file imports, at module level or inside functions (a stage imports
    lazily; LEAF_MODULES: module level only), as files of the package."""
    import ast

    tree = ast.parse(path.read_bytes(), str(path))
    nodes = tree.body if path.relative_to(package).as_posix() in LEAF_MODULES else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level:      # from .x import y (the device runner's)
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            names = [".".join(filter(None, [node.module, alias.name])) for alias in node.names]
            found |= {_module_file(package, base.relative_to(package).parts + tuple(n.split("."))) for n in names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgebayes"):
            parts = tuple(node.module.split(".")[1:])
            found |= {_module_file(package, parts + (alias.name,)) or _module_file(package, parts)
                      for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {_module_file(package, tuple(a.name.split(".")[1:])) for a in node.names
                      if a.name.startswith("edgebayes.")}
    return found - {None}


def _module_file(package: Path, parts: tuple):
    """The file of module `parts` under the package (a module, or a package's __init__), or None."""
    if not parts:
        return package / "__init__.py"
    base = package.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def code_hash(*roots: str) -> str:
    """A hash of the code reached from `roots` (files or folders of the package, e.g. "train/families.py",
    "deploy/templates"): those files and every edgebayes module they import, transitively. A stage's
    fingerprint takes the hash of the code it runs (stages.STAGE_CODE), so editing the report's code
    re-runs the report, not training, and an upgrade that leaves training's code as it was keeps hours
    of training (issue 36)."""
    import edgebayes

    package = Path(edgebayes.__file__).resolve().parent
    todo = [package / r for r in roots]
    files = set()
    while todo:
        path = todo.pop()
        if path in files:
            continue
        if path.is_dir():
            todo.extend(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
            continue
        files.add(path)
        if path.suffix == ".py":
            todo.extend(_imported(path, package) - files)
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def walk_files(folder: Path, hidden=True):
    """Every file below `folder`, through symlinked folders too (Path.rglob does not enter them before Python
    3.13: a symlinked class folder's images were read, and their changes not seen), each real folder once (a
    link to an ancestor ends there); hidden=False leaves out names starting with '.' and what is below them."""
    seen = set()
    for top, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        if not hidden:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
        dirs.sort()
        for name in sorted(files):
            path = Path(top) / name
            if (hidden or not name.startswith(".")) and path.is_file():
                yield path


def stat_fingerprint(path: Path, suffixes=None) -> str:
    """A hash of what a file, or a folder's files (those ending in `suffixes`, if given), hold now: each
    relative path, size and modification time (stat only, no reading). Size and mtime change with any
    rewrite; a copy that keeps both (rsync -a) counts as the same."""
    return stat_summary(path, suffixes)[0]


def stat_summary(path: Path, suffixes=None):
    """(stat_fingerprint, number of files, their total bytes): the two counts let a message say what changed."""
    if path.is_dir():
        files = sorted(f for f in walk_files(path) if suffixes is None or f.suffix.lower() in suffixes)
    else:
        files = [path] if path.is_file() else []
    h, total = hashlib.sha256(), 0
    for f in files:
        st = f.stat()
        total += st.st_size
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16], len(files), total


def provenance(config_hash: str) -> dict:
    return {"git_commit": git_commit(), "code_version": code_version(), "config_hash": config_hash,
            "versions": versions(), "machine": device_info(),
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


@contextlib.contextmanager
def exclusive(path, what, wait=None):
    """Hold the lock file `path` for this process: a second holder fails at once with a StageError naming
    `what` and this one's pid (two writers of one run folder or one checkpoint interleave their states).
    With `wait` (a log function), the second holder says once that it waits for `what`, then waits."""
    from edgebayes.errors import StageError

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            if wait is None:
                raise StageError(f"{what} is in use by another edgebayes (pid {holder}); wait for it to finish "
                                 f"or stop it, then run again") from None
            wait(f"waiting for another edgebayes {what} (pid {holder}, {path})")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_json(path):
    """The JSON in `path`; content that is not JSON raises CorruptFileError naming the file."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{path}: not valid JSON ({e})") from None


RESULT_SUFFIXES = (".json", ".md", ".png")


def result_path(out, suffix):
    """A benchmark's results file: `out` (its --out, given without suffix; a .json, .md or .png is dropped) with
    `suffix` appended. Not Path.with_suffix, which replaces whatever follows a dot in the name: --out /tmp/eff_0.5
    and --out /tmp/eff_0.25 both wrote /tmp/eff_0.json, two runs into one file."""
    out = Path(out)
    name = out.name[: -len(out.suffix)] if out.suffix in RESULT_SUFFIXES else out.name
    return out.with_name(name + suffix)


def atomic_torch_save(obj, path):
    """torch.save through memory: torch's zip writer reports a full disk as `RuntimeError: unexpected pos`;
    writing the bytes ourselves gets the OSError (ENOSPC) that names the file."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with atomic_path(path) as tmp:
        tmp.write_bytes(buffer.getbuffer())


def load_checkpoint(path, map_location="cpu"):
    """torch.load(weights_only=True): a checkpoint is data and must not run code. Whatever torch refuses
    (a truncated or altered file, a pickle that asks for code) raises CorruptFileError naming the file;
    I/O errors and MemoryError pass through as they are."""
    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except MemoryError:
        raise
    except Exception as e:
        # I/O errors pass through; but torch's zip reader says some truncated files with a bare `[Errno 22]
        # Invalid argument` (no file name): that is the file's content, not the disk's
        if isinstance(e, OSError) and (e.errno != errno.EINVAL or e.filename is not None):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CorruptFileError(f"{path}: not a checkpoint edgebayes can load ({type(e).__name__}: {first[:200]}); "
                               f"remove it, or re-run the stage with --force") from None
