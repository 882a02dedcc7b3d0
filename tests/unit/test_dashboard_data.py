"""The live page's data shape and bounds: the JSON builders, the sample ring, the per-key usage
table, who may read the data, the page itself (self-contained), and the serve flags' wiring."""

from __future__ import annotations

import base64
import re

import pytest

from kvhive.core.dashboard_data import (
    MAX_KEY_HEADER_CHARS,
    Card,
    DashboardAccess,
    DashboardData,
    Series,
    StatsRing,
    bounded_table,
    rate_points,
)
from kvhive.core.dashboard_page import dashboard_html
from kvhive.server.dashboard_tables import SessionRow, hit_rate, runtime_table, session_table, usage_table
from kvhive.server.dashboard_usage import OTHER_KEYS, KeyUsage, KeyUsageTable
from kvhive.sessions.session import Session


def test_the_json_has_the_page_s_shape() -> None:
    data = DashboardData("t", 100.0, (Card("a", "A", 3, "count"),), (Series("s", "S", "fraction", ((1.0, 0.5),)),),
                         (bounded_table("x", "X", ("c1", "c2"), [(1, "b")]),))
    assert data.to_json() == {
        "title": "t", "generated_at": 100.0, "poll_interval_s": 2.0,
        "cards": [{"id": "a", "label": "A", "value": 3, "unit": "count"}],
        "series": [{"id": "s", "label": "S", "unit": "fraction", "points": [[1.0, 0.5]]}],
        "tables": [{"id": "x", "title": "X", "columns": ["c1", "c2"], "rows": [[1, "b"]], "omitted": 0}]}


def test_a_table_keeps_its_first_rows_and_counts_the_rest() -> None:
    table = bounded_table("x", "X", ("n",), [(i,) for i in range(250)], max_rows=100)
    assert len(table.rows) == 100 and table.rows[-1] == (99,) and table.omitted == 150


def test_the_ring_is_bounded_and_keeps_samples_an_interval_apart() -> None:
    ring: StatsRing[int] = StatsRing(interval_s=5.0, capacity=10)
    kept = [ring.offer(float(t), t) for t in range(1000)]
    assert sum(kept) == 200                       # one sample per 5 s offered
    assert [t for t, _ in ring.samples()] == [float(t) for t in range(950, 1000, 5)]
    assert not ring.due(999.0) and ring.due(1000.0)
    with pytest.raises(ValueError):
        StatsRing(interval_s=0)


def test_hit_rates_are_per_interval_and_zero_when_nothing_was_asked() -> None:
    samples = [(0.0, (0, 0)), (5.0, (30, 100)), (10.0, (30, 100)), (15.0, (130, 200))]
    assert rate_points(samples) == ((5.0, 0.3), (10.0, 0.0), (15.0, 1.0))
    assert rate_points(samples[:1]) == ()
    assert hit_rate(1, 3) == 0.3333 and hit_rate(5, 0) == 0.0


def test_only_a_valid_key_reads_and_only_the_admin_key_is_admin() -> None:
    access = DashboardAccess(api_keys=("k1", "adm"), admin_key="adm")
    assert access.needs_key
    assert access.key_of("Bearer k1") == "k1" and access.key_of(None, "k1") == "k1"
    assert access.key_of("Bearer k2") is None and access.key_of(None) is None and access.key_of("Bearer ") is None
    assert access.key_of("Basic k1") is None and access.key_of("Digest k1") is None
    assert access.is_admin("adm") and not access.is_admin("k1") and not access.is_admin(None)
    assert not DashboardAccess().needs_key
    assert DashboardAccess(admin_key="adm").needs_key          # the gateway: the admin key alone


def basic(credentials: bytes) -> str:
    return "Basic " + base64.b64encode(credentials).decode()


def test_basic_auth_presents_its_password_as_the_key() -> None:
    access = DashboardAccess(api_keys=("k1",), admin_key="adm")
    assert access.key_of(basic(b"x:k1")) == "k1" and access.key_of(basic(b":adm")) == "adm"
    assert access.key_of("basic  " + base64.b64encode(b"anyone:k1").decode()) == "k1"   # scheme in any case
    assert access.key_of(basic(b"k1:")) is None and access.key_of(basic(b"x:k2")) is None
    assert access.key_of(basic(b"k1")) is None                       # no colon: no password
    assert access.key_of(basic("x:k\u00e9".encode())) is None
    assert DashboardAccess(api_keys=("k\u00e9",)).key_of(basic("x:k\u00e9".encode())) == "k\u00e9"  # UTF-8
    for bad in ("Basic !!!!", "Basic eDprMQ", "Basic eDpr\u00e9MQ==", "Basic", "Basic "):
        assert access.key_of(bad) is None                            # bad base64 or padding, never raises
    # Basic takes precedence over x-api-key like Bearer does: a failing Authorization is no key.
    assert access.key_of(basic(b"x:nope"), "k1") is None


def test_an_over_long_key_header_is_no_key() -> None:
    long_key = "k" * (MAX_KEY_HEADER_CHARS + 1)
    access = DashboardAccess(api_keys=(long_key,))
    assert access.key_of(f"Bearer {long_key}") is None and access.key_of(None, long_key) is None
    assert access.key_of(basic(f"x:{long_key}".encode())) is None
    fits = "k" * 100
    assert DashboardAccess(api_keys=(fits,)).key_in({"authorization": basic(f"x:{fits}".encode())}) == fits


def test_usage_keeps_at_most_its_bound_of_keys() -> None:
    table = KeyUsageTable(max_keys=3)
    for i in range(10):
        table.row(f"owner{i}").requests += 1
    rows = dict(table.items())
    assert len(rows) == 4 and rows[OTHER_KEYS].requests == 7
    assert table.get("owner9") is None and table.get("owner0").requests == 1


def test_usage_rows_show_a_label_never_a_key() -> None:
    usage = KeyUsage(requests=2)
    usage.add_tokens(10, 3)
    table = usage_table([("6ab9f1eb", usage)])
    assert table.rows == (("6ab9f1eb", 2, 10, 3),)


def test_sessions_show_their_owner_only_when_asked() -> None:
    session = Session("sess-1", "owner-digest", "m", ttl_s=60, created=0.0, expires=130.0, num_tokens=40,
                      block_hashes=["aa", "bb"])
    row = SessionRow(session, "owner-di", {"device": 2, "cpu": 1})
    plain = session_table([row], ["cpu"], block_bytes=100, show_owner=False, now=100.0)
    assert plain.columns == ("id", "kind", "tokens", "blocks", "bytes", "device_blocks", "cpu_blocks",
                             "expires_in_s")
    assert plain.rows == (("sess-1", "session", 40, 2, 200, 2, 1, 30),)
    admin = session_table([row], ["cpu"], block_bytes=100, show_owner=True, now=100.0)
    assert admin.columns[1] == "owner" and admin.rows[0][1] == "owner-di"
    unplaced = session_table([SessionRow(session, None, None)], ["cpu"], 100, False, now=200.0)
    assert unplaced.rows[0][-3:] == (None, None, 0)


def test_the_runtime_table_lists_the_isa_and_each_op_s_path() -> None:
    table = runtime_table({"device": "cpu", "dtype": "float32", "cpu_isa": None,
                           "paths": {"projections": "torch", "attention": "C++ avx2"}})
    assert table.rows == (("device", "cpu"), ("dtype", "float32"), ("cpu_isa", "-"),
                          ("path:attention", "C++ avx2"), ("path:projections", "torch"))


def test_the_page_is_self_contained() -> None:
    page = dashboard_html()
    assert page.startswith("<!doctype html>")
    assert not re.search(r"""(src|href)\s*=""", page), "no external asset"
    assert re.findall(r"https?://[^'\"\s]+", page) == ["http://www.w3.org/2000/svg"]     # a namespace, not a fetch
    assert "new URL('dashboard/data', location.origin + location.pathname)" in page and "const POLL_MS = 2000;" in page
    assert "credentials: 'same-origin'" in page and "localStorage" not in page   # the browser holds the key


def test_serve_flags_reach_the_app_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhive import cli
    from kvhive.launch import replica

    seen = {}

    def refuse(config, options, **_):
        seen["options"] = options
        raise replica.EngineRefused("stop here")

    monkeypatch.setattr(replica, "build_replica", refuse)
    monkeypatch.delenv("KVHIVE_API_KEY", raising=False)
    serve = cli.build_parser()[1]["serve"]
    for argv, dashboard, keys, admin in (
            ([], True, (), None),
            (["--no-dashboard", "--api-key", "k1", "--admin-key", "adm"], False, ("k1", "adm"), "adm"),
            (["--admin-key", "adm"], True, ("adm",), "adm")):
        args = serve.parse_args(argv)
        assert cli.run_engine(args, object()) == 2
        options = seen["options"]
        assert (options.dashboard, options.api_keys, options.admin_key) == (dashboard, keys, admin)
