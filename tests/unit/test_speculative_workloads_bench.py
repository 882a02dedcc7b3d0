"""``bench/speculative_workloads.py``'s arithmetic (decode rates, paired ratios, output mismatches), its
server commands, its fixed prompts and its rendering of a small synthetic record; and
``bench/speculative_paired.py``'s pair figures and rendering."""

from __future__ import annotations

import json

import pytest
import quoting_prompts
import speculative_paired as sp
import speculative_workloads as sw


def _req(first: float, last: float, tokens: int = 11, digest: str = "a") -> dict:
    return {"first_s": first, "last_s": last, "tokens": tokens, "digest": digest}


def _run(rate: float, digests: tuple[str, ...] = ("a", "b"), drafts: float = 0, accepted: float = 0) -> dict:
    return {"requests": [_req(0, 1, digest=d) for d in digests], "median_request_tok_s": rate,
            "aggregate_tok_s": rate * 4, "spec": {"num_drafts": drafts, "num_draft_tokens": drafts * 5,
                                                  "num_accepted_tokens": accepted}}


def _round(**rates: float) -> dict:
    return {"configs": {c: {"status": "ran", "runs": {"doc_qa@c1": _run(r, drafts=10 if "ngram" in c or "history" in c
                                                                              else 0, accepted=20)}}
                        for c, r in rates.items()}}


def test_decode_rate_leaves_out_the_first_token() -> None:
    assert sw.decode_rate(_req(1.0, 3.0, tokens=11)) == 5.0
    assert sw.decode_rate(_req(1.0, 1.0, tokens=11)) is None and sw.decode_rate(_req(1.0, 2.0, tokens=1)) is None


def test_aggregate_counts_time_when_any_request_decodes() -> None:
    at_once = [_req(0.0, 2.0), _req(0.5, 2.5)]                     # union 0..2.5
    assert sw.aggregate_rate(at_once) == 20 / 2.5
    one_after_another = [_req(0.0, 1.0), _req(5.0, 6.0)]           # the gap between them is not decoding
    assert sw.aggregate_rate(one_after_another) == 20 / 2.0


def test_ratios_pair_rounds_and_take_the_best_vllm_config() -> None:
    rounds = [_round(kvhive_plain=100, kvhive_history=250, vllm_plain=120, vllm_ngram=200),
              _round(kvhive_plain=100, kvhive_history=150, vllm_plain=160, vllm_ngram=100)]
    summary, ratios = sw.summarise(rounds, ["doc_qa@c1"], list(sw.SPEC))
    assert summary["doc_qa@c1"]["kvhive_history"] == {"per_round": [250, 150], "median": 200}
    assert "kvhive_ngram" not in summary["doc_qa@c1"]
    r = ratios["doc_qa@c1"]
    assert r["kvhive_history_over_plain"] == {"per_round": [2.5, 1.5], "median": 2.0}
    assert r["kvhive_history_over_vllm_ngram"]["per_round"] == [1.25, 1.5]
    assert r["kvhive_history_over_vllm_best"]["per_round"] == [1.25, round(150 / 160, 3)]
    assert r["kvhive_ngram_over_plain"] is None


def test_c8_is_judged_on_the_aggregate_and_targets_follow_the_workload() -> None:
    assert sw.headline_metric("doc_qa@c1") == "median_request_tok_s"
    assert sw.headline_metric("doc_qa@c8") == "aggregate_tok_s"
    assert (sw.target("code_edit@c1"), sw.target("agent_summary@c8"), sw.target("open_chat@c1")) == (2.0, 1.3, 0.95)


def test_mismatches_compare_each_spec_config_with_its_own_servers_plain_outputs() -> None:
    rounds = [{"configs": {"kvhive_plain": {"runs": {"doc_qa@c1": _run(1, ("a", "b"))}},
                           "kvhive_history": {"runs": {"doc_qa@c1": _run(1, ("a", "x"))}},
                           "vllm_ngram": {"runs": {"doc_qa@c1": _run(1, ("z", "z"))}}}}]
    assert sw.mismatches(rounds) == {"kvhive_history": {"compared": 2, "mismatched": 1}}


def test_vllm_gets_its_speculation_and_the_tools_template_through_vllm_extra() -> None:
    cmd, env = sw.start_command("vllm_ngram", 8000, "")
    extra = env["VLLM_EXTRA"].split()                 # vllm.sh splits it on spaces: the JSON must have none
    spec = json.loads(extra[extra.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert sw.TEMPLATE in extra and "--speculative-config" not in sw.start_command("vllm_plain", 8000, "")[1]["VLLM_EXTRA"]
    kvhive, _ = sw.start_command("kvhive_history", 8000, "")
    assert json.loads(kvhive[kvhive.index("--speculative-config") + 1])["method"] == "history"
    assert "--speculative-config" not in sw.start_command("kvhive_plain", 8000, "")[0]


@pytest.mark.parametrize("workload", quoting_prompts.WORKLOADS)
def test_prompts_are_fixed_and_their_variants_differ(workload: str) -> None:
    """Every variant the paired benchmark takes (eight pairs of eight at c8, and more) is its own prompt."""
    variants = [quoting_prompts.messages(workload, i) for i in range(96)]
    assert variants[3] == quoting_prompts.messages(workload, 3)
    assert len({json.dumps(v) for v in variants}) == 96


def test_render_shows_targets_tokens_per_step_refusals_and_mismatches() -> None:
    rounds = [_round(kvhive_plain=100, kvhive_history=250, vllm_ngram=200)]
    summary, ratios = sw.summarise(rounds, ["doc_qa@c1"], ["kvhive_plain", "kvhive_history", "vllm_ngram"])
    record = {"max_tokens": 128, "c1_requests": 4, "vllm_version": "0.32.0", "llamacpp": "not built", "rounds": rounds,
              "spec": {c: sw.SPEC[c] for c in ("kvhive_plain", "kvhive_history", "vllm_ngram")},
              "refusals": {"vllm_plain": {"status": "refused", "error": "server exited with 1\nValueError: nope"}},
              "summary": summary, "ratios": ratios, "mismatches": {"kvhive_history": {"compared": 2, "mismatched": 0}}}
    text = "\n".join(sw.render("speculative_workloads.json", record))
    assert "| doc_qa | c1 | 250.0 | 100.0 | 2.50x | 2.50x | >= 2.0x | yes | 200.0 | 1.25x | yes | 1.25x |" in text
    assert "250.0 (3.00)" in text                           # 1 + 20 accepted / 10 drafted steps
    assert "`vllm_plain` refused: `ValueError: nope`" in text and "`kvhive_history` 0 of 2" in text


def test_llamacpp_serves_the_f32_gguf_with_prompt_lookup_and_gets_the_rendered_prompt() -> None:
    cmd, env = sw.start_command("llamacpp_lookup", 8001, "")
    assert cmd[:4] == ["bash", sw.LLAMACPP_SH, "serve", sw.LLAMACPP_GGUF] and cmd[4] == "8001" and env is None
    assert cmd[5:] == ["--interrupt_requests", "False", "--draft_model", "prompt-lookup-decoding",
                       "--draft_model_num_pred_tokens", "5"]
    assert sw.start_command("llamacpp_plain", 8001, "")[0][5:] == ["--interrupt_requests", "False"]
    request = sw.body("agent_summary", 0, 1, 64, "llamacpp_plain")
    assert "messages" not in request and "ignore_eos" not in request and request["logit_bias"] == sw.EOS_BIAS
    prompt = request["prompt"]
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    assert "<tool_call>" in prompt and "ERROR" in prompt     # the call and its result, as vLLM renders them


def test_the_default_configs_hold_llamacpp_only_where_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sw, "llamacpp_built", lambda: False)
    assert "not built" in sw.llamacpp_status()
    monkeypatch.setattr(sw, "llamacpp_built", lambda: True)
    assert "one request at a time" in sw.llamacpp_status()


def _pair(plain: float, spec: float, differ: int = 0, requests: int = 1, drafts: float = 0,
          accepted: float = 0) -> dict:
    return {"variants": [0, requests - 1], "requests": requests, "first": "kvhive_plain", "plain_tok_s": plain,
            "spec_tok_s": spec, "ratio": round(spec / plain, 3) if plain else None, "differ": differ,
            "spec": {"num_drafts": drafts, "num_draft_tokens": drafts * 4, "num_accepted_tokens": accepted}}


def test_paired_figures_are_the_median_and_geometric_mean_of_the_pairs() -> None:
    r = sp.summarise([_pair(100, 200, drafts=5, accepted=10), _pair(100, 100), _pair(50, 200, differ=1),
                      _pair(0, 100)])                                  # a pair without a plain reading: no ratio
    assert r["median_ratio"] == 2.0 and r["geomean_ratio"] == 2.0      # of 2, 1 and 4
    assert r["plain_median"] == 75 and r["spec_median"] == 150
    assert (r["differ"], r["compared"]) == (1, 4)
    assert r["spec_totals"] == {"num_drafts": 5, "num_draft_tokens": 20, "num_accepted_tokens": 10}


def test_paired_render_shows_each_pair_the_goal_and_tokens_per_drafted_step() -> None:
    runs = {"agent_summary@c1": sp.summarise([_pair(100, 150, drafts=10, accepted=25), _pair(100, 250)]),
            "open_chat@c8": sp.summarise([_pair(300, 290, requests=8)])}
    text = "\n".join(sp.render("speculative_paired.json", {"max_tokens": 128, "runs": runs}))
    assert "| agent_summary | c1 | 2 | 100.0 | 200.0 | 1.50, 2.50 | 2.00x | 1.94x | >= 2.0x | yes | 3.50 | 0 of 2 |" in text
    assert "| open_chat | c8 | 1 | 300.0 | 290.0 | 0.97 | 0.97x | 0.97x | >= 0.95x | yes | - | 0 of 8 |" in text
