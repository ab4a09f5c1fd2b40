"""The package map's import direction, read from the source: evaluation sits below training."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dsjax")


def _imports(path: str) -> set[str]:
    """Every dsjax module a file imports, at module level or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in out if name.startswith("dsjax")}


def _package_files(package: str) -> list[str]:
    top = os.path.join(ROOT, package)
    return [os.path.join(d, n) for d, _, names in os.walk(top) for n in names if n.endswith(".py")]


def test_evaluate_never_imports_train():
    files = _package_files("evaluate")
    assert len(files) >= 3  # __init__, heldout, grounding: the walk found the package
    upward = {os.path.relpath(f, ROOT): sorted(m for m in _imports(f)
                                               if m == "dsjax.train" or m.startswith("dsjax.train."))
              for f in files}
    assert not {f: m for f, m in upward.items() if m}, upward


def test_the_import_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from dsjax.train.trainer import build_trainer\n")
    assert "dsjax.train.trainer" in _imports(str(bad))
