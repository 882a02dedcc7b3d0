"""Small C++ kernels compiled once per machine with the system compiler and loaded through ctypes.

Each library is built for one ISA level (``kvhive.model.cpu``: ``avx512_bf16``, ``avx512``,
``avx2``, ``portable``) and keyed by its source, the compiler, the flags and the CPU model, so a
cached build never runs on a CPU it was not built for. Builds land in the user's cache directory
(``$KVHIVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvhive``, else ``~/.cache/kvhive``), so a restart or
a second server reuses them; ``kvhive warmup`` builds them ahead of time. Builds are atomic (compile
to a temporary file, then rename), so concurrent processes that build the same library agree on one
file.
``-fopenmp`` libraries share PyTorch's OpenMP runtime: torch loads ``libgomp.so.1`` first and the
dynamic linker reuses it, so kernels and torch ops use one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time

from kvhive.model.cpu import compile_flags, detect

logger = logging.getLogger(__name__)

DEFAULT_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# The kernels' C++: one ``NAME.cpp`` per library, and headers they share.
CSRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def kernel_source(name: str, csrc_dir: str = CSRC_DIR) -> str:
    """``csrc/NAME.cpp`` as one translation unit: each ``#include "x.h"`` line replaced by that
    header's text, so the source alone builds the library and keys its cache."""
    def read(file: str) -> str:
        with open(os.path.join(csrc_dir, file)) as f:
            return f.read()

    return _LOCAL_INCLUDE.sub(lambda m: read(m.group(1)), read(f"{name}.cpp"))


def cpu_model() -> str:
    """The CPU's model name and flags (part of every library's cache key)."""
    features = detect()
    return f"{features.model}\n{' '.join(sorted(features.flags))}"


def default_cache_dir() -> str:
    """Where kernels are cached: ``$KVHIVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvhive/kernels``,
    else ``~/.cache/kvhive/kernels``."""
    if os.environ.get("KVHIVE_CACHE_DIR"):
        return os.environ["KVHIVE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvhive", "kernels")


def build_library(name: str, source: str, flags: tuple[str, ...] = DEFAULT_FLAGS,
                  cache_dir: str | None = None, isa: str = "portable") -> ctypes.CDLL | None:
    """Compile ``source`` for ISA level ``isa`` (cached) and load it; None, with a warning, without a
    working compiler. The first build logs what it builds, for which level, and how long it took."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found: the %s kernel is unavailable", name)
        return None
    flags = (*flags, *compile_flags(isa))
    key = hashlib.sha256("\n".join([source, compiler, *flags, platform.machine(),
                                    cpu_model()]).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir or default_cache_dir(), f"kvhive-{name}-{isa}-{key}.so")
    try:
        if not os.path.exists(path):
            started = time.perf_counter()
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                src, lib = os.path.join(tmp, f"{name}.cpp"), os.path.join(tmp, f"{name}.so")
                with open(src, "w") as f:
                    f.write(source)
                subprocess.run([compiler, *flags, "-o", lib, src], check=True, capture_output=True)
                shutil.copyfile(lib, path + f".{os.getpid()}")
                os.replace(path + f".{os.getpid()}", path)
            logger.info("built the %s kernel for %s in %.1f s (cached in %s)", name, isa,
                        time.perf_counter() - started, os.path.dirname(path))
        return ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-2000:] if isinstance(e, subprocess.CalledProcessError) else e
        logger.warning("the %s kernel is unavailable: %s", name, detail)
        return None
