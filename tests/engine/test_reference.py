"""kvhive against Hugging Face transformers on the default model (SmolLM2-135M-Instruct GGUF), float32.

transformers dequantises the same GGUF (its own loader, ``load_gguf_checkpoint``, which is what
``from_pretrained(gguf_file=...)`` runs, without needing ``accelerate``) and generates greedily one
prompt at a time. kvhive runs all prompts through ``ModelRunner`` in one continuous batch: prompts
join at different steps, long prompts are prefilled in chunks, so steps mix prefills (some on a
cached prefix) and decodes. Both sides ignore EOS and generate 32 tokens; the greedy tokens must
be equal (a step where transformers' own top-2 logits are within float32 noise may flip, once).
kvhive runs once per CPU kernel ISA level the host supports (the best one, AVX2, portable), so every
path a CPU of another kind would take is checked on whatever host runs the suite.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvhive.core.model_files import default_model_path
from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model import cpu
from kvhive.model.loader import LoadedModel, load_model
from kvhive.request import SamplingParams

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
BLOCK_SIZE = 16
CHUNK = 512                 # prefill chunk per sequence per step (long prompts take several steps)
# A top-2 logit gap this small in transformers' own scores is a tie that float32 rounding may flip.
TIE_GAP = 2e-3


def _inventory(n: int, seed: int) -> str:
    rng = random.Random(seed)
    adjectives = ["red", "old", "small", "heavy", "shiny", "wooden", "broken", "rare", "plain", "green"]
    nouns = ["lamp", "chair", "kettle", "clock", "violin", "map", "bicycle", "teapot", "mirror", "radio"]
    cities = ["Paris", "Lyon", "Oslo", "Lima", "Cairo", "Quito", "Turin", "Perth", "Hanoi", "Porto"]
    return " ".join(f"Item {i}: a {rng.choice(adjectives)} {rng.choice(nouns)} from {rng.choice(cities)} "
                    f"that costs {rng.randrange(5, 999)} coins." for i in range(n))


CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Name three prime numbers."},
     {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "Now three more, larger than ten."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue, for a child."}],
    *([{"role": "user", "content": f"Here is an inventory. {_inventory(n, n)} Which item is the most "
                                   "expensive, and where is it from?"}] for n in (8, 18, 32, 52, 78)),
]


@pytest.fixture(scope="module")
def reference() -> tuple[torch.nn.Module, list[list[int]]]:
    """transformers' model dequantised from the default GGUF, and the prompts' token ids."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    directory, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config.eos_token_id = None          # generate past EOS, as kvhive's loop does
    prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"])
               for c in CONVERSATIONS]
    return model.eval(), prompts


@pytest.fixture(scope="module")
def kvhive_gguf() -> LoadedModel:
    return load_model(default_model_path(), dtype="float32")


@pytest.fixture(scope="module")
def hf_greedy(reference, kvhive_gguf: LoadedModel) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy tokens and scores per prompt (computed once for every ISA level)."""
    hf_model, prompts = reference
    return [_hf_greedy(hf_model, p, pad=kvhive_gguf.config.eos_token_ids[0]) for p in prompts]


# The best level, and each lower one a CPU of another kind would run (x86 hosts: avx2, portable).
ISA_LEVELS = list(dict.fromkeys([cpu.detect().best] + [lvl for lvl in ("avx2", "portable")
                                                       if cpu.detect().supports(lvl)]))


def _hf_greedy(model: torch.nn.Module, prompt: list[int], pad: int) -> tuple[list[int], list[torch.Tensor]]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.scores]


def _kvhive_greedy(loaded: LoadedModel, prompts: list[list[int]], isa: str | None = None) -> list[list[int]]:
    """All prompts in one continuous batch: prompt i joins at step i // 3, prefills in CHUNK pieces."""
    c = loaded.config
    total = sum(len(p) + NEW_TOKENS for p in prompts)
    num_blocks = total // BLOCK_SIZE + 2 * len(prompts)
    runner = ModelRunner(loaded.model, c, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype="float32", isa=isa)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)                       # non-contiguous block tables
    tables: list[list[int]] = [[] for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    step = 0
    while any(len(o) < NEW_TOKENS for o in outputs):
        seqs = []
        for i, p in enumerate(prompts):
            if step < i // 3 or len(outputs[i]) >= NEW_TOKENS:
                continue
            known = p + outputs[i]
            tokens = known[computed[i]:computed[i] + CHUNK]
            end = computed[i] + len(tokens)
            while len(tables[i]) * BLOCK_SIZE < end:
                tables[i].append(free.pop())
            seqs.append(ScheduledSeq(str(i), tokens, computed[i], list(tables[i]), end == len(known), greedy))
        result = runner.execute(StepPlan(seqs))
        for s in seqs:
            i = int(s.request_id)
            computed[i] += s.num_new_tokens
            if s.sample:
                outputs[i].append(result.sampled[s.request_id])
        step += 1
    return outputs


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_greedy_tokens_equal_transformers(reference, hf_greedy, kvhive_gguf: LoadedModel, isa: str) -> None:
    _, prompts = reference
    lengths = [len(p) for p in prompts]
    assert lengths[0] < 40 and 1200 < lengths[-1] < 1700, lengths
    loaded = kvhive_gguf if isa == cpu.detect().best else load_model(default_model_path(), dtype="float32", isa=isa)
    paths = {**loaded.model.paths(), **ModelRunner(loaded.model, loaded.config, 2, BLOCK_SIZE, isa=isa).paths()}
    assert all(isa in paths[op] for op in ("quantized_matmul", "elementwise", "decode_attention")), paths
    ours = _kvhive_greedy(loaded, prompts, isa)
    ties = []
    for i, prompt in enumerate(prompts):
        theirs, scores = hf_greedy[i]
        mine = ours[i]
        assert len(theirs) == len(mine) == NEW_TOKENS
        for j, (a, b) in enumerate(zip(theirs, mine, strict=True)):
            if a != b:
                gap = float(scores[j][a] - scores[j][b])
                assert gap < TIE_GAP, f"prompt {i} ({len(prompt)} tokens) step {j}: {theirs} != {mine}"
                ties.append((i, j, gap))
                break
        else:
            assert theirs == mine, f"prompt {i} ({len(prompt)} tokens): {theirs} != {mine}"
    assert len(ties) <= 2, ties


def test_hf_directory_gives_the_gguf_logits(reference, kvhive_gguf: LoadedModel, tmp_path) -> None:
    """transformers' dequantised model saved as an HF directory loads to the same kvhive model."""
    hf_model, prompts = reference
    hf_model.save_pretrained(tmp_path)
    from_dir = load_model(tmp_path, dtype="float32")
    assert from_dir.config == kvhive_gguf.config
    assert from_dir.fingerprint != kvhive_gguf.fingerprint
    logits = []
    for loaded in (kvhive_gguf, from_dir):
        runner = ModelRunner(loaded.model, loaded.config, num_blocks=8, block_size=BLOCK_SIZE)
        prompt = prompts[4]
        plan = StepPlan([ScheduledSeq("x", prompt, 0, list(range(8)), True, SamplingParams(temperature=0))])
        inputs = runner.prepare_inputs(plan, all_rows=True)
        with torch.inference_mode():
            hidden = loaded.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
            logits.append(loaded.model.compute_logits(hidden[-4:]))
    # The GGUF model runs these 4 rows' LM head from its Q8_0 blocks (kvhive.model.quant): the
    # same weight values as the directory's, summed in another order.
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
