"""Code of the user's own named in a config: `package.module:attribute` (model.arch, data.dataset).

One loader for every such key, so they all accept the same paths and fail with the same kind of message.
The working directory is on the import path, as under `python -m`: a module beside the config (the usual
place for a user's net or loader) imports the same through the `edgebayes` script.
"""

import ast
import functools
import importlib
import importlib.util
import os
import re
import site
import sys
import sysconfig
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


def source_files(path) -> list:
    """The files of the user's own code behind an import path `package.module:attribute` (a net or loader
    beside the config): the module it names and, transitively, every module of the user's own that it imports
    (found by reading the import statements, not by running them). [] for anything else (a zoo name, a module
    that cannot be found: loading it says why). The train stage's fingerprint counts these files, so editing
    any of them makes the stage run again. Modules of the standard library and of installed packages
    (torch, torchvision, ...) are not the user's: they are not followed, and upgrading them keeps training.
    Not seen: an import built at run time (importlib.import_module of a computed name)."""
    if not isinstance(path, str) or not IMPORT_PATH.match(path):
        return []
    _on_path()
    first = _find(path.partition(":")[0])
    if first is None:
        return []
    files, todo = [], [first]   # the named module counts even where it is installed (model.arch: pkg.mod:fn)
    while todo and len(files) < MAX_SOURCE_FILES:
        name, origin, is_package = todo.pop()
        if origin in files:
            continue
        files.append(origin)
        for imported in _imported_modules(origin, name, is_package):
            found = _find(imported) if _own(imported.partition(".")[0]) else None
            if found is not None and found[1] not in files and _own_file(found[1]):
                todo.append(found)
    return sorted(files)


MAX_SOURCE_FILES = 500   # a bound on the walk: a user's project, not a library


def _find(name):
    """(name, file, is_package) of an importable module with a source file, else None. Finding `a.b`
    imports the package `a` (the user's own: the run imports it anyway)."""
    try:
        spec = importlib.util.find_spec(name)
    except Exception:   # a parent package that fails to import, or a name that is not a module
        return None
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    return name, Path(origin).resolve(), spec.submodule_search_locations is not None


@functools.lru_cache(maxsize=None)
def _not_own_folders():
    """Where the standard library, installed packages and edgebayes itself live."""
    import edgebayes

    folders = {Path(edgebayes.__file__).resolve().parent}
    for base in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=base) if base else sysconfig.get_paths()
        folders |= {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    folders |= {Path(p).resolve() for p in site.getsitepackages() + [site.getusersitepackages()]}
    return tuple(folders)


def _own_file(file: Path) -> bool:
    return not any(file.is_relative_to(folder) for folder in _not_own_folders())


def _own(top: str) -> bool:
    """Whether a top-level module is the user's own, decided without importing it."""
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return False
    found = _find(top)
    return found is not None and _own_file(found[1])


def _imported_modules(file: Path, name: str, is_package: bool) -> set:
    """The absolute names a source file imports, at any depth (imports inside functions too); for
    `from a import b` both `a` and `a.b` (b may be a submodule)."""
    try:
        tree = ast.parse(file.read_bytes(), str(file))
    except (OSError, SyntaxError, ValueError):   # importing it will say what is wrong
        return set()
    package = name if is_package else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
            except (ImportError, ValueError):   # a relative import beyond the top-level package
                continue
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names if alias.name != "*"}
    return names
