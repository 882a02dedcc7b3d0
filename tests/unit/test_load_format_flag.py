"""``--load-format auto|dummy`` and ``--hf-config-path`` (alias ``--hf-config``): the flags reach the
engine config, and a bad value is refused naming the flag."""

from __future__ import annotations

import argparse
import json

import pytest

from kvhive.config import EngineConfig
from kvhive.serve_args import add_serve_args, build_engine_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p


def test_flags_reach_the_engine_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    p = _parser()
    default = build_engine_config(p.parse_args([]))
    assert (default.load_format, default.hf_config_path) == ("auto", None)
    for flag in ("--hf-config-path", "--hf-config"):
        config = build_engine_config(p.parse_args(["--load-format", "dummy", flag, str(tmp_path)]))
        assert (config.load_format, config.hf_config_path) == ("dummy", str(tmp_path))


def test_a_bare_config_file_serves_under_its_directorys_name(tmp_path) -> None:
    model = tmp_path / "llama-8b-shape"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = build_engine_config(_parser().parse_args(["--model", str(model / "config.json"), "--load-format", "dummy"]))
    assert config.served_model_name == "llama-8b-shape"


def test_an_unknown_load_format_exits_2_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["--load-format", "pt"])
    assert info.value.code == 2
    assert "--load-format" in capsys.readouterr().err


def test_the_engine_config_refuses_bad_values_naming_the_flag(tmp_path) -> None:
    with pytest.raises(ValueError, match="--load-format"):
        EngineConfig(model_path="m", load_format="safetensors")
    with pytest.raises(ValueError, match="--hf-config-path"):
        EngineConfig(model_path="m", hf_config_path=str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="--hf-config-path"):
        EngineConfig(model_path="m", hf_config_path=str(tmp_path))          # a directory without config.json
