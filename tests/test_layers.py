"""The layers of edgebayes point one way: the import rules, checked by walking each module's imports (ast)."""

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "edgebayes"


def test_ondevice_imports_nothing_of_edgebayes_and_only_stdlib_and_numpy():
    """edgebayes/ondevice runs on the device as a zipapp: its modules import each other relatively (one
    level: nothing of edgebayes outside it), the standard library and numpy at module level, and the
    runtimes (and tqdm, optional) only inside functions. Its own imports have no circle."""
    lazy_ok = {"onnxruntime", "ai_edge_litert", "tflite_runtime", "tensorflow", "tensorrt", "cuda", "tqdm"}
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

    modules = sorted((SRC / "ondevice").glob("*.py"))
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
