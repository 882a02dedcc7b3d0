"""The KV pool on huge pages: aligned, zeroed, advised where the host allows it, and the same
tensor on ordinary pages where it does not (the fallback forced here on any host)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support.tiny import tiny_model

from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model import host_pages
from kvhive.request import SamplingParams

BIG = (host_pages.MIN_BYTES // 4 + 12345,)          # float32 values: past the huge-page threshold


def refuse_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host where madvise fails (huge pages off, or no libc to call)."""
    monkeypatch.setattr(host_pages, "_madvise", lambda address, length: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_a_large_tensor_is_zeroed_aligned_and_writable(dtype: torch.dtype) -> None:
    shape = (3, host_pages.MIN_BYTES // dtype.itemsize // 3 + 7)
    t, _ = host_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % host_pages.HUGE_PAGE == 0
    assert not t.any()
    t[2, -1] = 5
    t[0, 0] = 3
    assert t.sum().item() == 8


def test_small_tensors_and_refused_advice_stay_on_ordinary_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    small, advised = host_pages.zeros((4, 8), torch.float32)
    assert not advised and small.shape == (4, 8) and not small.any()
    assert host_pages.zeros(BIG, torch.float32, huge_pages=False)[1] is False
    elsewhere, advised = host_pages.zeros(BIG, torch.float32, "meta")     # another device: torch.zeros
    assert not advised and elsewhere.device.type == "meta" and elsewhere.shape == BIG
    refuse_advice(monkeypatch)
    t, advised = host_pages.zeros(BIG, torch.float32)
    assert not advised and t.shape == BIG and not t.any()
    assert host_pages.describe(advised) == "4 KiB pages"


def thp_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled (None: no such file)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1:text.index("]")]


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(sys.platform != "linux" or thp_mode() in (None, "never"),
                    reason="transparent huge pages are off or absent on this host")
def test_the_kernel_takes_the_advice_where_huge_pages_are_on() -> None:
    t, advised = host_pages.zeros(BIG, torch.float32)
    assert advised and host_pages.describe(advised) == "2 MiB pages advised"
    assert "hg" in vm_flags(t.data_ptr())              # the mapping carries MADV_HUGEPAGE


def decode_logits(runner: ModelRunner) -> torch.Tensor:
    """Logits of every position of one prompt through the runner's paged path."""
    tokens = list(range(3, 40))
    plan = StepPlan([ScheduledSeq("x", tokens, 0, list(range(20)), True, SamplingParams(temperature=0))])
    inputs = runner.prepare_inputs(plan, all_rows=True)
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
        return runner.model.compute_logits(hidden)


def test_the_runner_computes_the_same_on_either_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    blocks = host_pages.MIN_BYTES // ModelRunner.kv_bytes_per_block(model.config, 4, "float32") + 1
    huge = ModelRunner(model, model.config, num_blocks=blocks, block_size=4, dtype="float32")
    assert huge.kv_cache.data_ptr() % host_pages.HUGE_PAGE == 0
    assert huge.paths()["kv_pool"] == host_pages.describe(huge.pool_huge_pages)
    refuse_advice(monkeypatch)
    plain = ModelRunner(model, model.config, num_blocks=blocks, block_size=4, dtype="float32")
    assert not plain.pool_huge_pages and plain.paths()["kv_pool"] == "4 KiB pages"
    assert torch.equal(decode_logits(huge), decode_logits(plain))
