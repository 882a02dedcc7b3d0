"""``bench/kv_quant_agreement.py``: its comparison arithmetic, its fixed prompts, and a --smoke run."""

from __future__ import annotations

import json
import subprocess
import sys

from kv_quant_agreement import build_prompts, compare
from support.servers import REPO_ROOT, subprocess_env


def test_compare_counts_matches_leading_tokens_and_logprob_differences() -> None:
    reference = [([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([5, 6, 7, 8], [-1.0, -1.0, -1.0, -1.0])]
    ours = [([1, 2, 3, 4], [-0.1, -0.3, -0.3, -0.4]), ([5, 6, 9, 8], [-1.5, -1.0, -2.0, -1.0])]
    rate, leading, diff, positions = compare(reference, ours)
    assert rate == 0.5 and leading == 6 / 8 and positions == 6
    assert abs(diff - (0.1 + 0.5) / 6) < 1e-12          # the divergent position and after are left out


def test_prompts_are_fixed_and_within_their_lengths(tokenizer) -> None:
    prompts = build_prompts(tokenizer, 20, seed=0, lengths=(20, 400))
    assert prompts == build_prompts(tokenizer, 20, seed=0, lengths=(20, 400))
    assert all(20 <= len(p) <= 400 for p in prompts) and len({len(p) for p in prompts}) > 10


def test_smoke_run_writes_every_dtype_pair(tmp_path) -> None:
    out = tmp_path / "agreement.json"
    done = subprocess.run([sys.executable, "bench/kv_quant_agreement.py", "--smoke", "--dtypes", "float32",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["dtype"], r["kv_cache_dtype"]) for r in results] == [("float32", "int8"), ("float32", "fp8")]
    for r in results:
        assert 0 <= r["greedy_match_rate"] <= r["leading_token_fraction"] <= 1 and r["prompts"] == 4
        assert r["mean_abs_logprob_diff"] >= 0
    assert "int8" in done.stdout and "fp8" in done.stdout
