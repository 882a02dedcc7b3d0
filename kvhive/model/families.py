"""The model families ``LlamaModel`` runs, and how each one's checkpoints differ from Llama's.

Every family here has Llama's layer graph: pre-norm RMSNorm, rotate-half RoPE on q and k, full
causal attention with grouped KV heads, a SiLU-gated MLP. What differs is data, not graph: q/k/v
biases (Qwen2), an RMSNorm over each q and k head before RoPE (Qwen3), fused ``qkv_proj`` and
``gate_up_proj`` tensors that are split at load (Phi-3), tied embeddings, an explicit head size,
a RoPE scaling (``kvhive.model.rope``), the config.json defaults transformers assumes for a key
the file leaves out, and whether llama.cpp's GGUF converter interleaves Q/K rows.

Gemma 2 and Gemma 3 (text) differ in graph, not only data, and run in ``kvhive.model.gemma``;
their config.json keys are read by ``kvhive.model.gemma_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Family:
    """One architecture: its config.json ``model_type`` and how its checkpoints read."""

    model_type: str
    gguf_arch: str
    permuted_qk: bool = False         # llama.cpp's converter interleaves Q/K rows (Llama's rope layout)
    qk_norm: bool = False             # q_norm / k_norm weights per head (Qwen3)
    fused_projections: bool = False   # qkv_proj and gate_up_proj tensors (Phi-3)
    qkv_bias: bool = False            # q/k/v projection biases in every checkpoint (Qwen2)
    gemma: int = 0                    # Gemma 2 or 3 layer graph (kvhive.model.gemma); 0: Llama's
    # transformers' value for a config.json key the file leaves out (beyond hidden_size // heads etc.).
    defaults: Mapping[str, object] = field(default_factory=dict)


FAMILIES = {f.model_type: f for f in (
    Family("llama", "llama", permuted_qk=True, defaults={"rms_norm_eps": 1e-6}),
    Family("mistral", "llama", permuted_qk=True, defaults={"rms_norm_eps": 1e-6, "sliding_window": 4096}),
    Family("qwen2", "qwen2", qkv_bias=True, defaults={"rms_norm_eps": 1e-6, "use_sliding_window": False}),
    Family("qwen3", "qwen3", qk_norm=True,
           defaults={"rms_norm_eps": 1e-6, "head_dim": 128, "use_sliding_window": False}),
    Family("phi3", "phi3", fused_projections=True, defaults={"rms_norm_eps": 1e-5}),
    Family("gemma2", "gemma2", gemma=2, defaults={
        "rms_norm_eps": 1e-6, "head_dim": 256, "tie_word_embeddings": True, "max_position_embeddings": 8192,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "sliding_window_pattern": 2}),
    Family("gemma3_text", "gemma3", qk_norm=True, gemma=3, defaults={
        "rms_norm_eps": 1e-6, "head_dim": 256, "tie_word_embeddings": True, "max_position_embeddings": 131072,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}),
)}
# GGUF architectures: llama.cpp writes Llama and Mistral as "llama"; older files say "mistral".
GGUF_FAMILIES = {"llama": FAMILIES["llama"], "mistral": FAMILIES["mistral"], "qwen2": FAMILIES["qwen2"],
                 "qwen3": FAMILIES["qwen3"], "phi3": FAMILIES["phi3"], "gemma2": FAMILIES["gemma2"],
                 "gemma3": FAMILIES["gemma3_text"]}

# config.json keys whose non-default value changes the layer graph (refused, naming the key).
GRAPH_KEYS = {"hidden_act": "silu", "hidden_activation": "silu", "attention_bias": False, "mlp_bias": False,
              "quantization_config": None}
# Gemma's MLP gate is GELU with the tanh approximation; its attention is causal.
GEMMA_GRAPH_KEYS = {**GRAPH_KEYS, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                    "use_bidirectional_attention": False}
# config.json architectures kvhive refuses although their model_type names a family it knows of.
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower (image inputs); kvhive serves the "
                                      "text-only Gemma3ForCausalLM (model_type gemma3_text)",
}


def family_for_model_type(model_type: object, where: str) -> Family:
    """The family of a config.json ``model_type``; ValueError naming it when kvhive does not run it."""
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(sorted(FAMILIES))})")
    return family


def family_for_gguf_arch(arch: str, where: str) -> Family:
    """The family of a GGUF ``general.architecture``; ValueError naming it when kvhive does not run it."""
    family = GGUF_FAMILIES.get(arch)
    if family is None:
        raise ValueError(f"{where}: general.architecture {arch!r} is not supported "
                         f"(supported: {', '.join(sorted(GGUF_FAMILIES))})")
    return family


def check_architectures(raw: Mapping[str, object], where: str) -> None:
    """ValueError naming config.json's ``architectures`` when it lists one kvhive refuses."""
    archs = raw.get("architectures")
    for arch in archs if isinstance(archs, list) else []:
        if arch in REFUSED_ARCHITECTURES:
            raise ValueError(f"{where}: architectures {archs!r} is not supported: {REFUSED_ARCHITECTURES[arch]}")


def check_graph_keys(raw: Mapping[str, object], where: str, family: Family | None = None) -> None:
    """ValueError naming the first config.json key that asks for a layer graph kvhive does not run."""
    keys = GEMMA_GRAPH_KEYS if family is not None and family.gemma else GRAPH_KEYS
    for key, runs in keys.items():
        value = raw.get(key)
        if value is not None and value != runs:
            raise ValueError(f"{where}: {key} {value!r} is not supported (kvhive runs {runs!r})")


def split_fused(weights: dict[str, torch.Tensor], num_layers: int, q_rows: int, kv_rows: int) -> None:
    """Replace each layer's fused ``qkv_proj`` and ``gate_up_proj`` (Phi-3) by their parts, in place
    (views, no copies); a fused tensor whose rows do not split so is left for the shape check."""
    for i in range(num_layers):
        p = f"model.layers.{i}."
        qkv = weights.get(p + "self_attn.qkv_proj.weight")
        if qkv is not None and qkv.shape[0] == q_rows + 2 * kv_rows:
            del weights[p + "self_attn.qkv_proj.weight"]
            for name, part in zip("qkv", qkv.split([q_rows, kv_rows, kv_rows]), strict=True):
                weights[p + f"self_attn.{name}_proj.weight"] = part
        gate_up = weights.get(p + "mlp.gate_up_proj.weight")
        if gate_up is not None and gate_up.shape[0] % 2 == 0:
            del weights[p + "mlp.gate_up_proj.weight"]
            gate, up = gate_up.chunk(2)
            weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"] = gate, up


def fused_name(name: str) -> str:
    """The fused Phi-3 tensor a split part's name came from (the name itself for other tensors)."""
    for part in ("q_proj", "k_proj", "v_proj"):
        name = name.replace(f"self_attn.{part}", "self_attn.qkv_proj")
    return name.replace("mlp.gate_proj", "mlp.gate_up_proj").replace("mlp.up_proj", "mlp.gate_up_proj")
