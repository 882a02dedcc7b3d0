"""``kvhive`` help texts (what each command does, every default, option groups) and the taken-port
check ``kvhive serve`` runs before loading anything, in process."""

from __future__ import annotations

import argparse

import pytest
from support.servers import free_port

from kvhive.cli import HelpFormatter, build_parser, listen_error, main

SERVE_GROUPS = ["flags from a file", "model and device", "KV cache and prefix caching", "KV tiers", "sessions", "KV events",
                "server and security", "HTTP limits", "registration", "performance", "logging"]
GATEWAY_GROUPS = ["replicas", "flags from a file", "block keys", "block index", "routing and scoring", "upstream time limits", "server",
                  "HTTP limits", "logging"]



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
                  "(default: 127.0.0.1)", "(default: 2.0)", "(default: auto)", "(default: cpu)",
                  "(default: info)", "(default: 8)", "(default: 2048)", "(default: 16)",
                  "(default: prefix caching on)", "(default: no limit)", "(default: all cores, fewer while other processes keep cores busy",
                  "$KVHIVE_API_KEY", "about 3.4 GB"):
        assert shown in text, shown
    assert "(default: 8080)" in _help(capsys, "gateway")


def test_help_shows_the_model_argument_the_config_file_and_the_client_flags(capsys: pytest.CaptureFixture[str]) -> None:
    serve = _help(capsys, "serve")
    assert serve.startswith("usage: kvhive serve [-h] [--config FILE]") and "[MODEL]" in serve
    for shown in ("MODEL the model to serve, as --model takes it", "--config FILE a YAML file of 'serve' flags",
                  "--enable-tokenizer-info-endpoint serve GET /tokenizer_info", "--allowed-origins LIST",
                  "--allowed-methods LIST", "--allowed-headers LIST", "--allow-credentials"):
        assert shown in serve, shown
    gateway = _help(capsys, "gateway")
    for shown in ("--config FILE a YAML file of 'gateway' flags", "--allowed-origins LIST", "--allow-credentials"):
        assert shown in gateway, shown


def test_listen_error_tells_a_taken_port_from_a_free_one(taken_port: int) -> None:
    assert listen_error("127.0.0.1", taken_port) == (f"port {taken_port} on 127.0.0.1 is in use "
                                                     "(pick another with --port)")
    assert listen_error("127.0.0.1", free_port()) is None
    assert "cannot resolve" in (listen_error("no-such-host.invalid", 8000) or "")
