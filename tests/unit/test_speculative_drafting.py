"""Speculative decoding's parts without a model: the n-gram index against a brute-force search, the
adaptive draft length, ``--speculative-config`` parsing and its exit 2, strict acceptance of drafts
(token for token what plain sampling draws with the same generator, and its distribution), the KV
manager's trim of rejected drafts' blocks, and a whole scheduler whose fake model verifies drafts."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from support import scheduler_parts
from support.engines import make_engine
from support.scheduler_parts import FakeRunner, compute, make_kv, make_request, step

from kvhive.cli import parse_args, serve
from kvhive.config import CacheConfig, SchedulerConfig
from kvhive.core.blocks import root_hash
from kvhive.core.speculative_config import SpeculativeConfig, parse_speculative_config
from kvhive.engine.logits_processors import LogitsProcessors
from kvhive.engine.scheduler import Scheduler
from kvhive.engine.scheduler.batching import StepBudget
from kvhive.engine.speculative.draft_length import FIRST_WAIT, DraftLength
from kvhive.engine.speculative.draft_proposals import DraftProposer, can_speculate
from kvhive.engine.speculative.draft_verification import accept_drafts, sample_row_layout
from kvhive.engine.speculative.ngram_index import NgramIndex
from kvhive.engine.step import ScheduledSeq, StepPlan, StepResult, TokenHistory
from kvhive.request import FinishReason, Request, SamplingParams

# ------------------------------------------------------------------ the n-gram index


def brute_force_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest suffix, found by scanning."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n:]
        starts = [s for s in range(0, end - n) if tokens[s:s + n] == suffix]
        if starts:
            follow = max(starts) + n
            return tokens[follow:follow + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_the_index_proposes_what_a_rescan_finds_at_every_length(seed: int) -> None:
    rng = random.Random(seed)
    min_n, max_n, k = rng.choice([(1, 1), (1, 3), (2, 4), (3, 5)]) + (rng.randint(1, 6),)
    vocab = rng.choice([2, 3, 5])
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
    index = NgramIndex(min_n, max_n, tokens)
    for _ in range(60):
        assert index.propose(k) == brute_force_proposal(tokens, min_n, max_n, k)
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        tokens += new
        index.extend(new)
    assert index.tokens == tokens


def test_the_index_prefers_the_longest_suffix_and_its_latest_occurrence() -> None:
    # "1 2" occurred twice (followed by 7, then 8); "0 1 2" once, followed by 9: the longer wins.
    index = NgramIndex(2, 3, [0, 1, 2, 9, 5, 1, 2, 7, 6, 1, 2, 8, 0, 1, 2])
    assert index.propose(2) == [9, 5]
    index = NgramIndex(2, 2, [1, 2, 7, 6, 1, 2, 8, 4, 1, 2])
    assert index.propose(3) == [8, 4, 1]
    assert NgramIndex(2, 3, [1, 2, 3, 4]).propose(4) == []
    assert NgramIndex(1, 2, [5, 5]).propose(0) == []
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


# ------------------------------------------------------------------ adaptive draft length


def test_a_request_that_never_accepts_stops_drafting_and_probes_rarely() -> None:
    length = DraftLength(4)
    proposed = []
    for _ in range(500):
        n = length.next_length()
        proposed.append(n)
        if n:
            length.record(n, 0)
    assert proposed[0] == 4 and proposed[1] < 4
    first_zero = proposed.index(0)
    assert first_zero <= 6
    # After it stops: one-token probes, each followed by a longer wait.
    probes = [i for i, n in enumerate(proposed) if n and i > first_zero]
    assert all(proposed[i] == 1 for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[0] > FIRST_WAIT and len(probes) <= 7
    assert sum(proposed) <= 4 + 3 + 2 + 2 + 1 + len(probes)


def test_the_length_grows_back_when_drafts_are_accepted() -> None:
    length = DraftLength(6)
    while length.next_length():
        length.record(1, 0)
    lengths = []
    for _ in range(40):
        n = length.next_length()
        lengths.append(n)
        if n:
            length.record(n, n)
    assert lengths[-1] == 6 and 0 in lengths


def test_the_proposer_counts_drafts_and_skips_requests_it_cannot_verify() -> None:
    proposer = DraftProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2))
    quoting = make_request("q", [1, 2, 3, 4, 1, 2], max_tokens=20)
    assert proposer.propose(quoting, 3) == [3, 4, 1]
    assert proposer.propose(quoting, 2) == [3, 4]
    proposer.record("q", 3, 2)
    assert proposer.stats().num_draft_tokens == 3 and proposer.stats().num_accepted_tokens == 2
    proposer.record("q", 3, 3)
    proposer.record("q", 1, 0)
    proposer.record("q", 2, 1)
    assert proposer.stats().num_accepted_tokens_per_pos == (3, 2, 1)    # per position of a draft
    assert sum(proposer.stats().num_accepted_tokens_per_pos) == proposer.stats().num_accepted_tokens
    refused = make_request("x", [1, 2, 3, 4, 1, 2], max_tokens=20, prompt_logprobs=1)
    assert not can_speculate(refused) and proposer.propose(refused, 3) == []
    # The decode side of a disaggregated transfer drafts like any request in decode.
    assert proposer.propose(Request("t", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20), kv_transfer=object()), 3)
    for sampling in ({"logit_bias": ((3, 1.0),), "temperature": 0.5, "logprobs": 2}, {"repetition_penalty": 1.2},
                     {"presence_penalty": 0.5, "frequency_penalty": 0.3}, {"min_tokens": 3}):
        assert can_speculate(make_request("b", [1], **sampling))
    proposer.finish(quoting)
    assert proposer.draft_length("q") is None


# ------------------------------------------------------------------ the flag


def test_the_config_takes_vllms_keys_and_defaults() -> None:
    assert parse_speculative_config(None) is None
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = parse_speculative_config('{"num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 3, 3)
    config = parse_speculative_config('{"num_speculative_tokens": 2, "prompt_lookup_min": 2}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    assert config.disable_by_batch_size is None
    assert parse_speculative_config('{"num_speculative_tokens": 2, "disable_by_batch_size": 4}').disable_by_batch_size == 4


@pytest.mark.parametrize(("text", "named"), [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "unknown method 'eagle'"),
    ('{"num_speculative_tokens": 3, "model": "x", "draft": 1}', "unknown keys 'draft', 'model'"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in 1..16"),
    ('{"num_speculative_tokens": 17}', "num_speculative_tokens must be an integer in 1..16"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "is above"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_max": 40}', "prompt_lookup_max must be"),
    ('{"num_speculative_tokens": 2, "draft_sizing": "batch"}', "draft_sizing must be one of step_cost, per_request"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size must be an integer in 1..65536"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": 4.5}', "disable_by_batch_size must be an integer"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": null}', "disable_by_batch_size must be an integer"),
    ('[1]', "must be a JSON object"),
    ('{', "not valid JSON"),
])
def test_a_bad_config_exits_2_naming_the_flag_and_field(text: str, named: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--speculative-config"):
        parse_speculative_config(text)
    assert serve(parse_args(["serve", "--speculative-config", text])) == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and named in err


# ------------------------------------------------------------------ strict acceptance


def plain_draws(logits: torch.Tensor, sampling: SamplingParams, seed: int, drafts: list[int]) -> list[int]:
    """What plain decoding samples, one row at a time with the request's generator, given the drafts
    as the tokens before each row (it stops where its token differs from the draft)."""
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for j in range(len(drafts) + 1):
        probs = torch.softmax(logits[j] / sampling.temperature, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=generator)))
        if j == len(drafts) or out[-1] != drafts[j]:
            break
    return out


def test_sampled_acceptance_draws_what_plain_sampling_draws_and_keeps_its_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5) * 1.5
    logits[0, 1] += 2.0                    # the first draft is likely, the second less so
    drafts, sampling = [1, 3], SamplingParams(temperature=0.9, seed=0)
    firsts, seconds, num_seeds = torch.zeros(5), torch.zeros(5), 3000
    for seed in range(num_seeds):
        emitted = accept_drafts(logits, drafts, sampling, torch.Generator().manual_seed(seed))
        assert list(emitted) == plain_draws(logits, sampling, seed, drafts)
        firsts[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            seconds[emitted[1]] += 1
    for counts, row in ((firsts, 0), (seconds, 1)):
        p = torch.softmax(logits[row] / sampling.temperature, dim=-1)
        n = counts.sum()
        sigma = torch.sqrt(n * p * (1 - p))
        assert bool(((counts - n * p).abs() <= 4 * sigma + 1).all()), (counts, n * p)


def test_greedy_acceptance_stops_at_the_first_mismatch_with_the_targets_token() -> None:
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 4, 5, 1]):
        logits[row, best] = 3.0
    greedy = SamplingParams(temperature=0)
    assert accept_drafts(logits, [2, 4, 5], greedy, None) == (2, 4, 5, 1)
    assert accept_drafts(logits, [2, 0, 5], greedy, None) == (2, 4)
    assert accept_drafts(logits, [3, 4, 5], greedy, None) == (2,)


def test_the_sample_rows_of_a_step_place_each_drafted_seq_after_the_plain_ones_before_it() -> None:
    def seq(rid: str, drafts: tuple[int, ...]) -> ScheduledSeq:
        return ScheduledSeq(rid, [1] * (1 + len(drafts)), 5, [1, 2], True, SamplingParams(), draft_token_ids=drafts)
    layout = sample_row_layout([seq("a", ()), seq("b", (4, 5)), seq("c", ()), seq("d", (7,))])
    assert layout.plain_rows == [0, 4]
    assert [(s.request_id, row) for s, row in layout.drafted] == [("b", 1), ("d", 5)]


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=20, repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.4),
    SamplingParams(max_tokens=20, min_tokens=3, temperature=0.8, logit_bias=((2, 1.5),), min_p=0.05),
    SamplingParams(max_tokens=20, min_tokens=2, repetition_penalty=1.3),
])
def test_each_drafted_row_is_processed_as_a_plain_step_after_the_drafts_before_it(sampling: SamplingParams) -> None:
    vocab, prompt, output, drafts = 12, (1, 2, 3), (4, 4), (4, 5, 6, 5)
    logits = torch.randn(len(drafts) + 1, vocab, generator=torch.Generator().manual_seed(1))
    suppress = (0, 7)                                  # EOS and a stop token while min_tokens is not met
    history = TokenHistory(0, prompt + output, len(prompt))
    seq = ScheduledSeq("r", [output[-1], *drafts], 4, [1, 2], True, sampling, num_output_tokens=len(output),
                       history=history, draft_token_ids=drafts,
                       suppress_token_ids=suppress if len(output) < sampling.min_tokens else ())
    drafted = LogitsProcessors(torch.device("cpu")).apply_drafted(logits, seq)
    for j in range(len(drafts) + 1):
        plain = LogitsProcessors(torch.device("cpu"))
        emitted = output + drafts[:j]
        row = replace(seq, token_ids=[emitted[-1]], draft_token_ids=(), num_output_tokens=len(emitted),
                      history=TokenHistory(0, prompt + emitted, len(prompt)),
                      suppress_token_ids=suppress if len(emitted) < sampling.min_tokens else ())
        assert torch.equal(drafted[j], plain.apply(logits[j:j + 1], [row])[0]), j
    # The drafts were counted for the rows only: the request's own history is as it was.
    again = LogitsProcessors(torch.device("cpu"))
    processors = LogitsProcessors(torch.device("cpu"))
    processors.apply_drafted(logits, seq)
    assert torch.equal(processors.apply(logits[:1], [replace(seq, history=None, draft_token_ids=())]),
                       again.apply(logits[:1], [replace(seq, draft_token_ids=())]))


# ------------------------------------------------------------------ rollback


def test_trimming_frees_the_blocks_only_rejected_drafts_used() -> None:
    kv = make_kv(num_blocks=16)
    request = make_request("r", range(6))
    assert kv.allocate_slots(request, 6 + 5)        # the prompt, then 5 more positions (3 blocks)
    free = kv.pool.num_free_blocks
    assert kv.trim_blocks(request, 7) == 1
    assert len(kv.get_block_table(request)) == 2 and kv.pool.num_free_blocks == free + 1
    assert kv.trim_blocks(request, 8) == 0
    kv.pool.check_integrity()


# ------------------------------------------------------------------ a whole scheduler


PERIOD = 5


def copying_model(context: list[int]) -> int:
    """A fake model that mostly repeats what it said PERIOD tokens ago (drafts accepted), but not at
    every seventh position (drafts rejected mid-way)."""
    n = len(context)
    if n % 7 == 0 or n < PERIOD:
        return sum((i + 1) * t for i, t in enumerate(context)) % 97
    return context[n - PERIOD]


class VerifyingRunner(FakeRunner):
    """The fake runner on ``copying_model``, scoring every row of a drafted seq and accepting its
    drafts greedily."""

    def __init__(self, sched: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(sched)
        monkeypatch.setattr(scheduler_parts, "next_token", copying_model)     # the plain seqs' model

    def execute(self, plan: StepPlan) -> StepResult:
        plain = StepPlan([s for s in plan.seqs if not s.draft_token_ids], block_copies=plan.block_copies)
        result = super().execute(plain)
        sampled, accepted = dict(result.sampled), {}
        for seq in plan.seqs:
            if not seq.draft_token_ids:
                continue
            context = [self.slots[self.slot(seq.block_table, p)][0] for p in range(seq.start_pos)]
            emitted = []
            for i, tok in enumerate(seq.token_ids):
                p = seq.start_pos + i
                assert self.pool.blocks[seq.block_table[p // self.B]].block_hash is None
                self.slots[self.slot(seq.block_table, p)] = (tok, p)
                context.append(tok)
                emitted.append(copying_model(context))
                if i == len(seq.draft_token_ids) or emitted[-1] != seq.draft_token_ids[i]:
                    break
            sampled[seq.request_id] = emitted[-1]
            if len(emitted) > 1:
                accepted[seq.request_id] = tuple(emitted[:-1])
        return StepResult(sampled, accepted_drafts=accepted)


def reference_tokens(prompt: list[int], max_tokens: int, eos: tuple[int, ...]) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(copying_model(tokens))
        tokens.append(out[-1])
        if out[-1] in eos:
            break
    return out


def speculative_scheduler(k: int, num_blocks: int = 64, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=10_000),
                     CacheConfig(block_size=4, enable_prefix_caching=True), num_blocks, root_hash(0),
                     speculative=SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1,
                                                   prompt_lookup_max=3, draft_sizing="per_request"))


@pytest.mark.parametrize("seed", range(6))
def test_drafted_steps_emit_the_plain_tokens_and_cache_only_accepted_blocks(seed: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    # Seeds 4 and 5: 9 usable blocks for 4 requests of up to 29 tokens: preemptions.
    small = seed >= 4
    sched = speculative_scheduler(k=rng.choice([2, 4, 7]), budget=rng.choice([6, 64]), num_blocks=10 if small else 64)
    runner = VerifyingRunner(sched, monkeypatch)
    requests = {}
    for i in range(4):
        prompt = [rng.randrange(1, 20) for _ in range(rng.randint(3, 9))]
        eos = (rng.randrange(1, 20),) if i % 2 else ()
        requests[f"r{i}"] = (prompt, rng.randint(10, 20) if small else rng.randint(5, 40), eos)
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=requests[f"r{i}"][1]),
                                  eos_token_ids=eos))
    emitted: dict[str, list[int]] = {rid: [] for rid in requests}
    drafted_steps = 0
    for _ in range(500):
        if not sched.has_unfinished():
            break
        plan, touched = step(sched, runner)
        drafted_steps += sum(1 for s in plan.seqs if s.draft_token_ids)
        for s in plan.seqs:
            assert len(s.token_ids) == 1 + len(s.draft_token_ids) or not s.draft_token_ids
        for request in touched:
            emitted[request.request_id] = request.output_token_ids
    assert drafted_steps > 0 and sched.spec_decode_stats().num_accepted_tokens > 0
    assert (sched.num_preemptions > 0) == small
    for rid, (prompt, max_tokens, eos) in requests.items():
        assert emitted[rid] == reference_tokens(prompt, max_tokens, eos), rid
    # Every cached block holds the tokens it is hashed with (the runner checks no cached block is written).
    for block in sched.kv.pool.blocks:
        if block.block_hash is not None and block.token_ids is not None:
            assert [runner.slots[block.block_id * 4 + i][0] for i in range(4)] == list(block.token_ids)


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = speculative_scheduler(k=6)
    runner = VerifyingRunner(sched, monkeypatch)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = reference_tokens(prompt, 40, ())
    stop = plain[12]
    expected = reference_tokens(prompt, 40, (stop,))
    sched.add_request(Request("r", prompt, SamplingParams(max_tokens=40, stop_token_ids=(stop,))))
    out: list[Request] = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out += step(sched, runner)[1]
    assert out[-1].output_token_ids == expected and out[-1].finish_reason is FinishReason.STOP


def test_drafts_short_of_free_blocks_fall_back_to_a_plain_step() -> None:
    sched = speculative_scheduler(k=4, num_blocks=4)            # 3 usable blocks of 4 tokens
    quoting = make_request("q", [1, 2, 3, 1, 2, 3, 1], max_tokens=20)
    compute(sched.kv, quoting)                                  # 7 tokens in 2 blocks
    quoting.append_output_token(2)                              # position 7 still fits in them
    compute(sched.kv, make_request("hog", [9, 9, 9]))           # the last free block
    table = list(sched.kv.get_block_table(quoting))
    assert sched.speculation.proposer.propose(quoting, 4)        # it has a draft ...
    budget = StepBudget(64)
    assert not sched.speculation.plan(quoting, budget)           # ... but no block for it
    assert sched.kv.get_block_table(quoting) == table and not budget.planned and not sched.speculation.planned
    sched.kv.pool.check_integrity()


def test_grammar_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(tokenizer) -> None:
    from kvhive.core.structured_spec import StructuredSpec
    from kvhive.engine.constrained import GrammarRows
    from kvhive.structured import GrammarCompiler

    vocab = 49152
    rows = GrammarRows(GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids), vocab, overlap=False)
    spec = StructuredSpec("choice", choices=("The quick brown fox", "no"))
    seq = ScheduledSeq("r", [1], 5, [1, 2], True, SamplingParams(structured=spec))
    matcher = rows.matcher_for(seq, {})
    words = tokenizer.encode("The quick brown fox")
    blocked = rows.draft_masks(matcher, tuple(words[:2]) + (tokenizer.encode(" cat")[0],))
    assert blocked.shape[0] == 3                   # rows before each admitted draft, then the refused one's
    assert not blocked[0][words[0]] and not blocked[1][words[1]] and not blocked[2][words[2]]
    assert blocked[1][words[0]] or words[0] == words[1]
    # The last draft completes the output: it is not verified (the model's own pick there is).
    assert rows.draft_masks(matcher, tuple(words)).shape[0] == len(words)
    assert matcher.accept(words[0]) and not matcher.is_complete     # it still starts at the beginning


def test_steps_that_run_more_requests_than_disable_by_batch_size_draft_nothing(tokenizer,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Three repetitive prompts of different lengths: no step drafts while all three run; once the
    shortest has finished, the other two draft (and the tokens are the plain ones)."""
    prompts = {"a": [5, 6, 7] * 4, "b": [8, 9] * 5, "c": [11, 12, 13, 14] * 3}
    max_tokens = {"a": 6, "b": 20, "c": 30}
    outputs, steps = {}, {}
    for name, limit in (("plain", None), ("limited", 2)):
        spec = None if limit is None else SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                                            prompt_lookup_max=3, draft_sizing="per_request",
                                                            disable_by_batch_size=limit)
        engine = make_engine(tokenizer, speculative=spec)
        seen = steps[name] = []            # per step: (requests it runs, draft tokens it verifies)

        def recording(plan, execute=engine.runner.execute, seen=seen):
            seen.append((len(plan.seqs), sum(len(s.draft_token_ids) for s in plan.seqs)))
            return execute(plan)

        monkeypatch.setattr(engine.runner, "execute", recording)
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens[rid], temperature=0, ignore_eos=True))
        outputs[name] = {rid: [] for rid in prompts}
        while engine.has_unfinished():
            for out in engine.step():
                outputs[name][out.request_id] += out.new_token_ids
        engine.close()
    assert outputs["limited"] == outputs["plain"]
    limited = steps["limited"]
    assert sum(1 for running, _ in limited if running == 3) >= 5          # the limit was in force a while
    assert all(drafts == 0 for running, drafts in limited if running > 2)
    assert any(drafts for running, drafts in limited if running <= 2)
