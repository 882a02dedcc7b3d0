"""The sampling defaults a model's ``generation_config.json`` recommends (``--generation-config``),
read as vLLM reads them (torch-free).

- ``auto`` (the default, as in vLLM): the model directory's ``generation_config.json``; a GGUF
  file or a directory without one gives no defaults.
- ``vllm``: none; a request's unset fields take OpenAI's and vLLM's neutral values.
- a directory: its ``generation_config.json`` (which must exist).

Only vLLM's keys count: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``
and ``max_new_tokens`` (the default ``max_tokens``). As in vLLM, which keeps only the values that
differ from transformers' ``GenerationConfig`` defaults, a key set to that default (temperature 1,
top_p 1, top_k 50, repetition_penalty 1) is no default; a request's own value always wins.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
# The values transformers' GenerationConfig starts from: vLLM keeps a key only when it differs.
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
# generation_config.json files are small; a larger one is not one.
MAX_GENERATION_CONFIG_BYTES = 1 << 20


class GenerationConfigError(ValueError):
    """A ``--generation-config`` that cannot be read or holds a value out of bounds."""


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a field unset gets (None: OpenAI's or vLLM's neutral value)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = "vllm"               # the file they came from, or "vllm"

    def __post_init__(self) -> None:
        checks = {"temperature": lambda v: 0 <= v <= 2, "top_p": lambda v: 0 < v <= 1,
                  "top_k": lambda v: v >= -1, "min_p": lambda v: 0 <= v <= 1,
                  "repetition_penalty": lambda v: 0 < v <= 10, "max_tokens": lambda v: v >= 1}
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and ok(value)):
                raise GenerationConfigError(f"{self.source}: {_key(name)} = {value} is out of bounds")

    def describe(self) -> str:
        """The defaults for the startup log, e.g. "temperature=0.7 top_p=0.8 (from .../generation_config.json)"."""
        values = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                  if f.name != "source" and getattr(self, f.name) is not None]
        if not values:
            return f"none ({self.source})"
        return f"{' '.join(values)} (from {self.source})"


# No defaults: ``--generation-config vllm``, or a model without a generation_config.json.
NO_DEFAULTS = SamplingDefaults()


def _key(name: str) -> str:
    return "max_new_tokens" if name == "max_tokens" else name


def load_sampling_defaults(mode: str, model_path: str) -> SamplingDefaults:
    """The defaults of ``--generation-config`` ``mode`` (``auto``, ``vllm`` or a directory) for the
    model at ``model_path``; GenerationConfigError when a file named cannot be read or is out of bounds."""
    if mode == "vllm":
        return SamplingDefaults()
    if mode == "auto":
        if not os.path.isdir(model_path):
            return SamplingDefaults(source=f"{os.path.basename(model_path)} is no directory: no {GENERATION_CONFIG_FILE}")
        path = os.path.join(model_path, GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            return SamplingDefaults(source=f"no {GENERATION_CONFIG_FILE} in {model_path}")
    else:
        path = os.path.join(mode, GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            raise GenerationConfigError(f"--generation-config {mode}: no {GENERATION_CONFIG_FILE} there")
    return defaults_from_file(path)


def defaults_from_file(path: str) -> SamplingDefaults:
    """The defaults a ``generation_config.json`` at ``path`` holds."""
    try:
        if os.path.getsize(path) > MAX_GENERATION_CONFIG_BYTES:
            raise GenerationConfigError(f"{path}: over {MAX_GENERATION_CONFIG_BYTES} bytes")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:      # RecursionError: nested too deep
        raise GenerationConfigError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: not a JSON object")
    return SamplingDefaults(source=path, **{name: _value(raw, name, path) for name in
                                             ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                              "max_tokens")})


def _value(raw: dict[str, Any], name: str, path: str) -> Any:
    """The value of one key (None when absent, null or transformers' own default)."""
    value = raw.get(_key(name))
    if value is None or value == _TRANSFORMERS_DEFAULTS.get(name):
        return None
    integer = name in ("top_k", "max_tokens")
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise GenerationConfigError(f"{path}: {_key(name)} must be {'an integer' if integer else 'a number'}, "
                                    f"got {value!r}")
    return value if integer else float(value)
