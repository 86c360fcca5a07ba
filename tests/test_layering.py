"""The packages form layers whose imports only point down (issue 15, item 1).

    hetroute  <-  workloads, topologies  <-  testbed  <-  analysis

- ``hetroute`` (the paper's model and algorithms) imports none of the others;
- ``workloads`` (models, traces, the proxy MoE models) and ``topologies``
  (cluster files) import only ``hetroute``; they are siblings and import
  neither each other (neither needs the other today);
- ``testbed`` (specs, runs, backends, run-folder measurement) imports
  ``hetroute``, ``workloads`` and ``topologies``, never ``analysis``;
- ``analysis`` (figures, reports, plots) may import all of them.

Every import counts: module level, inside functions (a function-level import
must not hide a cycle), under ``TYPE_CHECKING``, relative imports resolved
against the importing file, and ``importlib.import_module`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> packages of this repository it must not import
FORBIDDEN: dict[str, set[str]] = {
    "hetroute": {"workloads", "topologies", "testbed", "analysis"},
    "workloads": {"topologies", "testbed", "analysis"},
    "topologies": {"workloads", "testbed", "analysis"},
    "testbed": {"analysis"},
    "analysis": set(),
}


def _module_parts(path: Path, root: Path) -> list[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything ``path`` imports, wherever the import sits."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_parts(path, root)
    package = here if path.name == "__init__.py" else here[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and not node.args[0].value.startswith(".")):
            out.append((node.lineno, node.args[0].value))
    return out


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, mod in imported_modules(path):
            top = mod.split(".")[0]
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_only_point_down(package):
    assert (ROOT / package).is_dir()
    assert violations(package) == []


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    pkg = ROOT / "workloads" / "proxy" / "__main__.py"
    assert any(m.startswith("workloads.") for _, m in imported_modules(pkg))  # relative, resolved
    src = tmp_path / "workloads" / "x" / "m.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from testbed.records import flat\n    import analysis.load\n"
                   "    from ..models import get_model\n    from . import y\n")
    assert sorted(m for _, m in imported_modules(src, tmp_path)) == [
        "analysis.load", "testbed.records", "workloads.models", "workloads.x"]
