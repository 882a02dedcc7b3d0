"""The model and its loaders on tiny checkpoints: kvhive's logits equal transformers' logits.

Each tiny checkpoint is built by transformers (Llama, Qwen2 with q/k/v biases), saved as a Hugging
Face directory (single file and sharded) or written as a GGUF the way llama.cpp's converter does
(Q/K rows permuted, one Q8_0 tensor), then loaded by ``kvhive.model.loader``.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from support.tiny import tiny_config, tiny_model

from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model.llama import LlamaModel, rope_tables
from kvhive.model.loader import LoadedModel, load_model
from kvhive.request import SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TOKENS = [random.Random(0).randrange(256) for _ in range(23)]


def hf_model(kind: str = "llama", tied: bool = True, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers model with non-trivial random weights."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tied, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=16, rope_theta=5000.0, **common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_theta=5000.0, **common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.eval()


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def kv_logits(model: LlamaModel, tokens: list[int], block_size: int = 4) -> torch.Tensor:
    """All-position logits of one sequence through the runner's paged path."""
    runner = ModelRunner(model, model.config, num_blocks=64, block_size=block_size, dtype=model.dtype)
    plan = StepPlan([ScheduledSeq("x", tokens, 0, list(range(63, 63 - 16, -1)), True,
                                  SamplingParams(temperature=0))])
    inputs = runner.prepare_inputs(plan, all_rows=True)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
        return model.compute_logits(hidden)


def test_rope_roll_form_equals_rotate_half() -> None:
    config = tiny_config()
    cos, sin_signed = rope_tables(config, torch.float32, "cpu")
    pos = torch.tensor([0, 1, 5, 9, 100, 200, 511])
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, 16, 2).float() / 16))
    emb = torch.cat([pos.float()[:, None] * inv_freq] * 2, dim=-1)
    x = torch.randn(7, 3, 16)
    rotate_half = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    expected = x * emb.cos()[:, None] + rotate_half * emb.sin()[:, None]
    got = x * cos[pos][:, None] + torch.roll(x, 8, -1) * sin_signed[pos][:, None]
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("kind,tied", [("llama", True), ("qwen2", False)])
def test_hf_weights_give_transformers_logits(kind: str, tied: bool) -> None:
    ref = hf_model(kind, tied)
    c = ref.config
    config = tiny_config(tie_word_embeddings=tied, rope_theta=5000.0, head_dim=16,
                         rms_norm_eps=c.rms_norm_eps)
    model = LlamaModel(config, qkv_bias=kind == "qwen2")
    model.load_hf_weights(ref.state_dict())
    torch.testing.assert_close(kv_logits(model, TOKENS), hf_logits(ref, TOKENS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,tied,shard", [("llama", True, False), ("qwen2", False, True)])
def test_hf_directory_loader(tmp_path, kind: str, tied: bool, shard: bool) -> None:
    ref = hf_model(kind, tied)
    ref.save_pretrained(tmp_path, max_shard_size="60KB" if shard else "1GB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == shard
    loaded = load_model(tmp_path)
    assert loaded.config.num_kv_heads == 2 and loaded.config.rope_theta == 5000.0
    assert loaded.config.tie_word_embeddings == tied and loaded.config.eos_token_ids == (2,)
    torch.testing.assert_close(kv_logits(loaded.model, TOKENS), hf_logits(ref, TOKENS), atol=1e-4, rtol=1e-4)
    assert load_model(tmp_path).fingerprint == loaded.fingerprint


def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the loader must undo it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str, ref: torch.nn.Module) -> None:
    """Write ref's weights as a llama-architecture GGUF, as llama.cpp's converter lays them out."""
    c = ref.config
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, t in ref.state_dict().items():
        arr = t.numpy().astype(np.float32)
        if name in names:
            gname = names[name]
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{layer_names[module]}.{kind}"
            if module == "self_attn.q_proj":
                arr = _permute_like_llama_cpp(arr, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                arr = _permute_like_llama_cpp(arr, c.num_key_value_heads)
        else:
            continue                                  # lm_head: tied to the embeddings
        if gname == "token_embd.weight":              # one quantised tensor, as in the real file
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loader_undoes_the_qk_permutation(tmp_path) -> None:
    ref = hf_model("llama", tied=True)
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, ref)
    loaded = load_model(path)
    assert isinstance(loaded, LoadedModel)
    assert loaded.config.eos_token_ids == (2,) and loaded.config.bos_token_id == 1
    assert loaded.config.head_dim == 16 and loaded.config.tie_word_embeddings
    # The Q8_0 embeddings are within quantisation error; use them in the reference too.
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(loaded.model.embed_tokens)
    torch.testing.assert_close(kv_logits(loaded.model, TOKENS), hf_logits(ref, TOKENS), atol=1e-4, rtol=1e-4)


def test_fingerprint_is_stable_and_distinguishes_models(tmp_path) -> None:
    write_tiny_gguf(str(tmp_path / "a.gguf"), hf_model(seed=0))
    write_tiny_gguf(str(tmp_path / "b.gguf"), hf_model(seed=1))
    a1, a2, b = (load_model(tmp_path / n).fingerprint for n in ("a.gguf", "a.gguf", "b.gguf"))
    assert a1 == a2 != b
    assert len(a1) == 16 and int(a1, 16) >= 0
    os.rename(tmp_path / "a.gguf", tmp_path / "renamed.gguf")    # a copy elsewhere shares its caches
    assert load_model(tmp_path / "renamed.gguf").fingerprint == a1


def test_bfloat16_model_is_close_to_float32() -> None:
    f32 = tiny_model(seed=3)
    bf16 = tiny_model(seed=3, dtype="bfloat16")
    torch.testing.assert_close(kv_logits(bf16, TOKENS), kv_logits(f32, TOKENS), atol=0.15, rtol=0.05)


def test_unknown_dtype_path_and_rope_scaling_are_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        LlamaModel(tiny_config(), dtype="int3")
    with pytest.raises(ValueError, match="neither"):
        load_model(tmp_path / "missing.bin")
    ref = hf_model("llama")
    ref.config.rope_parameters = {"rope_type": "longrope", "factor": 2.0, "rope_theta": 5000.0,
                                  "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                                  "original_max_position_embeddings": 64}
    ref.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        load_model(tmp_path)
