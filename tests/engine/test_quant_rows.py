"""Up to how many rows steps multiply by GGUF blocks: measured per machine and cached, or fixed by
``--quantized-matmul-rows``; either way the same greedy tokens as the dense weights."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from kvhive.config import MAX_QUANT_ROWS, EngineConfig
from kvhive.core.model_files import default_model_path
from kvhive.engine import assembly
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model import quant_rows
from kvhive.model.llama import QUANT_MAX_ROWS
from kvhive.model.loader import load_model
from kvhive.model.quant import QuantMatmul
from kvhive.request import SamplingParams
from kvhive.serve_args import add_serve_args, build_engine_config


@pytest.fixture(scope="module")
def model():
    if QuantMatmul.load() is None:
        pytest.skip("no C++ compiler")
    loaded = load_model(default_model_path(), quantized_matmul=True)
    assert loaded.model.qmatmul is not None
    return loaded


def test_the_static_limit_holds_until_the_machine_is_measured(model) -> None:
    assert model.model.quant_max_rows == QUANT_MAX_ROWS[torch.float32]


def test_calibration_measures_once_then_reads_the_cache(model, tmp_path, monkeypatch) -> None:
    m = model.model
    limit = quant_rows.calibrate(m, cache_dir=str(tmp_path))
    try:
        assert limit == 0 or limit in quant_rows.CANDIDATES[torch.float32]
        assert m.quant_max_rows == limit
        [cached] = [p for p in os.listdir(tmp_path) if p.startswith("kvhive-quant-rows-")]
        assert json.loads((tmp_path / cached).read_text())["max_rows"] == limit

        def no_measuring(*_a, **_k):
            raise AssertionError("measured again although the limit was cached")

        monkeypatch.setattr(quant_rows, "measure", no_measuring)
        m.quant_max_rows = -1
        assert quant_rows.calibrate(m, cache_dir=str(tmp_path)) == limit == m.quant_max_rows

        # A damaged cache file is a miss: measured again (here: a fixed answer), rewritten.
        (tmp_path / cached).write_text("{not json")
        monkeypatch.setattr(quant_rows, "measure", lambda _m: 24)
        assert quant_rows.calibrate(m, cache_dir=str(tmp_path)) == 24 == m.quant_max_rows
        assert json.loads((tmp_path / cached).read_text())["max_rows"] == 24
    finally:
        m.quant_max_rows = QUANT_MAX_ROWS[torch.float32]


def test_the_limit_is_the_last_row_count_where_the_blocks_win(model, monkeypatch) -> None:
    timings = {8: (1.0, 2.0), 16: (2.0, 2.5), 24: (3.0, 2.9), 32: (1.0, 9.0)}   # blocks lose at 24
    monkeypatch.setattr(quant_rows, "time_projections", lambda _m, rows, _r: timings[rows])
    assert quant_rows.measure(model.model) == 16
    monkeypatch.setattr(quant_rows, "time_projections", lambda _m, rows, _r: (5.0, 1.0))
    assert quant_rows.measure(model.model) == 0


def test_real_timings_of_both_paths(model) -> None:
    blocks_ms, dense_ms = quant_rows.time_projections(model.model, 8, 1)
    assert 0 < blocks_ms < 60_000 and 0 < dense_ms < 60_000


@pytest.mark.parametrize("limit", [0, 16, 64])
def test_any_limit_gives_the_dense_tokens(model, limit) -> None:
    """A 40-token prompt and its decodes: through the blocks wherever the limit lets them, and the
    same greedy tokens as with the blocks off."""
    m = model.model
    calls = {"n": 0}
    kernel = m.qmatmul

    def counting(*a, **k):
        calls["n"] += 1
        return kernel(*a, **k)

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 411, 1789, 28, 2, 198, 1] * 2
    prompt += [30, 31, 32, 33, 34, 35]
    outputs = []
    try:
        for rows, qmatmul in ((limit, counting), (0, None)):
            m.quant_max_rows, m.qmatmul = rows, qmatmul
            runner = ModelRunner(m, model.config, num_blocks=8, block_size=16)
            greedy, table = SamplingParams(temperature=0), list(range(8))
            calls["n"] = 0
            result = runner.execute(StepPlan([ScheduledSeq("r", list(prompt), 0, table, True, greedy)]))
            tokens = [*prompt, result.sampled["r"]]
            prefill_calls = calls["n"]
            for _ in range(12):
                seq = ScheduledSeq("r", tokens[-1:], len(tokens) - 1, table, True, greedy)
                tokens.append(runner.execute(StepPlan([seq])).sampled["r"])
            outputs.append(tokens[len(prompt):])
            if qmatmul is counting:
                # the layers' 120 projections; the LM head of the sampled row adds one call
                assert (prefill_calls > 1) == (len(prompt) <= limit), (limit, prefill_calls)
                assert (calls["n"] > prefill_calls) == (limit >= 1)
    finally:
        m.qmatmul, m.quant_max_rows = kernel, QUANT_MAX_ROWS[torch.float32]
    assert outputs[0] == outputs[1]


def test_the_cli_option() -> None:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert build_engine_config(p.parse_args([])).quantized_matmul_rows is None
    assert build_engine_config(p.parse_args(["--quantized-matmul-rows", "auto"])).quantized_matmul_rows is None
    assert build_engine_config(p.parse_args(["--quantized-matmul-rows", "32"])).quantized_matmul_rows == 32
    assert build_engine_config(p.parse_args(["--quantized-matmul-rows", "0"])).quantized_matmul_rows == 0
    for bad in ("-1", str(MAX_QUANT_ROWS + 1), "lots", "1e3"):
        with pytest.raises(SystemExit):
            p.parse_args(["--quantized-matmul-rows", bad])
    with pytest.raises(ValueError, match="quantized-matmul-rows"):
        EngineConfig(model_path="m", quantized_matmul_rows=-3)


def test_a_fixed_limit_reaches_the_model(model) -> None:
    m = model.model
    try:
        assembly.fix_quant_rows(EngineConfig(model_path="m", quantized_matmul_rows=40), m)
        assert m.quant_max_rows == 40
        assert "<= 40 rows" in m.paths()["quantized_matmul"]
        assembly.fix_quant_rows(EngineConfig(model_path="m"), m)      # auto: left as loaded
        assert m.quant_max_rows == 40
    finally:
        m.quant_max_rows = QUANT_MAX_ROWS[torch.float32]
