"""``--generation-config``: the sampling defaults read from a ``generation_config.json`` as vLLM
reads them, the three modes, bad files refused by name; a request's unset fields take them, its own
values win; ``kvhive serve`` and the Ray application take the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhive.config import EngineConfig
from kvhive.core.generation_defaults import (
    NO_DEFAULTS,
    GenerationConfigError,
    SamplingDefaults,
    load_sampling_defaults,
)
from kvhive.integrations.ray.app_args import ConfigError, parse_app_config
from kvhive.server.protocol import CompletionRequest
from kvhive.server.sampling_fields import sampling_params_for

QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "repetition_penalty": 1.05,
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}


def model_dir(tmp_path: Path, config: dict | None, name: str = "model") -> str:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    if config is not None:
        (directory / "generation_config.json").write_text(json.dumps(config))
    return str(directory)


def test_auto_reads_the_model_directory(tmp_path: Path) -> None:
    defaults = load_sampling_defaults("auto", model_dir(tmp_path, {**QWEN, "max_new_tokens": 64, "min_p": 0.05}))
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert defaults.min_p == 0.05 and defaults.max_tokens == 64
    assert "temperature=0.7" in defaults.describe() and "generation_config.json" in defaults.describe()


def test_transformers_own_defaults_set_nothing_as_in_vllm(tmp_path: Path) -> None:
    plain = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "_from_model_config": True}
    defaults = load_sampling_defaults("auto", model_dir(tmp_path, plain))
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (None,) * 4


def test_vllm_a_gguf_and_a_directory_without_the_file_give_none(tmp_path: Path) -> None:
    assert load_sampling_defaults("vllm", model_dir(tmp_path, QWEN)) == NO_DEFAULTS
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert load_sampling_defaults("auto", str(gguf)).temperature is None
    assert load_sampling_defaults("auto", model_dir(tmp_path, None, "bare")).describe().startswith("none")


def test_a_directory_reads_its_own_file(tmp_path: Path) -> None:
    model = model_dir(tmp_path, QWEN)
    other = model_dir(tmp_path, {"temperature": 0.2}, "other")
    assert load_sampling_defaults(other, model).temperature == 0.2
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        load_sampling_defaults(model_dir(tmp_path, None, "empty"), model)


@pytest.mark.parametrize("config,key", [({"temperature": "hot"}, "temperature"), ({"top_k": 2.5}, "top_k"),
                                        ({"top_p": 0}, "top_p"), ({"max_new_tokens": 0}, "max_new_tokens"),
                                        ({"repetition_penalty": -1}, "repetition_penalty"), ([1, 2], "JSON object")])
def test_bad_values_are_refused_by_name(tmp_path: Path, config: object, key: str) -> None:
    directory = tmp_path / "bad"
    directory.mkdir()
    (directory / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(GenerationConfigError, match=key):
        load_sampling_defaults("auto", str(directory))


def test_unset_fields_take_the_defaults_and_set_ones_win() -> None:
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05)
    unset = sampling_params_for(CompletionRequest(model="m", prompt="x"), 8, defaults, 100)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == (0.7, 0.8, 20, 0.05, 1.05)
    body = CompletionRequest(model="m", prompt="x", temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0,
                             repetition_penalty=1.0)
    chosen = sampling_params_for(body, 8, defaults, 100)
    assert (chosen.temperature, chosen.top_p, chosen.top_k, chosen.min_p, chosen.repetition_penalty) == (0, 1, 0, 0, 1)
    # OpenAI's clients may send null for the penalties: none.
    neutral = sampling_params_for(CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "presence_penalty": None, "frequency_penalty": None}), 8, NO_DEFAULTS, 100)
    assert not neutral.uses_token_history
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.min_p, neutral.repetition_penalty) == (1, 1, 0, 0, 1)


def test_the_flag_is_checked_by_serve_and_ray(tmp_path: Path) -> None:
    other = model_dir(tmp_path, {"temperature": 0.2}, "other")
    assert EngineConfig(model_path="m", generation_config=other).generation_config == other
    assert EngineConfig(model_path="m", generation_config="vllm").generation_config == "vllm"
    with pytest.raises(ValueError, match="--generation-config"):
        EngineConfig(model_path="m", generation_config=str(tmp_path / "missing"))
    assert parse_app_config({"generation_config": other}).engine.generation_config == other
    with pytest.raises(ConfigError, match="generation-config"):
        parse_app_config({"generation_config": str(tmp_path / "missing")})
