"""``--kv-cache-dtype``: the flag reaches the engine config, one place resolves the pool's KV dtype,
block bytes follow the row size, bad values stop ``kvhive serve`` at start (exit 2, naming the
flag), and the attention kernels fall back to torch, logged, where they do not read 8-bit rows."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest
import torch
from support.servers import REPO_ROOT, free_port, subprocess_env
from support.tiny import tiny_config

from kvhive.config import EngineConfig, ModelConfig
from kvhive.engine.attention_kernels import choose_attention_kernels
from kvhive.engine.runner import ModelRunner
from kvhive.serve_args import add_serve_args, build_engine_config

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p


def test_the_flag_reaches_the_config_and_resolves_once() -> None:
    p = _parser()
    assert build_engine_config(p.parse_args([])).kv_cache_dtype == "auto"
    for value, dtype, resolved in [("auto", "float32", "float32"), ("auto", "bfloat16", "bfloat16"),
                                   ("int8", "float32", "int8"), ("fp8", "bfloat16", "fp8"),
                                   ("fp8_e4m3", "float32", "fp8"), ("bfloat16", "bfloat16", "bfloat16")]:
        config = build_engine_config(p.parse_args(["--kv-cache-dtype", value, "--dtype", dtype]))
        assert config.kv_cache_dtype == value and config.kv_dtype == resolved
    with pytest.raises(ValueError, match="dtype 'auto'"):
        _ = build_engine_config(p.parse_args(["--kv-cache-dtype", "int8"])).kv_dtype   # --dtype auto: not yet


def test_block_bytes_follow_the_row_size() -> None:
    """SmolLM2-135M (head_dim 64): an 8-bit row is 66 bytes against bf16's 128, ~1.94x the blocks."""
    bytes_of = {kv: EngineConfig(model_path="m", dtype="bfloat16", kv_cache_dtype=kv).kv_bytes_per_block(SMOLLM2)
                for kv in ("auto", "int8", "fp8")}
    assert bytes_of["auto"] == 2 * 30 * 3 * 64 * 2 * 16
    assert bytes_of["int8"] == bytes_of["fp8"] == 2 * 30 * 3 * 66 * 16
    blocks = {kv: EngineConfig(model_path="m", dtype="bfloat16", kv_cache_dtype=kv).resolved(SMOLLM2).cache.num_blocks
              for kv in ("auto", "int8")}
    assert 1.9 < blocks["int8"] / blocks["auto"] < 1.95
    for kv in ("auto", "int8", "fp8_e4m3"):
        config = EngineConfig(model_path="m", dtype="float32", kv_cache_dtype=kv)
        assert config.kv_bytes_per_block(SMOLLM2) == ModelRunner.kv_bytes_per_block(SMOLLM2, 16, "float32", kv)


def test_the_engine_config_refuses_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        EngineConfig(model_path="m", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 needs a GPU"):
        EngineConfig(model_path="m", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 with --dtype float32"):
        EngineConfig(model_path="m", dtype="float32", kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="--attention-backend triton.*--kv-cache-dtype int8"):
        EngineConfig(model_path="m", kv_cache_dtype="int8", attention_backend="triton")
    assert EngineConfig(model_path="m", device="cuda", dtype="float16", kv_cache_dtype="float16").kv_dtype == "float16"
    assert EngineConfig(model_path="m", device="cuda", dtype="float16", kv_cache_dtype="fp8").kv_dtype == "fp8"


@pytest.mark.parametrize("args,named", [
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype: invalid choice: 'int4'"),
    (["--kv-cache-dtype", "int8", "--attention-backend", "triton"], "--attention-backend triton"),
    (["--kv-cache-dtype", "float16"], "--kv-cache-dtype float16 needs a GPU"),
    (["--kv-cache-dtype", "bfloat16", "--dtype", "float32"], "--kv-cache-dtype bfloat16 with --dtype float32"),
])
def test_kvhive_serve_exits_2_naming_the_flag(args: list[str], named: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=subprocess_env())
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "--kv-cache-dtype" in done.stderr, done.stderr


class _Kernel:
    """A stand-in C++ kernel that reads the 8-bit formats in ``formats``."""

    def __init__(self, formats: tuple[str, ...]) -> None:
        self.formats = formats

    def supports_kv(self, kv_dtype: str | None) -> bool:
        return kv_dtype is None or kv_dtype in self.formats

    def supports(self, *_: object) -> bool:
        return True

    def describe(self, device: torch.device) -> str:
        return "C++ stand-in"


def test_cpu_kernels_serve_an_8bit_pool_only_where_they_read_it(monkeypatch, caplog) -> None:
    from kvhive.engine import attention_kernels

    reads_int8 = _Kernel(("int8",))
    monkeypatch.setattr(attention_kernels.CpuDecodeKernel, "load", staticmethod(lambda isa: reads_int8))
    monkeypatch.setattr(attention_kernels.CpuPrefillKernel, "load", staticmethod(lambda isa: reads_int8))
    cfg, cpu = tiny_config(), torch.device("cpu")
    kept = choose_attention_kernels(cfg, torch.float32, cpu, True, None, measure_attention=True, kv_dtype="int8")
    assert kept.decode is reads_int8 and kept.prefill is reads_int8
    with caplog.at_level(logging.INFO, logger="kvhive.engine.attention_kernels"):
        dropped = choose_attention_kernels(cfg, torch.float32, cpu, True, None, measure_attention=True, kv_dtype="fp8")
    assert dropped.decode is None and dropped.prefill is None
    assert "does not read fp8 KV pools; torch on the dequantised K/V" in caplog.text


def test_triton_does_not_read_an_8bit_pool(caplog) -> None:
    cfg = tiny_config()
    with pytest.raises(ValueError, match="--attention-backend triton.*--kv-cache-dtype int8"):
        choose_attention_kernels(cfg, torch.float32, torch.device("cpu"), True, None, False, backend="triton",
                                 kv_dtype="int8")
    with caplog.at_level(logging.INFO, logger="kvhive.engine.attention_kernels"):
        kernels = choose_attention_kernels(cfg, torch.float32, torch.device("cuda"), True, None, False,
                                           kv_dtype="fp8")
    assert kernels.decode is None and kernels.prefill is None
    assert "Triton kernels do not read a fp8 KV pool" in caplog.text
