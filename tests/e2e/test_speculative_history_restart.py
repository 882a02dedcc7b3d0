"""The "history" drafter's store outlives a graceful restart with ``--disk-cache-dir``: real
``kvhive serve`` processes over real HTTP on the default model. A server answers an open question
and stops (SIGTERM); the next one, started on the same dir, drafts that answer from its history when
asked again (the same greedy text, history drafts accepted). A history file damaged between runs is
logged and not used: the server starts, answers the same text, and drafts nothing from history.
A server that is killed (SIGKILL) has written its history while it ran: the next one drafts too."""

from __future__ import annotations

import re
import time

import httpx
from support.kvhive_serve import ServeProcess

from kvhive.engine.speculative.history_file import FILE_NAME, SAVE_INTERVAL_S

SPEC = '{"method": "history", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 6}'
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _ask(server: ServeProcess) -> str:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 48,
        "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def _counter(server: ServeProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _assert_drafts_from_history(flags: tuple[str, ...], answer: str) -> None:
    """A server started with ``flags`` answers as before and accepts drafts from its history."""
    restarted = ServeProcess(*flags)
    try:
        assert _ask(restarted) == answer
        assert _counter(restarted, "kvhive_spec_decode_num_history_accepted_tokens_total") >= 16
    finally:
        restarted.stop()


def test_the_history_drafts_after_a_restart_and_a_damaged_file_is_not_used(tmp_path) -> None:
    flags = ("--disk-cache-dir", str(tmp_path), "--speculative-config", SPEC)
    first = ServeProcess(*flags)
    try:
        answer = _ask(first)
        assert _counter(first, "kvhive_spec_decode_num_history_accepted_tokens_total") == 0   # nothing kept yet
    finally:
        first.stop()
    path = tmp_path / FILE_NAME
    assert path.stat().st_size > 0

    _assert_drafts_from_history(flags, answer)

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    damaged = ServeProcess(*flags)
    try:
        assert _ask(damaged) == answer
        assert _counter(damaged, "kvhive_spec_decode_num_history_draft_tokens_total") == 0
        assert "speculative history" in damaged.log_tail() and "checksum mismatch" in damaged.log_tail()
    finally:
        damaged.stop()


def test_a_killed_server_wrote_its_history_while_it_ran(tmp_path) -> None:
    flags = ("--disk-cache-dir", str(tmp_path), "--speculative-config", SPEC)
    path = tmp_path / FILE_NAME
    first = ServeProcess(*flags)
    try:
        answer = _ask(first)
        deadline = time.monotonic() + SAVE_INTERVAL_S + 20
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert path.exists(), "the running server never wrote its history"
    finally:
        first.kill()

    _assert_drafts_from_history(flags, answer)
