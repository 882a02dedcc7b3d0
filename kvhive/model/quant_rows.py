"""Up to how many rows a step multiplies by GGUF blocks rather than the dense weights, per machine.

A step with few rows is bound by reading weights: the Q4_1/Q8_0 blocks are ~90 MB against ~425 MB
of float32 (``kvhive.model.quant``). With more rows the kernel's dequantisation and its narrower
tiles cost more than the bytes saved, and the dense oneDNN GEMM wins. Where the two cross depends
on the CPU, the dtype and the thread count: all layers' projections, blocks against dense, measured
with ``bench/forward_speed.py --matmuls`` (float32, 2 threads):

* AMD EPYC (Zen 4, AVX-512 on 256-bit units): 16 rows 25.9 vs 30.4 ms, 24 rows 41.3 vs 43.0;
* Intel Xeon (AVX-512, AMX): 24 rows 23.9 vs 37.5 ms, 32 rows 31.2 vs 42.3, 64 rows 62.3 vs 67.1;
  bfloat16 (AMX GEMMs) 8 rows 9.7 vs 12.5, 12 rows 14.5 vs 13.1.

So the limit is measured on the machine itself the first time a model of a given shape loads there
(well under a second), and cached beside the compiled kernels; ``--quantized-matmul-rows N`` fixes
it instead. Where nothing can be measured the static defaults of ``QUANT_MAX_ROWS`` hold.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import torch

from kvhive.model.native import cpu_model, default_cache_dir, kernel_source
from kvhive.model.timing import min_times

logger = logging.getLogger(__name__)

# Row counts tried, in order: the limit is the last one at which the blocks are still faster.
CANDIDATES = {torch.float32: (8, 16, 24, 32, 48, 64), torch.bfloat16: (4, 8, 12, 16, 24)}
_NAMES, _WITH_RESIDUAL = ("qkv", "o", "gate_up", "down"), frozenset({"o", "down"})


def time_projections(model, rows: int, repeat: int) -> tuple[float, float]:
    """Min ms of all layers' projections at ``rows`` rows: (GGUF blocks, dense), interleaved, the
    output and down projections adding the residual as the forward pass does."""
    from kvhive.model.llama import linear, linear_add

    quant = [(n, layer_q[n]) for layer_q in model.quant_layers for n in _NAMES]
    dense = [getattr(layer, f"{n}_proj") for layer in model.layers for n in _NAMES]
    gen = torch.Generator().manual_seed(0)
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(model.dtype) for _, w in quant}
    res = {w.shape[0]: torch.randn(rows, w.shape[0], generator=gen).to(model.dtype) for _, w in quant}

    def blocks() -> None:
        for n, w in quant:
            model.qmatmul(xs[w.shape[1]], w, res[w.shape[0]] if n in _WITH_RESIDUAL else None)

    def onednn() -> None:
        for (n, w), d in zip(quant, dense, strict=True):
            x = xs[w.shape[1]]
            linear_add(x, d, res[w.shape[0]]) if n in _WITH_RESIDUAL else linear(x, d)

    blocks_s, dense_s = min_times([blocks, onednn], repeat)
    return blocks_s * 1000, dense_s * 1000


def measure(model, repeat: int = 3) -> int:
    """The largest candidate row count at which the blocks beat the dense weights (0: at none)."""
    limit = 0
    for rows in CANDIDATES.get(model.dtype, ()):
        blocks_ms, dense_ms = time_projections(model, rows, repeat)
        if blocks_ms >= dense_ms:
            break
        limit = rows
    return limit


def _cache_path(model, cache_dir: str | None) -> str:
    c = model.config
    key = hashlib.sha256("\n".join([
        cpu_model(), str(model.qmatmul.isa), str(model.dtype), str(torch.get_num_threads()),
        f"{c.num_layers} {c.hidden_size} {c.intermediate_size} {c.num_heads} {c.num_kv_heads} {c.head_dim}",
        " ".join(str(w.kind) for w in model.quant_layers[0].values()),
        kernel_source("qmatmul"),          # a changed kernel crosses over elsewhere: measure again
    ]).encode()).hexdigest()[:16]
    return os.path.join(cache_dir or default_cache_dir(), f"kvhive-quant-rows-{key}.json")


def calibrate(model, cache_dir: str | None = None) -> int:
    """Set ``model.quant_max_rows`` to this machine's crossover (read from the cache, else measured
    and cached) and return it; a model without GGUF blocks is left as it is."""
    if model.qmatmul is None:
        return model.quant_max_rows
    path = _cache_path(model, cache_dir)
    try:
        with open(path) as f:
            limit = int(json.load(f)["max_rows"])
        source = "cached"
    except (OSError, ValueError, KeyError, TypeError):
        started = time.perf_counter()
        limit = measure(model)
        source = f"measured in {time.perf_counter() - started:.1f} s"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + f".{os.getpid()}", "w") as f:
                json.dump({"max_rows": limit, "dtype": str(model.dtype), "threads": torch.get_num_threads()}, f)
            os.replace(path + f".{os.getpid()}", path)
        except OSError as e:
            logger.warning("could not cache the quantised-matmul row limit: %s", e)
    model.quant_max_rows = limit
    logger.info("GGUF-block matmul for steps of <= %d rows (%s)", limit, source)
    return limit
