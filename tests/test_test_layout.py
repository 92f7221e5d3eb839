"""The test tree's layout: builders shared by test modules live in ``tests/helpers/`` (and
``xnn.testing``), so no test module imports another and none keeps its own copy of the
shared Lennard-Jones builder or relative error."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
#: shared builders that a test module must import from ``helpers``, not define
SHARED = {"lj", "_lj", "rel", "_rel", "argon_lj", "rattled_argon", "native", "_native"}


def _modules():
    return sorted(p for p in TESTS.glob("*.py"))


def _imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[-1].startswith("test_") and (len(parts) == 1 or parts[-2] == "tests")


def test_no_test_module_imports_another():
    offenders = {p.name: sorted(n for n in _imported(ast.parse(p.read_text()))
                                if _is_test_module(n))
                 for p in _modules()}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_shared_builders_are_defined_once():
    copies = {p.name: sorted(node.name for node in ast.parse(p.read_text()).body
                             if isinstance(node, ast.FunctionDef) and node.name in SHARED)
              for p in _modules()}
    assert not {k: v for k, v in copies.items() if v}, copies


def test_the_layout_check_sees_a_test_to_test_import():
    tree = ast.parse("from tests.test_x import a\nimport test_y\nfrom tests import test_z\n"
                     "from helpers import lj\n")
    assert sorted(n for n in _imported(tree) if _is_test_module(n)) == [
        "test_y", "tests.test_x", "tests.test_z"]
