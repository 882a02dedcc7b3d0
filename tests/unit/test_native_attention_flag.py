"""``--no-native-attention``: the CLI flag reaches the engine config."""

from __future__ import annotations

import argparse

from kvhive.serve_args import add_serve_args, build_engine_config


def test_flag_reaches_the_engine_config() -> None:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert build_engine_config(p.parse_args([])).native_attention is True
    assert build_engine_config(p.parse_args(["--no-native-attention"])).native_attention is False
