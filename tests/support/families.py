"""Tiny random checkpoints of each model family, built with transformers at test time and written
as Hugging Face directories and (as llama.cpp's converter would) GGUF files.

Each family has its real configs' quirks switched on: RoPE scaling (llama3, yarn, linear,
dynamic), q/k/v biases, q/k norms, a head size that is not hidden / heads, GQA, tied or untied
embeddings, fused projections. Weights are re-drawn so that logits are far from uniform (norm
weights around 1, biases non-zero), making greedy tokens a sharp test.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil

import numpy as np
import torch

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# model_type -> (transformers config class name, config overrides)
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32, rope_parameters={
        "rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0})),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0})),
    # Windows of 8 keys under 40-token prompts in 16-token blocks; soft-capped scores and logits.
    # query_pre_attn_scalar = head_dim as llama.cpp derives it for GGUF (other values: HF only).
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Six layers in Gemma 3's pattern: five window layers (local RoPE base), one global (linear RoPE).
    "gemma3_text": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=16, sliding_window=8,
                                             query_pre_attn_scalar=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
}
# GGUF architecture llama.cpp's converter writes for each family.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3_text": "gemma3"}


def hf_config(family: str, **overrides: object):  # noqa: ANN201 - a transformers PretrainedConfig
    """The transformers config of ``family``'s tiny model (quirks on), with ``overrides``."""
    import transformers

    cls_name, extra = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})


@torch.no_grad()
def hf_model(family: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A float32 transformers model of ``family`` with deterministic random weights, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    # Gemma against transformers' eager attention (the reference its soft-capping is written in).
    eager = {"attn_implementation": "eager"} if family.startswith("gemma") else {}
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32,
                                                          **eager)
    gen = torch.Generator().manual_seed(seed)
    norm_base = 0.0 if family.startswith("gemma") else 1.0       # Gemma's norms scale by 1 + weight
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(norm_base + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    return model.eval()


def edited_hf_copy(src: str, dst: str, **changes: object) -> str:
    """A copy of HF dir ``src`` whose config.json has ``changes`` (None deletes a key)."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, "config.json")
    with open(file) as f:
        raw = json.load(f)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    with open(file, "w") as f:
        json.dump(raw, f)
    return dst


def save_hf(model: torch.nn.Module, path: str, dtype: torch.dtype = torch.float32,
            max_shard_size: str | None = None) -> str:
    """``model`` as an HF directory of ``dtype`` safetensors (sharded when ``max_shard_size``)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    copy.deepcopy(model).to(dtype).save_pretrained(path, **kwargs)
    return path


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for llama3 RoPE scaling."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _interleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (rotate-half -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GGUF_GEMMA_LAYER = {**_GGUF_LAYER, "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str, gemma: bool = False) -> str:
    """llama.cpp's name for an HF tensor name."""
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{(_GGUF_GEMMA_LAYER if gemma else _GGUF_LAYER)[rest]}"


def _add_gemma_meta(w, cfg) -> None:  # noqa: ANN001 - a gguf.GGUFWriter and a transformers config
    """What llama.cpp's converter writes for Gemma 2 / 3 beyond the common keys."""
    import gguf

    w.add_sliding_window(cfg.sliding_window)
    if cfg.model_type == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        return
    full = cfg.rope_parameters["full_attention"]
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])


def save_gguf(model: torch.nn.Module, family: str, path: str, extra_meta: dict | None = None,
              extra_tensors: dict[str, np.ndarray] | None = None) -> str:
    """``model`` as a float32 GGUF file the way llama.cpp's converter writes ``family``."""
    import gguf

    cfg, arch = model.config, GGUF_ARCH[family]
    gemma = family.startswith("gemma")
    rope = dict(cfg.rope_parameters.get("full_attention", cfg.rope_parameters))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    if gemma:
        _add_gemma_meta(w, cfg)
    elif rope["rope_type"] in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if rope["rope_type"] == "linear"
                                else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, value in (extra_meta or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_string(key, value)
    tensors = {gguf_tensor_name(n, gemma): t.detach().float().numpy().copy() for n, t in model.state_dict().items()
               if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    if gemma:                          # llama.cpp stores Gemma's norms as 1 + weight
        tensors = {n: a + np.float32(1.0) if n.endswith("norm.weight") else a for n, a in tensors.items()}
    if arch == "llama":
        for name, arr in tensors.items():
            if name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
                tensors[name] = _interleave_rows(arr, heads)
    if rope["rope_type"] == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(rope, head_dim)
    tensors.update(extra_tensors or {})
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """``n`` deterministic token ids in [3, VOCAB)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, VOCAB, size=n)]


def path_in(tmp: os.PathLike[str] | str, *parts: str) -> str:
    """A path under a test's temporary directory."""
    return os.path.join(os.fspath(tmp), *parts)
