"""``kvhive serve`` and ``kvhive gateway`` as commands: help texts (defaults, option groups), argument
errors (the subcommand's usage, exit 2), a taken port (exit 2 at once, before the model loads), and
SIGINT (a clean exit)."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from support.servers import REPO_ROOT, free_port, healthy, subprocess_env, wait_until

from kvhive.cli import HelpFormatter, build_parser, listen_error, main

SERVE_GROUPS = ["model and device", "KV cache and prefix caching", "KV tiers", "sessions", "KV events",
                "server and security", "performance", "logging"]
GATEWAY_GROUPS = ["replicas", "block keys", "block index", "routing and scoring", "server", "logging"]


def _kvhive(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvhive.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO_ROOT, env=subprocess_env())


def _help(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The help text ``kvhive ARGS --help`` prints, unwrapped, whitespace collapsed."""
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exited:
        patch.setenv("COLUMNS", "1000")                 # argparse wraps at the terminal's width
        main([*args, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.default is not argparse.SUPPRESS]


def test_top_level_help_says_what_each_command_does(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys)
    parser, commands = build_parser()
    assert text.startswith(f"usage: kvhive [-h] [--version] {{{','.join(commands)}}}")
    assert "OpenAI-compatible LLM inference server" in text
    described = (parser.epilog or "").split("commands:\n", 1)[1].split("\n\n", 1)[0]
    assert [line.split()[0] for line in described.splitlines() if not line.startswith("    ")] == list(commands)
    assert "serve load a model and serve the OpenAI API" in text
    assert "gateway an OpenAI-compatible proxy" in text
    assert "kvhive serve --kv-cache-gb 0.5" in text
    assert "Run 'kvhive serve --help' or 'kvhive gateway --help'" in text
    assert "The only module that reads" not in text          # not the module's docstring


@pytest.mark.parametrize(("command", "groups"), [("serve", SERVE_GROUPS), ("gateway", GATEWAY_GROUPS)])
def test_help_shows_every_default_in_option_groups(capsys: pytest.CaptureFixture[str], command: str,
                                                   groups: list[str]) -> None:
    text = _help(capsys, command)
    assert text.startswith(f"usage: kvhive {command} ")
    positions = [text.find(f" {title}") for title in groups]
    assert -1 not in positions and positions == sorted(positions), positions
    _, parsers = build_parser()
    formatter = HelpFormatter(f"kvhive {command}")
    options = _options(parsers[command])
    assert len(options) > 10
    for action in options:
        shown = formatter._get_help_string(action)
        assert "(default" in shown, action.option_strings
        assert " ".join((shown % {"default": action.default}).split()) in text, action.option_strings
    assert "default: None" not in text
    # Every option sits in a named group, not in the catch-all "options".
    grouped = {a.dest for g in parsers[command]._action_groups
               if any((g.title or "").startswith(title) for title in groups) for a in g._group_actions}
    assert {a.dest for a in options} <= grouped


def test_serve_help_names_the_defaults_users_ask_about(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "serve")
    for shown in ("--port PORT TCP port to listen on (default: 8000)",
                  "(default: 127.0.0.1)", "(default: 2.0)", "(default: float32)", "(default: cpu)",
                  "(default: info)", "(default: 8)", "(default: 2048)", "(default: 16)",
                  "(default: prefix caching on)", "(default: no limit)", "(default: all cores, fewer while other processes keep cores busy",
                  "$KVHIVE_API_KEY", "about 3.4 GB"):
        assert shown in text, shown
    assert "(default: 8080)" in _help(capsys, "gateway")


@pytest.mark.parametrize("command", list(build_parser()[1]))
def test_an_unknown_flag_prints_the_subcommand_usage(command: str) -> None:
    done = _kvhive(command, "--bogus")
    assert done.returncode == 2
    assert done.stderr.startswith(f"usage: kvhive {command} "), done.stderr
    assert f"kvhive {command}: error: unrecognized arguments: --bogus" in done.stderr
    assert done.stdout == ""


def test_argument_errors_belong_to_the_parser_they_concern() -> None:
    before = _kvhive("--bogus", "serve")
    assert before.returncode == 2 and before.stderr.startswith("usage: kvhive [-h]"), before.stderr
    bad_port = _kvhive("serve", "--port", "70000")
    assert bad_port.returncode == 2 and bad_port.stderr.startswith("usage: kvhive serve ")
    assert "70000 is not a port number" in bad_port.stderr
    bad_value = _kvhive("gateway", "--load-weight", "x")
    assert bad_value.returncode == 2 and bad_value.stderr.startswith("usage: kvhive gateway ")


@pytest.fixture()
def taken_port() -> Iterator[int]:
    """A port another socket listens on (the way another server holds it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_listen_error_tells_a_taken_port_from_a_free_one(taken_port: int) -> None:
    assert listen_error("127.0.0.1", taken_port) == (f"port {taken_port} on 127.0.0.1 is in use "
                                                     "(pick another with --port)")
    assert listen_error("127.0.0.1", free_port()) is None
    assert "cannot resolve" in (listen_error("no-such-host.invalid", 8000) or "")


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_taken_port_fails_fast_before_the_model_loads(taken_port: int, command: str) -> None:
    # In a fresh interpreter, so the modules loaded are the command's own: a taken port must stop it
    # before torch (and so the model) is imported.
    flags = ["--replica", "http://127.0.0.1:9"] if command == "gateway" else []
    code = ("import sys\nfrom kvhive.cli import main\n"
            f"rc = main([{command!r}, '--port', '{taken_port}', *{flags!r}])\n"
            "print('torch' in sys.modules, 'kvhive.engine.core' in sys.modules)\nsys.exit(rc)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT, env=subprocess_env())
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"kvhive {command}: port {taken_port} on 127.0.0.1 is in use (pick another with --port)\n"
    assert done.stdout.split() == ["False", "False"]
    assert elapsed < 5, f"took {elapsed:.1f}s"


def test_the_serve_command_reports_a_taken_port_within_seconds(taken_port: int) -> None:
    start = time.monotonic()
    done = _kvhive("serve", "--port", str(taken_port))
    elapsed = time.monotonic() - start
    assert done.returncode == 2
    assert f"port {taken_port} on 127.0.0.1 is in use" in done.stderr
    assert elapsed < 5, f"took {elapsed:.1f}s"


def test_sigint_stops_the_server_cleanly() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port),
                             "--kv-cache-gb", "0.1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
                            env=subprocess_env())
    try:
        wait_until(lambda: proc.poll() is not None or healthy(f"http://127.0.0.1:{port}"), 180, "kvhive serve")
        assert proc.poll() is None
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
