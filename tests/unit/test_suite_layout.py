"""Test modules are collected by basename (rootdir-relative, no packages), so two files of one name
under different folders break collection of the whole suite."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    repeated = sorted(name for name, count in names.items() if count > 1)
    assert repeated == [], f"test modules sharing a basename: {repeated}"
