"""The package's layers point one way, and no module imports itself round a circle.

Stages from the bottom up: the on-device code (edgebayes.ondevice, shipped to the device as a zipapp),
then what both training and export use (edgebayes.compressed), then train, then export, then deploy,
stages and the command line. Imports are read with `ast` from the source, module-level and inside
functions alike (a function-level import is still a dependency; it only runs later).
"""

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "edgebayes"

# The bottom layer that anything may import: the device runner.
BOTTOM = ("edgebayes.ondevice",)

# Stage -> the packages (and modules) it must not import.
FORBIDDEN = {
    "edgebayes.train": ("edgebayes.export", "edgebayes.deploy", "edgebayes.stages", "edgebayes.cli"),
    "edgebayes.export": ("edgebayes.deploy", "edgebayes.stages", "edgebayes.cli"),
    "edgebayes.compressed": ("edgebayes.train", "edgebayes.export", "edgebayes.deploy", "edgebayes.stages",
                             "edgebayes.cli"),
}


def _module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    """{module name: path} of every module of the package."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports_of(path: Path, known=None, root: Path = SRC) -> set:
    """The edgebayes modules a file imports, at any depth of its code (functions included).

    `from edgebayes.x import y` counts as importing edgebayes.x.y when that is a module, else edgebayes.x.
    """
    known = _modules() if known is None else known
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "edgebayes")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "edgebayes":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def _graph():
    """{module: modules it imports}, without edges to the module's own parent packages: `import edgebayes`
    inside edgebayes.x reads a package that is always initialised before its submodules, so it cannot
    close a circle (the root package's API is imported lazily, on attribute access)."""
    known = _modules()
    graph = {}
    for name, path in known.items():
        graph[name] = {m for m in _imports_of(path, known)
                       if m != name and not name.startswith(m + ".")}
    return graph


def _within(module, prefix):
    return module == prefix or module.startswith(prefix + ".")


def _cycle(graph):
    """One import circle as a list of modules (first == last), or None: depth-first search."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_imports_are_found_inside_functions_too(tmp_path):
    pkg = tmp_path / "src" / "edgebayes" / "train"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("import os\nfrom edgebayes.errors import InputError\n\ndef f():\n"
                 "    from edgebayes.deploy import runner\n    import edgebayes.stages\n")
    known = {"edgebayes.errors": None, "edgebayes.deploy.runner": None, "edgebayes.stages": None}
    assert _imports_of(f, known, tmp_path / "src") == {"edgebayes.errors", "edgebayes.deploy.runner",
                                                       "edgebayes.stages"}


def test_stages_import_downwards_only():
    graph = _graph()
    wrong = []
    for module, imports in sorted(graph.items()):
        for stage, forbidden in FORBIDDEN.items():
            if not _within(module, stage):
                continue
            wrong += [f"{module} imports {target}" for target in sorted(imports)
                      if any(_within(target, f) for f in forbidden) and not any(_within(target, b) for b in BOTTOM)]
    assert not wrong, "imports against the direction of the stages:\n" + "\n".join(wrong)


def test_no_import_circles():
    circle = _cycle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_cycle_finder_reports_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_ondevice_imports_nothing_of_edgebayes_and_only_stdlib_and_numpy():
    """edgebayes/ondevice runs on the device as a zipapp: its modules import each other relatively (one
    level: nothing of edgebayes outside it), the standard library and numpy at module level, and the
    runtimes (and tqdm, optional) only inside functions. Its own imports have no circle."""
    lazy_ok = {"onnxruntime", "ai_edge_litert", "tflite_runtime", "tensorflow", "tensorrt", "cuda", "pycuda", "tqdm"}
    top_ok = set(sys.stdlib_module_names) | {"numpy"}

    def imports_of(path):
        """(top-level package or '.module', inside a function?) of every import statement in `path`."""
        found = []

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                lazy = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(child, ast.Import):
                    found.extend((alias.name.split(".")[0], in_function) for alias in child.names)
                elif isinstance(child, ast.ImportFrom):
                    assert child.level in (0, 1), \
                        f"{path.name}: `from {'.' * child.level}{child.module}` leaves ondevice"
                    if child.level == 0:
                        found.append((child.module.split(".")[0], in_function))
                    else:   # `from .x import y`, or `from . import x`
                        found.extend(("." + (child.module or alias.name).split(".")[0], in_function)
                                     for alias in child.names)
                visit(child, lazy)

        visit(ast.parse(path.read_text()), False)
        return found

    modules = sorted((PACKAGE / "ondevice").glob("*.py"))
    assert len(modules) > 5
    graph = {}
    for path in modules:
        names = imports_of(path)
        absolute = {n for n, _ in names if not n.startswith(".")}
        assert "edgebayes" not in absolute, f"{path.name} imports edgebayes absolutely (the zipapp has no edgebayes)"
        eager = {n for n, lazy in names if not lazy and not n.startswith(".")}
        assert eager <= top_ok, f"{path.name} imports {sorted(eager - top_ok)} at module level"
        assert absolute <= top_ok | lazy_ok, f"{path.name} imports {sorted(absolute - top_ok - lazy_ok)}"
        graph[path.stem] = {n[1:] for n, lazy in names if n.startswith(".") and not lazy}
        assert graph[path.stem] <= {p.stem for p in modules}, f"{path.name}: {graph[path.stem]}"

    def cycle_from(node, trail):
        if node in trail:
            return trail[trail.index(node):] + [node]
        return next((c for dep in graph[node] if (c := cycle_from(dep, trail + [node]))), None)

    for name in graph:
        assert cycle_from(name, []) is None, f"import circle in ondevice: {' -> '.join(cycle_from(name, []))}"
