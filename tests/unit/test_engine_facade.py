"""Nothing outside the engine reaches through it: the server uses ``EngineClient``'s methods, never
the ``LLMEngine`` behind an ``AsyncEngine``, the store's tiers or the scheduler's block pool.

The owners are exempt: ``kvhive/engine`` (the engine and its client), ``kvhive/connector`` and
``kvhive/store`` (they own the tiers).

Nor does anything reach into an app's ``state``: only the module that sets ``app.state.x`` reads it,
and nobody reaches past it (``app.state.service.sessions``); a caller that needs a part of a replica
gets it from its owner (``kvhive.launch.Replica``).
"""

from __future__ import annotations

import re
from pathlib import Path

from support.servers import REPO_ROOT

PACKAGE = Path(REPO_ROOT) / "kvhive"
OWNERS = ("engine", "connector", "store")
# ``x.engine.engine`` / ``async_engine.engine``: the LLMEngine behind the AsyncEngine facade;
# ``store.tiers[i]``: one tier of the TieredStore; ``scheduler.kv.pool``: the device block pool.
REACHES = re.compile(r"engine\.engine\b|store\.tiers\[|scheduler\.kv\.pool")


def reaches_through(root: Path) -> list[str]:
    """``path:line: text`` of every line under ``root`` (owners aside) that reaches through the engine."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in OWNERS:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if REACHES.search(line):
                hits.append(f"{relative}:{number}: {line.strip()}")
    return hits


# ``app.state.x = ...``: the module that sets the state; ``app.state.x.y``: a reach past it.
SETS_STATE = re.compile(r"\bapp\.state\.\w+\s*=[^=]")
READS_STATE = re.compile(r"\bapp\.state\.")
REACHES_PAST_STATE = re.compile(r"\bapp\.state\.\w+\.\w+")


def reaches_into_app_state(root: Path) -> list[str]:
    """``path:line: text`` of every line under ``root`` that reads an app's state outside the module
    that sets it, or reaches past one of its entries."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        setter = SETS_STATE.search(text) is not None
        for number, line in enumerate(text.splitlines(), 1):
            if REACHES_PAST_STATE.search(line) or (READS_STATE.search(line) and not setter):
                hits.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return hits


def test_no_module_reaches_into_an_apps_state() -> None:
    assert reaches_into_app_state(PACKAGE) == []


def test_the_state_check_finds_each_kind_of_reach(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("app.state.service = service\n"
                                     "limit = app.state.max_request_bytes\n"
                                     "registry = self.app.state.service.sessions.registry\n")
    (tmp_path / "replica.py").write_text("service = self.app.state.service\n"
                                         "ok = app.state == other\n")
    assert [hit.rsplit(":", 1)[0] for hit in reaches_into_app_state(tmp_path)] == ["app.py:3", "replica.py:1"]


def test_no_module_outside_the_engine_reaches_through_it() -> None:
    assert reaches_through(PACKAGE) == []


def test_the_check_finds_each_kind_of_reach(tmp_path: Path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "server" / "bad.py").write_text("a = service.engine.engine.store\n"
                                                "b = async_engine.engine\n"
                                                "c = store.tiers[store.keeper]\n"
                                                "d = self.scheduler.kv.pool.cached\n"
                                                "e = self.engine.stats()\n")
    (tmp_path / "engine" / "owner.py").write_text("tier = store.tiers[0]\n")
    assert [hit.split(":")[1] for hit in reaches_through(tmp_path)] == ["1", "2", "3", "4"]
