"""Size budgets of the product code: no module over 400 lines, no function or method over 50.

A function's length is ``end_lineno - lineno + 1`` of its ``def`` (docstring included, decorators
not). An exception is listed by name with its reason in ``EXCEPTIONS``: ``"path"`` for a module,
``"path:Qualified.name"`` for a function (nested ones as ``outer.inner``). A listed exception
that no longer exceeds its budget fails too, so the list cannot outlive its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.servers import REPO_ROOT

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
PACKAGE = Path(REPO_ROOT) / "kvhive"

EXCEPTIONS: dict[str, str] = {
}


def product_modules() -> list[Path]:
    """Every Python module of the package (the C++ sources' folders aside)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "csrc" not in p.relative_to(PACKAGE).parts)


def function_lengths(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Qualified name -> lines of every function and method under ``tree``."""
    out: dict[str, int] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            out[name] = node.end_lineno - node.lineno + 1
            out |= function_lengths(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            out |= function_lengths(node, prefix + node.name + ".")
        else:
            out |= function_lengths(node, prefix)
    return out


def oversized() -> dict[str, int]:
    """``path`` or ``path:qualname`` -> lines, for every module and function over its budget."""
    out: dict[str, int] = {}
    for path in product_modules():
        rel = path.relative_to(REPO_ROOT).as_posix()
        source = path.read_text(encoding="utf-8")
        num_lines = len(source.splitlines())
        if num_lines > MAX_MODULE_LINES:
            out[rel] = num_lines
        for name, length in function_lengths(ast.parse(source)).items():
            if length > MAX_FUNCTION_LINES:
                out[f"{rel}:{name}"] = length
    return out


def test_no_module_or_function_over_budget_unless_listed() -> None:
    unlisted = {name: n for name, n in oversized().items() if name not in EXCEPTIONS}
    assert unlisted == {}, (f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function "
                            "(split by concept, or list it in EXCEPTIONS with its reason)")


def test_every_listed_exception_still_exceeds() -> None:
    stale = sorted(set(EXCEPTIONS) - set(oversized()))
    assert stale == [], "within budget now (or gone): remove from EXCEPTIONS"


def test_every_exception_gives_a_reason() -> None:
    assert all(reason.strip() for reason in EXCEPTIONS.values())


def test_lengths_count_the_whole_def() -> None:
    tree = ast.parse("class A:\n    def f(self):\n        '''doc'''\n\n        def g():\n            pass\n"
                     "        return 1\n")
    assert function_lengths(tree) == {"A.f": 6, "A.f.g": 2}
