"""Code of the user's own named in a config: `package.module:attribute` (model.arch, data.dataset).

One loader for every such key, so they all accept the same paths and fail with the same kind of message.
The working directory is on the import path, as under `python -m`: a module beside the config (the usual
place for a user's net or loader) imports the same through the `edgebayes` script.
"""

import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _on_path():
    """The working directory on the import path, as under `python -m` (module docstring)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def load_callable(path: str, where: str, error=ValueError):
    """`package.module:attribute` -> the callable; anything else raises `error` with a message after `where`."""
    if not IMPORT_PATH.match(path):
        raise error(f"{where}: expected package.module:attribute, got {path!r}")
    _on_path()
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the user's module raises while importing
        raise error(f"{where}: cannot import {module_name} ({type(e).__name__}: {e}); install it, run from its "
                    f"folder or put that folder on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{where}: {module_name} has no attribute {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{where}: {path} is not callable")
    return obj


def source_file(path) -> "Path | None":
    """The file of the module an import path `package.module:attribute` names (a user's net or loader beside
    the config), or None for anything else (a zoo name, a module that cannot be found: loading it says why).
    The train stage's fingerprint counts that file, so editing it makes the stage run again; modules it
    imports in turn do not count (`edgebayes train --force` after editing those)."""
    if not isinstance(path, str) or not IMPORT_PATH.match(path):
        return None
    _on_path()
    try:
        spec = importlib.util.find_spec(path.partition(":")[0])
    except Exception:   # a parent package that fails to import: load_callable reports it
        return None
    origin = getattr(spec, "origin", None)
    return Path(origin) if origin and os.path.isfile(origin) else None
