"""``kvhive serve MODEL`` and ``--config FILE.yaml`` as the parser reads them (``kvhive.cli.parse_args``):
the positional model, a file's flags under the command line's, and the file's errors (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhive.cli import parse_args
from kvhive.core.flag_values import FlagValueError, load_flag_file


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "flags.yaml"
    path.write_text(text)
    return str(path)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_the_model_as_a_positional_argument_or_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct"]).model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert parse_args(["serve", "--port", "8001", "m.gguf"]).model == "m.gguf"
    assert parse_args(["serve", "--model", "m.gguf"]).model == "m.gguf"
    assert parse_args(["serve", "m.gguf", "--model", "m.gguf"]).model == "m.gguf"
    assert parse_args(["serve"]).model is None
    err = _refused(["serve", "a.gguf", "--model", "b.gguf"], capsys)
    assert "positional MODEL 'a.gguf' and --model 'b.gguf'" in err


def test_a_config_file_sets_flags_the_command_line_does_not(tmp_path: Path) -> None:
    path = _file(tmp_path, "port: 8123\nkv-cache-gb: 0.5\napi_key: [k1, k2]\nshare_prefix_cache: true\n"
                           "allowed_origins: ['https://a.example']\nmodel: from-file.gguf\n")
    args = parse_args(["serve", "--config", path])
    assert (args.port, args.kv_cache_gb, args.api_key) == (8123, 0.5, ["k1", "k2"])
    assert args.share_prefix_cache is True and args.allowed_origins == ("https://a.example",)
    assert args.model == "from-file.gguf"
    args = parse_args(["serve", "--config", path, "--port", "9000", "--api-key", "k3", "cli.gguf"])
    assert (args.port, args.api_key, args.model, args.kv_cache_gb) == (9000, ["k3"], "cli.gguf", 0.5)
    events = parse_args(["serve", "--config", _file(tmp_path, "kv-events-config: {enable_kv_cache_events: true}\n")])
    assert events.kv_events_config == '{"enable_kv_cache_events": true}'
    gateway = parse_args(["gateway", "--config", _file(tmp_path, "replica: [http://a:1, http://b:2]\nport: 8081\n")])
    assert gateway.replica == ["http://a:1", "http://b:2"] and gateway.port == 8081


@pytest.mark.parametrize(("text", "expected"), [
    ("prot: 8000\n", "unknown key 'prot'"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("port: abc\n", "argument --port: 'abc' is not a port number"),
    ("share_prefix_cache: 1\n", "'share_prefix_cache' must be true or false"),
    ("port: {a: 1}\n", "argument --port: '{\"a\": 1}' is not a port number"),
    ("port: true\n", "'port' takes a value, not True"),
    ("- port\n", "must be a mapping of flag names"),
    ("port: [\n", "is not valid YAML"),
])
def test_a_bad_config_file_exits_2_naming_the_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           text: str, expected: str) -> None:
    path = _file(tmp_path, text)
    err = _refused(["serve", "--config", path], capsys)
    assert err.startswith("usage: kvhive serve ") and f"--config {path}: " in err and expected in err


def test_a_flag_file_is_bounded_and_must_exist(tmp_path: Path) -> None:
    with pytest.raises(FlagValueError, match="cannot read"):
        load_flag_file(str(tmp_path / "missing.yaml"))
    big = tmp_path / "big.yaml"
    big.write_text("port: 1\n" + "#" * (1 << 20))
    with pytest.raises(FlagValueError, match="at most"):
        load_flag_file(str(big))
    assert load_flag_file(_file(tmp_path, "")) == {}
