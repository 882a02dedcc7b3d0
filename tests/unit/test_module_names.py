"""Module names a reader need not tell apart by folder: no two product modules share a file name,
except the names listed in SHARED_NAMES, each of which means the same role in every package that has it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from support.servers import REPO_ROOT

PACKAGE = Path(REPO_ROOT) / "kvhive"

# A name -> why several packages may each have a module of it.
SHARED_NAMES: dict[str, str] = {
    "__init__.py": "a package's own docstring and exports",
    "app.py": "the ASGI app of a process (the replica's server, the gateway, the Ray application)",
    "cli.py": "a command's argument parser and entry (kvhive, kvhive gateway)",
    "metrics.py": "the Prometheus metrics a process exports (the replica's server, the gateway)",
    "errors.py": "a package's own error kinds, mapped to statuses only at the HTTP edge",
    "base.py": "the protocol a package's implementations share (store tiers, connectors, tool parsers)",
}


def modules_by_name() -> dict[str, list[str]]:
    """File name -> the product modules of that name (C++ sources' folders aside)."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        if "csrc" not in path.parts:
            found[path.name].append(path.relative_to(REPO_ROOT).as_posix())
    return found


def test_no_two_modules_share_a_name_unless_listed() -> None:
    shared = {name: paths for name, paths in modules_by_name().items()
              if len(paths) > 1 and name not in SHARED_NAMES}
    assert shared == {}, "rename one for its concept (or list the name in SHARED_NAMES with its reason)"


def test_every_listed_name_is_still_shared() -> None:
    names = modules_by_name()
    assert sorted(n for n in SHARED_NAMES if len(names.get(n, ())) < 2) == []
