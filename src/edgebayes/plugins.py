"""Code of the user's own named in a config: `package.module:attribute` (model.arch, data.dataset).

One loader for every such key, so they all accept the same paths and fail with the same kind of message.
The working directory is on the import path, as under `python -m`: a module beside the config (the usual
place for a user's net or loader) imports the same through the `edgebayes` script.
"""

import importlib
import os
import re
import sys

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def load_callable(path: str, where: str, error=ValueError):
    """`package.module:attribute` -> the callable; anything else raises `error` with a message after `where`."""
    if not IMPORT_PATH.match(path):
        raise error(f"{where}: expected package.module:attribute, got {path!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
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
