"""``--load-format dummy`` (vLLM's name and meaning): a model of any supported family built from its
config.json alone, with random weights, so a model of the size people serve runs without its weights.

The config comes from the model path (a directory holding config.json, or the JSON file itself) or
from ``--hf-config-path``, and passes the checks a real checkpoint's config passes
(``hf_dir.read_hf_config``): a config kvhive cannot run is the same ValueError naming the file and
the field. The weights are drawn on the target device in the target dtype from a seeded generator
(never materialised in float32 on the CPU first): every matrix normal with std ``DUMMY_STD``, every
norm at its identity (1, which for Gemma's float32 ``1 + weight`` scales is a weight of 0), biases
zero. Small and centred weights keep activations and logits finite in bfloat16 and float16.

The weights are not a checkpoint's, so the tokenizer still comes from files: the model directory's
(the directory of a bare config.json), or the GGUF file's when ``--model`` is one and the config
comes from ``--hf-config-path``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kvhive.config import ModelConfig
from kvhive.model.hf_dir import config_json_file, read_hf_config

DUMMY_STD = 0.02       # standard deviation of every random matrix (as initializer_range in HF configs)


class DummyConfig(NamedTuple):
    """The checked config a dummy model is built from, the file it came from, and whether the
    family's checkpoints carry q/k/v biases (the model is built with them)."""

    config: ModelConfig
    config_file: str
    qkv_bias: bool


def dummy_config_source(model_path: str, hf_config_path: str | None) -> str:
    """The path whose config.json describes the dummy model (ValueError when there is none)."""
    source = hf_config_path or model_path
    if source.endswith(".gguf") and os.path.isfile(source):
        raise ValueError(f"--load-format dummy needs a config.json, and {source} is a GGUF file: "
                         "give the config with --hf-config-path")
    return source


def read_dummy_config(model_path: str, hf_config_path: str | None = None) -> DummyConfig:
    """The config a dummy model of ``model_path`` (or ``hf_config_path``) is built from, checked as
    a checkpoint's is; ValueError naming the file and the field of anything kvhive cannot run."""
    source = dummy_config_source(model_path, hf_config_path)
    config, family = read_hf_config(source)
    return DummyConfig(config, config_json_file(source), family.qkv_bias)


@torch.inference_mode()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter of ``model`` in place where it lives: matrices normal(0, DUMMY_STD),
    norms 1, biases 0; the same values for the same seed, device and parameter order."""
    generator: torch.Generator | None = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm"):
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)


def dummy_digest(seed: int) -> bytes:
    """What stands for the weights' digest in a dummy model's fingerprint."""
    return f"kvhive-dummy-weights-seed-{seed}".encode()


def dummy_tokenizer_path(model_path: str) -> str:
    """Where a dummy model's tokenizer is read from: the model directory or GGUF file, or the
    directory of a model path that is a bare config.json."""
    if os.path.isfile(model_path) and model_path.endswith(".json"):
        return os.path.dirname(os.path.abspath(model_path))
    return model_path


def check_dummy_tokenizer(model_path: str) -> None:
    """ValueError naming what is missing when a dummy model has no tokenizer to serve with."""
    path = dummy_tokenizer_path(model_path)
    if path.endswith(".gguf") and os.path.isfile(path):
        return
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"--load-format dummy makes random weights but no tokenizer: {path} has no "
                         "tokenizer.json; put the model's tokenizer.json and tokenizer_config.json beside "
                         "its config.json, or give --model a directory or .gguf file with a tokenizer and "
                         "the config with --hf-config-path")


def check_dummy_sources(model_path: str, hf_config_path: str | None) -> None:
    """ValueError naming the file and field, or what is missing, when a dummy model of
    ``model_path`` cannot be built (its config) or served (its tokenizer); reads no weights."""
    read_dummy_config(model_path, hf_config_path)
    check_dummy_tokenizer(model_path)
