"""Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3, SmolLM) over a flat batch of tokens from many sequences.

Weights are held fused: one QKV projection and one gate+up projection per layer (concatenated at
load). ``forward`` returns the residual stream *before* the final norm; ``compute_logits`` applies the
final norm and the LM head to the few rows that are sampled, never to every prompt position.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvhive.config import ModelConfig
from kvhive.model import cpu
from kvhive.model.attention import AttnMetadata, paged_attention, write_kv
from kvhive.model.fused import FusedOps
from kvhive.model.quant import QuantMatmul, QuantWeight
from kvhive.model.rope import rope_tables

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Below this many rows the fused rms_norm kernel wins (one op); above it the composite is faster on CPU.
_FUSED_NORM_MAX_ROWS = 64
# Steps with at most this many rows multiply by GGUF's quantised blocks when the model has them
# (weight bytes dominate); above it the dense oneDNN copy wins (compute dominates). These are the
# defaults until ``kvhive.model.quant_rows`` measures the machine's own crossover (on an AMD EPYC,
# all layers' projections, blocks vs dense: float32 16 rows 25.9 vs 30.4 ms, 24 rows 41.3 vs 43.0;
# bfloat16 8 rows 14.8 vs 15.8, 12 rows 23.5 vs 18.2).
QUANT_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 8}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map "float32" / "bfloat16" / "float16" (or a torch.dtype) to a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: statistics in float32, scale in the model dtype."""
    if x.shape[0] <= _FUSED_NORM_MAX_ROWS:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm_heads_(qk: torch.Tensor, num_q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> None:
    """RMSNorm over each head of qk [T, q heads + k heads, hd] in place, q heads by ``q_weight`` and
    k heads by ``k_weight`` (statistics in float32, scale in the model dtype, as transformers)."""
    for heads, weight in ((qk[:, :num_q_heads], q_weight), (qk[:, num_q_heads:], k_weight)):
        xf = heads.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        heads.copy_(weight * xf.to(qk.dtype))


class TorchOps:
    """The element-wise steps as torch composites, where ``FusedOps`` is unavailable (CUDA, no compiler)."""

    rms_norm = staticmethod(rms_norm)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    @staticmethod
    def prepare_rope(positions: torch.Tensor, cos: torch.Tensor,
                     sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows [T, 1, hd] of a step's positions, gathered once for all layers."""
        return cos[positions].unsqueeze(1), sin_signed[positions].unsqueeze(1)

    @staticmethod
    def rope(qk: torch.Tensor, prepared: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rotate-half RoPE in place on qk [T, heads, hd]."""
        cos, sin = prepared
        torch.addcmul(qk * cos, torch.roll(qk, qk.shape[-1] // 2, -1), sin, out=qk)


def can_pack_weights(dtype: torch.dtype, device: torch.device, isa: str | None = None) -> bool:
    """True where oneDNN-packed linear weights are available: CPU float32, and bfloat16 where oneDNN
    packs bf16 on this CPU at ISA level ``isa`` (it needs AVX-512 or AVX-NE-CONVERT)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return cpu.detect().bf16_packing(cpu.resolve(isa))
    return dtype == torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight [out, in] reordered into oneDNN's blocked layout (for ``linear``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight as a plain [out, in] tensor, whether or not it was packed."""
    return weight.to_dense() if weight.is_mkldnn else weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           upcast: bool = False) -> torch.Tensor:
    """x @ weight.T + bias, through oneDNN when the weight is packed (about 2x faster on CPU decode).

    ``upcast``: multiply in float32 and round the result to x's dtype (bf16 weights on a CPU whose
    bf16 GEMM is a slow fallback: without AVX-512, torch's bf16 matmul runs at ~2 GFLOP/s).
    """
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if upcast:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, upcast: bool = False) -> torch.Tensor:
    """residual + x @ weight.T in one kernel (``upcast``: as ``linear``, the sum in float32)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, None, "add")
    if upcast:
        return torch.addmm(residual.float(), x.float(), weight.float().t()).to(x.dtype)
    return torch.addmm(residual, x, weight.t())


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer's weights (the forward pass lives in ``LlamaModel.forward``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 qkv_bias: bool) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * hd

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.input_norm = param(h)
        self.qkv_proj = param(qkv_out, h)                   # rows: q heads, k heads, v heads
        self.qkv_bias = param(qkv_out) if qkv_bias else None
        self.o_proj = param(h, config.num_heads * hd)
        self.post_attn_norm = param(h)
        self.gate_up_proj = param(2 * config.intermediate_size, h)   # rows: gate, then up
        self.down_proj = param(h, config.intermediate_size)
        # RMSNorm weights over each q and k head, applied before RoPE (Qwen3).
        self.q_norm = param(hd) if config.qk_norm else None
        self.k_norm = param(hd) if config.qk_norm else None


class LlamaModel(nn.Module):
    """Llama-family causal LM over a flat batch of tokens and a paged KV pool."""

    # forward() honours ``AttnMetadata.out_rows``: it returns those rows' hidden states alone.
    selects_output_rows = True

    def __init__(self, config: ModelConfig, dtype: str | torch.dtype = "float32",
                 device: torch.device | str = "cpu", qkv_bias: bool = False, isa: str | None = None) -> None:
        """``isa``: the CPU ISA level of the C++ kernels (``kvhive.model.cpu``; None: the CPU's best)."""
        super().__init__()
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.isa = cpu.resolve(isa) if self.device.type == "cpu" else None
        self.qkv_bias = qkv_bias
        self.packed = False         # True once pack_weights() has run
        # bf16 weights on a CPU without a fast bf16 GEMM: dense projections multiply in float32.
        self.upcast = (self.device.type == "cpu" and self.dtype == torch.bfloat16
                       and not cpu.detect().bf16_packing(self.isa))
        v, h = config.vocab_size, config.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(v, h, dtype=self.dtype, device=device),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, self.dtype, device, qkv_bias)
                                    for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(h, dtype=self.dtype, device=device), requires_grad=False)
        # GGUF blocks for few-row steps (attach_quantized): per layer qkv, o, gate_up, down; LM head.
        self.qmatmul: QuantMatmul | None = None
        self.quant_layers: list[dict[str, QuantWeight]] = []
        self.quant_lm_head: QuantWeight | None = None
        self.quant_max_rows = 0          # steps of at most this many rows use the blocks (attach_quantized)
        # Tied embeddings: lm_head is the embedding matrix itself (one tensor, not a copy).
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else nn.Parameter(
            torch.empty(v, h, dtype=self.dtype, device=device), requires_grad=False)
        cos, sin = rope_tables(config, self.dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # RMSNorm, SiLU-and-multiply and RoPE: one C++ call each on CPU, else torch composites.
        fused = (FusedOps.load(self.isa) if self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
                 and config.head_dim % 2 == 0 and config.head_dim <= 512 else None)
        self.ops: FusedOps | TorchOps = fused or TorchOps()

    @torch.inference_mode()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``...) in, fusing."""
        if self.packed:
            raise RuntimeError("load weights before pack_weights()")
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
            names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            if self.qkv_bias:
                names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
            if self.config.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        missing = [n for n in names if n not in weights]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

        def fill(dst: torch.Tensor, names: list[str]) -> None:
            # Copy parts into consecutive row ranges of a fused parameter (no temporary concat).
            row = 0
            for name in names:
                src = weights[name]
                dst[row:row + src.shape[0]].copy_(src)
                row += src.shape[0]
            if row != dst.shape[0]:
                raise ValueError(f"{names[0]}...: {row} rows, expected {dst.shape[0]}")

        fill(self.embed_tokens, ["model.embed_tokens.weight"])
        fill(self.norm, ["model.norm.weight"])
        if not self.config.tie_word_embeddings:
            fill(self.lm_head, ["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            fill(layer.input_norm, [p + "input_layernorm.weight"])
            fill(layer.post_attn_norm, [p + "post_attention_layernorm.weight"])
            fill(layer.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
            if layer.qkv_bias is not None:
                fill(layer.qkv_bias, [p + f"self_attn.{n}_proj.bias" for n in "qkv"])
            fill(layer.o_proj, [p + "self_attn.o_proj.weight"])
            if layer.q_norm is not None:
                fill(layer.q_norm, [p + "self_attn.q_norm.weight"])
                fill(layer.k_norm, [p + "self_attn.k_norm.weight"])
            fill(layer.gate_up_proj, [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")])
            fill(layer.down_proj, [p + "mlp.down_proj.weight"])

    def attach_quantized(self, weights: Mapping[str, QuantWeight]) -> bool:
        """Keep GGUF Q4_1/Q8_0 blocks (HF names) for few-row steps; False (and unused) unless every
        projection and the LM head have them and the kernel builds. Load the dense weights first:
        prefill and any step above ``quant_max_rows`` rows still use them."""
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return False
        fused = {"qkv": [f"self_attn.{n}_proj.weight" for n in "qkv"], "o": ["self_attn.o_proj.weight"],
                 "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "down": ["mlp.down_proj.weight"]}
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        layers = []
        try:
            for i in range(self.config.num_layers):
                p = f"model.layers.{i}."
                layers.append({k: QuantWeight.concat([weights[p + n] for n in names]) for k, names in fused.items()})
            lm_head = weights[head]
        except (KeyError, ValueError):       # some matrices are not quantised (or mixed kinds)
            return False
        kernel = QuantMatmul.load(self.isa)
        if kernel is None:
            return False
        self.qmatmul, self.quant_layers, self.quant_lm_head = kernel, layers, lm_head
        self.quant_max_rows = QUANT_MAX_ROWS[self.dtype]
        return True

    def pack_weights(self) -> None:
        """Reorder every projection and the LM head into oneDNN's layout; no-op where unsupported.

        Tied embeddings stay dense for the lookup and the LM head becomes a packed copy. After
        this the weights are read-only (``dense_weight`` gives a plain copy of one).
        """
        if self.packed or not can_pack_weights(self.dtype, self.device, self.isa):
            return
        with torch.inference_mode():
            for layer in self.layers:
                for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                    packed = pack_weight(getattr(layer, name))
                    setattr(layer, name, nn.Parameter(packed, requires_grad=False))
            self.lm_head = nn.Parameter(pack_weight(self.lm_head), requires_grad=False)
        self.packed = True

    def paths(self) -> dict[str, str]:
        """Which implementation each of the model's ops runs here (for the startup log and /version)."""
        dt = str(self.dtype).removeprefix("torch.")
        if self.device.type != "cpu":
            proj = f"torch {dt} on {self.device}"
        elif self.packed:
            proj = f"oneDNN packed {dt}"
        elif self.upcast:
            proj = "torch float32 on bfloat16 weights (no fast bf16 GEMM on this CPU)"
        else:
            proj = f"torch {dt}"
        limit = self.quant_max_rows
        return {
            "projections": proj,
            "quantized_matmul": (f"C++ {self.qmatmul.isa} on GGUF blocks, steps of <= {limit} rows"
                                 if self.qmatmul is not None else "off"),
            "elementwise": f"C++ {self.ops.isa}" if isinstance(self.ops, FusedOps) else "torch",
        }

    @classmethod
    def random_init(cls, config: ModelConfig, seed: int = 0, dtype: str | torch.dtype = "float32",
                    device: torch.device | str = "cpu", qkv_bias: bool = False,
                    isa: str | None = None) -> LlamaModel:
        """A model with small random weights (for tests; deterministic for a given seed)."""
        model = cls(config, dtype, device, qkv_bias, isa)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif p.dim() == 1:          # biases
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttnMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Run all layers over a flat batch [T]; write K/V into kv_cache; return hidden [T, H], or
        [k, H] of the rows ``attn_metadata.out_rows`` names (the last layer's K/V is still written
        for every row, but its attention, output projection and MLP run for those rows alone)."""
        c = self.config
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        n = input_ids.shape[0]
        qk_width = (nh + nkv) * hd
        ops = self.ops
        rope = ops.prepare_rope(positions, self.rope_cos, self.rope_sin)   # once for all layers
        x = F.embedding(input_ids, self.embed_tokens)
        hooks = attn_metadata.layer_hooks
        qmm = self.qmatmul if self._reads_blocks(n, attn_metadata.plain_rows) else None
        up = self.upcast
        out, last = attn_metadata.out_rows, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            q = self.quant_layers[i] if qmm is not None else None
            h = ops.rms_norm(x, layer.input_norm, eps)
            if q is None:
                qkv = linear(h, layer.qkv_proj, layer.qkv_bias, up)
            else:
                qkv = qmm(h, q["qkv"]) if layer.qkv_bias is None else qmm(h, q["qkv"]) + layer.qkv_bias
            # RoPE on q and k together (adjacent in qkv), written back in place.
            qk = qkv[:, :qk_width].view(n, nh + nkv, hd)
            if layer.q_norm is not None:
                norm_heads_(qk, nh, layer.q_norm, layer.k_norm, eps)
            ops.rope(qk, rope)
            kv = qkv[:, nh * hd:].view(n, 2, nkv, hd)
            if out is not None and i == last:
                attn, x = self._last_layer_rows(qk[:, :nh], kv, x, kv_cache, i, attn_metadata)
                if x.shape[0] == 0:
                    if hooks is not None:
                        hooks.save_kv_layer(i)
                    return x
            else:
                attn = paged_attention(qk[:, :nh], kv, kv_cache, i, attn_metadata)
            x = linear_add(attn, layer.o_proj, x, up) if q is None else qmm(attn, q["o"], x)
            if hooks is not None:
                hooks.save_kv_layer(i)
            h = ops.rms_norm(x, layer.post_attn_norm, eps)
            gate_up = linear(h, layer.gate_up_proj, upcast=up) if q is None else qmm(h, q["gate_up"])
            act = ops.silu_mul(gate_up)
            x = linear_add(act, layer.down_proj, x, up) if q is None else qmm(act, q["down"], x)
        return x

    @staticmethod
    def _last_layer_rows(q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         meta: AttnMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's attention output and residual for the rows of ``meta.out_rows`` alone;
        every row's K/V is written."""
        out = meta.out_rows
        if out.rows.numel() == 0:
            write_kv(kv, kv_cache, layer, meta)
            return x[:0], x[:0]
        if out.attn is not None:
            attn = paged_attention(q.index_select(0, out.rows), kv, kv_cache, layer, out.attn)
        else:
            attn = paged_attention(q, kv, kv_cache, layer, meta).index_select(0, out.rows)
        return attn, x.index_select(0, out.rows)

    def _reads_blocks(self, rows: int, plain_rows: int | None) -> bool:
        """Whether ``rows`` rows multiply by the GGUF blocks; a 16-bit model's drafted step goes by its
        ``plain_rows`` (the dense copy is rounded), so drafts never change a token's weights."""
        rounded = plain_rows is not None and self.dtype != torch.float32
        return self.qmatmul is not None and (plain_rows if rounded else rows) <= self.quant_max_rows

    def compute_logits(self, hidden_rows: torch.Tensor, plain_rows: int | None = None) -> torch.Tensor:
        """Final norm + LM head on the sampled rows only: [n, H] -> float32 [n, vocab].

        The GGUF-block and float32-compute paths keep the float32 sums (a bf16 model's logits are
        not rounded to bf16, whose 0.125 steps near 25 would tie close candidates).
        """
        h = self.ops.rms_norm(hidden_rows, self.norm, self.config.rms_norm_eps)
        if self._reads_blocks(h.shape[0], plain_rows):
            return self.qmatmul(h.float(), self.quant_lm_head)
        if self.upcast:
            return F.linear(h.float(), self.lm_head.float())
        return linear(h, self.lm_head).float()
