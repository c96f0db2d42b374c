"""The one atomic file writer, for the device's results and engines and for every file edgebayes writes.

A file is written to a temporary path in the same folder, flushed to disk and renamed into place, so an
interrupted run never leaves a half-written file behind.
"""

import errno
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    An OSError without a file name (a full disk: `[Errno 28] No space left on device`) gets `path` as its
    file name, so that the one-line message of the command line says where."""
    path = Path(path)
    if os.path.lexists(str(path)) and (path.is_symlink() or not path.is_file()):
        # a device node, FIFO or folder (or a link) is not a file to replace: as root, /dev/null became one
        raise OSError(errno.EEXIST, "exists and is not a regular file; give another path", str(path))
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
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path, obj):
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
