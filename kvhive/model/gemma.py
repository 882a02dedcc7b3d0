"""Gemma 2 and Gemma 3 (text) decoders over a flat batch of tokens and the paged KV pool.

The runner sees the same model interface as ``LlamaModel`` (``forward``, ``compute_logits``,
``pack_weights``, ``paths``, ``dtype``, ``config``); the KV pool, its layout and the attention
over it are shared. What differs is the layer math: RMSNorm scaling by ``1 + weight`` in float32,
the embedding scaled by sqrt(hidden) in the model dtype, a GELU-tanh gated MLP, norms before and
after both attention and the MLP, scores scaled by ``query_pre_attn_scalar`` instead of the head
size, per-head q/k norms (Gemma 3), soft-capped scores and logits (Gemma 2), and layers that
attend to a sliding window of keys, with their own RoPE base in Gemma 3.

A layer that neither windows nor soft-caps (Gemma 3's global layers) runs the runner's attention
path (C++ kernels or SDPA) with its queries pre-scaled; any other layer runs the masked torch
path of ``kvhive.model.window_attention``, on every device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvhive.config import ModelConfig, RopeScaling
from kvhive.model.attention import AttnMetadata, paged_attention
from kvhive.model.llama import TorchOps, can_pack_weights, linear, pack_weight, resolve_dtype
from kvhive.model.rope import rope_tables
from kvhive.model.window_attention import ScoreRule, masked_paged_attention
from kvhive.model.window_kv import group_indices

# HF tensor name (under model.layers.N.) -> layer attribute, for the per-layer norms (scales 1 + w).
_LAYER_NORMS = {"input_layernorm.weight": "input_norm", "post_attention_layernorm.weight": "post_attn_norm",
                "pre_feedforward_layernorm.weight": "pre_ffw_norm",
                "post_feedforward_layernorm.weight": "post_ffw_norm"}
_HEAD_NORMS = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}


def gemma_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: statistics and the ``scale`` (float32 ``1 + weight``) in float32, one rounding."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def norm_scale(weight: torch.Tensor) -> torch.Tensor:
    """The float32 ``1 + weight`` a Hugging Face Gemma norm weight multiplies by."""
    return 1.0 + weight.float()


class GemmaLayer(nn.Module):
    """One Gemma decoder layer's weights (the forward pass lives in ``GemmaModel.forward``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim

        def param(*shape: int, kind: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=kind, device=device), requires_grad=False)

        self.qkv_proj = param((config.num_heads + 2 * config.num_kv_heads) * hd, h)   # q, k, v heads
        self.o_proj = param(h, config.num_heads * hd)
        self.gate_up_proj = param(2 * config.intermediate_size, h)                      # gate, then up
        self.down_proj = param(h, config.intermediate_size)
        for attr in _LAYER_NORMS.values():
            setattr(self, attr, param(h, kind=torch.float32))
        self.q_norm = param(hd, kind=torch.float32) if config.qk_norm else None
        self.k_norm = param(hd, kind=torch.float32) if config.qk_norm else None


class GemmaModel(nn.Module):
    """Gemma 2 / Gemma 3 causal LM with ``LlamaModel``'s interface to the runner."""

    # Decode steps run eagerly on CUDA (the masked path is not captured into the runner's graphs).
    cuda_graphs = False

    def __init__(self, config: ModelConfig, dtype: str | torch.dtype = "float32",
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        if config.gemma is None:
            raise ValueError("GemmaModel needs a config with gemma set")
        self.config, self.spec = config, config.gemma
        self.dtype, self.device = resolve_dtype(dtype), torch.device(device)
        self.packed = False
        # bf16 on a CPU without a fast bf16 GEMM multiplies in float32, as LlamaModel does.
        self.upcast = self.device.type == "cpu" and self.dtype == torch.bfloat16 and not can_pack_weights(
            self.dtype, self.device)
        v, h = config.vocab_size, config.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(v, h, dtype=self.dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(GemmaLayer(config, self.dtype, device) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(h, dtype=torch.float32, device=device), requires_grad=False)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else nn.Parameter(
            torch.empty(v, h, dtype=self.dtype, device=device), requires_grad=False)
        # transformers scales the embedding by sqrt(hidden) rounded to the model dtype.
        self.embed_scale = torch.tensor(h ** 0.5).to(self.dtype).to(device)
        self.rope = {False: rope_tables(config, self.dtype, device), True: rope_tables(self._local_rope(), self.dtype, device)}
        self.rules = [self._rule(window) for window in self.spec.window_layers]
        # Per layer, its index in its group's pool when the window layers have a pool of their own.
        self.group_index = group_indices(self.spec.window_layers)

    def _local_rope(self) -> ModelConfig:
        """The config whose RoPE the window layers use (Gemma 3: their own base, unscaled)."""
        if self.spec.local_rope_theta is None:
            return self.config
        return dataclasses.replace(self.config, rope_theta=self.spec.local_rope_theta, rope_scaling=RopeScaling())

    def _rule(self, window_layer: bool) -> ScoreRule | None:
        """A layer's masked-path rule, or None where the runner's shared attention is exact for it."""
        spec = self.spec
        window = spec.sliding_window if window_layer else None
        if window is None and spec.attn_logit_softcapping is None:
            return None
        return ScoreRule(scale=spec.query_pre_attn_scalar ** -0.5, softcap=spec.attn_logit_softcapping, window=window)

    def attention_paths(self) -> list[str]:
        """Per layer: "masked" (``window_attention``) or "shared" (the runner's kernels or SDPA)."""
        return ["shared" if rule is None else "masked" for rule in self.rules]

    @torch.inference_mode()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing QKV and gate/up; norms become float32 ``1 + w``."""
        if self.packed:
            raise RuntimeError("load weights before pack_weights()")

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint lacks tensor {name}")
            return weights[name]

        self.embed_tokens.copy_(take("model.embed_tokens.weight"))
        self.norm.copy_(norm_scale(take("model.norm.weight")))
        if not self.config.tie_word_embeddings:
            self.lm_head.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.qkv_proj.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            layer.o_proj.copy_(take(p + "self_attn.o_proj.weight"))
            layer.gate_up_proj.copy_(torch.cat([take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]))
            layer.down_proj.copy_(take(p + "mlp.down_proj.weight"))
            norms = {**_LAYER_NORMS, **(_HEAD_NORMS if layer.q_norm is not None else {})}
            for name, attr in norms.items():
                getattr(layer, attr).copy_(norm_scale(take(p + name)))

    def attach_quantized(self, weights: Mapping[str, object]) -> bool:
        """GGUF blocks are not used by this model (its projections multiply densely): always False."""
        return False

    def pack_weights(self) -> None:
        """Reorder every projection and the LM head into oneDNN's layout; no-op where unsupported."""
        if self.packed or not can_pack_weights(self.dtype, self.device):
            return
        with torch.inference_mode():
            for layer in self.layers:
                for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                    setattr(layer, name, nn.Parameter(pack_weight(getattr(layer, name)), requires_grad=False))
            self.lm_head = nn.Parameter(pack_weight(self.lm_head), requires_grad=False)
        self.packed = True

    def paths(self) -> dict[str, str]:
        """Which implementation the model's ops run here (for the startup log and /version)."""
        dt = str(self.dtype).removeprefix("torch.")
        masked = [str(i) for i, path in enumerate(self.attention_paths()) if path == "masked"]
        return {"projections": f"oneDNN packed {dt}" if self.packed else f"torch {dt} on {self.device}",
                "quantized_matmul": "off", "elementwise": "torch",
                "windowed_attention": f"masked torch, layers {','.join(masked)}" if masked else "none"}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttnMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Run all layers over a flat batch [T]; write K/V into kv_cache; return hidden [T, H]."""
        eps, up = self.config.rms_norm_eps, self.upcast
        rope = {local: TorchOps.prepare_rope(positions, *tables) for local, tables in self.rope.items()}
        x = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        hooks = attn_metadata.layer_hooks
        for i, layer in enumerate(self.layers):
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            attn = self._attention(i, layer, gemma_norm(x, layer.input_norm, eps), attn_metadata, kv_cache, rope)
            x = x + gemma_norm(linear(attn, layer.o_proj, upcast=up), layer.post_attn_norm, eps)
            if hooks is not None:
                hooks.save_kv_layer(i)
            gate, value = linear(gemma_norm(x, layer.pre_ffw_norm, eps), layer.gate_up_proj, upcast=up).chunk(2, -1)
            act = F.gelu(gate, approximate="tanh") * value
            x = x + gemma_norm(linear(act, layer.down_proj, upcast=up), layer.post_ffw_norm, eps)
        return x

    def _attention(self, i: int, layer: GemmaLayer, h: torch.Tensor, meta: AttnMetadata, kv_cache: torch.Tensor,
                   rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Layer i's attention output [T, heads * head_dim] for its normed input h."""
        c = self.config
        n, nh, nkv, hd = h.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = linear(h, layer.qkv_proj, upcast=self.upcast)
        qk = qkv[:, :(nh + nkv) * hd].view(n, nh + nkv, hd)
        if layer.q_norm is not None:
            qk[:, :nh] = gemma_norm(qk[:, :nh], layer.q_norm, c.rms_norm_eps)
            qk[:, nh:] = gemma_norm(qk[:, nh:], layer.k_norm, c.rms_norm_eps)
        TorchOps.rope(qk, rope[self.spec.window_layers[i]])
        kv_new = qkv[:, nh * hd:].view(n, 2, nkv, hd)
        rule, layer_index = self.rules[i], i
        if meta.window is not None:         # two pools: each layer indexes its own group's
            layer_index = self.group_index[i]
            if self.spec.window_layers[i]:
                win = meta.window
                return masked_paged_attention(qk[:, :nh], kv_new, win.cache, layer_index, win.meta, rule,
                                              win.decode_first_keys)
        if rule is not None:
            return masked_paged_attention(qk[:, :nh], kv_new, kv_cache, layer_index, meta, rule)
        # The shared paths scale scores by 1/sqrt(head_dim): the queries carry the difference.
        q = qk[:, :nh] * (hd ** 0.5 * self.spec.query_pre_attn_scalar ** -0.5)
        return paged_attention(q, kv_new, kv_cache, layer_index, meta)

    def compute_logits(self, hidden_rows: torch.Tensor, plain_rows: int | None = None) -> torch.Tensor:
        """Final norm, LM head and (Gemma 2) logit soft-capping on the sampled rows: float32 [n, vocab]
        (one matmul path whatever the rows, so ``plain_rows`` changes nothing here)."""
        h = gemma_norm(hidden_rows, self.norm, self.config.rms_norm_eps)
        logits = F.linear(h.float(), self.lm_head.float()) if self.upcast else linear(h, self.lm_head).float()
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

