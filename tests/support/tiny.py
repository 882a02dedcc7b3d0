"""A tiny random-weight Llama for unit tests, and a dense reference forward to check it against.

Usable by any test file (pytest puts tests/ on sys.path): ``from support.tiny import tiny_config, tiny_model``.
"""

from __future__ import annotations

import torch

from kvhive.config import ModelConfig
from kvhive.model.llama import LlamaModel, dense_weight


def tiny_config(**overrides: object) -> ModelConfig:
    """2 layers, hidden 64, 4 heads / 2 KV heads of 16, vocab 256 (override any field)."""
    fields: dict[str, object] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def tiny_model(config: ModelConfig | None = None, seed: int = 0, dtype: str = "float32",
               qkv_bias: bool = False, pack: bool = False, device: str = "cpu") -> LlamaModel:
    """A deterministic random-weight LlamaModel (oneDNN-packed weights when pack=True, CPU only)."""
    model = LlamaModel.random_init(config or tiny_config(), seed=seed, dtype=dtype, device=device,
                                   qkv_bias=qkv_bias)
    if pack:
        model.pack_weights()
    return model


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def dense_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] (float32) of one sequence by a plain causal forward: no cache, no paging.

    Written independently of ``LlamaModel.forward``: separate q/k/v, rotate-half RoPE computed
    from scratch, explicit repeat of KV heads, explicit masked softmax.
    """
    c = model.config
    nh, nkv, hd, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    n = len(token_ids)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
        return w * xf.to(x.dtype)

    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.arange(n).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(model.dtype)[:, None], emb.sin().to(model.dtype)[:, None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    x = model.embed_tokens[torch.tensor(token_ids)]
    for layer in model.layers:
        h = norm(x, layer.input_norm)
        qkv = h @ dense_weight(layer.qkv_proj).t()
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(n, nh, hd), k.view(n, nkv, hd), v.view(n, nkv, hd)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / hd ** 0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v.float()).to(model.dtype).reshape(n, nh * hd)
        x = x + attn @ dense_weight(layer.o_proj).t()
        h = norm(x, layer.post_attn_norm)
        gate, up = (h @ dense_weight(layer.gate_up_proj).t()).split([inter, inter], dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ dense_weight(layer.down_proj).t()
    return (norm(x, model.norm) @ dense_weight(model.lm_head).t()).float()


def dense_greedy(model: LlamaModel, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation of prompt by re-running the dense forward for every token."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(dense_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def prompt_reference(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    """log P(prompt[i] | prompt[:i]) for i >= 1, as the dense forward gives it: [P - 1, vocab]."""
    return torch.log_softmax(dense_logits(model, prompt)[:-1], dim=-1)
