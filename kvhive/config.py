"""Configuration: frozen dataclasses, each validated once at construction.

Environment variables are read only in ``cli.py``; everything below is plain data.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from kvhive.connector.disagg.transfer_config import KVTransferConfig
from kvhive.core.host_resources import kv_memory_problem, usable_cpus, usable_memory_bytes
from kvhive.core.kv_cache_dtype import check_kv_cache_dtype, kv_row_bytes, resolve_kv_dtype
from kvhive.core.kv_events_config import KVEventsConfig
from kvhive.core.scheduler_config import SchedulerConfig
from kvhive.core.speculative_config import SpeculativeConfig

# ISA levels of the CPU kernels, best first (kvhive.model.cpu), and "auto": the best the CPU runs.
CPU_ISAS = ("auto", "avx512_bf16", "avx512", "avx2", "portable")
# --attention-backend: auto (CPU: the C++ kernels; CUDA: the Triton paged kernels), triton, torch.
ATTENTION_BACKENDS = ("auto", "triton", "torch")
# --load-format (vLLM's names): auto reads the checkpoint's weights, dummy draws random ones for its config.
LOAD_FORMATS = ("auto", "dummy")
# What ``--metrics-compat`` may name: "vllm" also exports metrics under vLLM's names (server/metrics_vllm.py).
METRICS_COMPAT = ("none", "vllm")


ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How a model scales its rotary frequencies; ``kvhive.model.rope`` turns it into cos/sin tables.

    ``kind`` is one of ``ROPE_KINDS``. ``attention_factor`` multiplies cos and sin (YaRN's mscale,
    resolved when read). ``freq_factors`` divides each inverse frequency, as a GGUF ``rope_freqs``
    tensor stores llama3 scaling; empty when the checkpoint has none.
    """

    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"model config: RoPE type {self.kind!r} is not one of {', '.join(ROPE_KINDS)}")
        if self.factor <= 0 or self.attention_factor <= 0:
            raise ValueError(f"model config: RoPE factor and attention_factor must be positive, "
                             f"got {self.factor} and {self.attention_factor}")


@dataclass(frozen=True)
class GemmaSpec:
    """What a Gemma 2 / Gemma 3 decoder adds to the Llama hyper-parameters (``kvhive.model.gemma``)."""

    query_pre_attn_scalar: float           # attention scores scale by its inverse square root
    window_layers: tuple[bool, ...]        # per layer: True where it attends to the last sliding_window keys
    sliding_window: int | None = None      # keys a window layer sees, its own included
    attn_logit_softcapping: float | None = None   # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    local_rope_theta: float | None = None  # RoPE base of the window layers, unscaled (Gemma 3); None: the model's

    def __post_init__(self) -> None:
        if any(self.window_layers) and (self.sliding_window is None or self.sliding_window <= 0):
            raise ValueError(f"model config: sliding_window must be positive, got {self.sliding_window}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"model config: {name} must be positive, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (read from GGUF metadata or config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qk_norm: bool = False                  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    gemma: GemmaSpec | None = None         # Gemma 2 / 3 layer graph (kvhive.model.gemma); None: Llama's

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.gemma is not None and len(self.gemma.window_layers) != self.num_layers:
            raise ValueError(f"model config: layer_types names {len(self.gemma.window_layers)} layers, "
                             f"num_layers is {self.num_layers}")

    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def attention_balance_context(self) -> int:
        """The context length at which a token's attention (scores and values over that many keys)
        takes as many multiply-adds as its projections (q, k, v, o and the MLP); 3,072 for
        SmolLM2-135M. Past it, attention is most of a long-context prefill token's work."""
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        projections = self.hidden_size * (2 * q_width + 2 * kv_width + 3 * self.intermediate_size)
        return max(1, projections // (2 * q_width))


# The most compute threads per CPU the process may run on (--num-threads): past the cores a team
# only waits on itself, and a team of thousands does not start in reasonable time.
MAX_THREADS_PER_CPU = 4


# The most GiB a memory or disk budget flag takes (1 PiB: past any machine, within float and int
# arithmetic), and the longest TTL in seconds a store flag takes (ten years).
MAX_GIB = 2**20
MAX_TTL_S = 10 * 365 * 86400
@dataclass(frozen=True)
class CacheConfig:
    """The device KV block pool and prefix caching."""

    block_size: int = 16
    num_blocks: int | None = None          # None: derived from kv_cache_gb by the engine
    kv_cache_gb: float = 2.0
    enable_prefix_caching: bool = True
    hash_seed: int = 0                     # h_{-1} derives from this, never from the environment

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}")
        if not 0 < self.kv_cache_gb <= MAX_GIB:
            raise ValueError(f"--kv-cache-gb must be in (0, {MAX_GIB}], got {self.kv_cache_gb}")
        if not 0 <= self.hash_seed < 2**64:
            raise ValueError(f"--hash-seed must fit in 64 bits, got {self.hash_seed}")

    def resolve_num_blocks(self, block_bytes: int) -> int:
        """``num_blocks``, or how many blocks of ``block_bytes`` bytes fit in ``kv_cache_gb``."""
        if self.num_blocks is not None:
            return self.num_blocks
        num_blocks = int(self.kv_cache_gb * 2**30) // block_bytes
        if num_blocks < 2:
            raise ValueError(f"--kv-cache-gb {self.kv_cache_gb:g} holds {num_blocks} blocks of "
                             f"{block_bytes} bytes; the pool needs at least 2")
        return num_blocks


@dataclass(frozen=True)
class StoreConfig:
    """KV tiers below the device pool: CPU memory, local disk, Redis (each off unless configured)."""

    cpu_offload_gb: float = 0.0            # 0: no CPU memory tier
    disk_cache_dir: str | None = None      # None: no disk tier
    disk_cache_gb: float = 10.0
    redis_url: str | None = None           # None: no Redis tier
    redis_ttl_s: float | None = None       # expiry of Redis objects; None: Redis's own eviction only
    redis_timeout_s: float = 0.5           # a slower Redis call is a miss and backs the tier off
    # Blocks whose retention priority is below this are not written to the tiers (0: every block).
    offload_min_priority: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.cpu_offload_gb <= MAX_GIB:
            raise ValueError(f"--cpu-offload-gb must be in [0, {MAX_GIB}], got {self.cpu_offload_gb}")
        if not 0 < self.disk_cache_gb <= MAX_GIB:
            raise ValueError(f"--disk-cache-gb must be in (0, {MAX_GIB}], got {self.disk_cache_gb}")
        if self.disk_cache_dir is not None and not self.disk_cache_dir:
            raise ValueError("--disk-cache-dir must not be empty")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url must be a redis:// URL, got {self.redis_url!r}")
        if self.redis_ttl_s is not None and not 0 < self.redis_ttl_s <= MAX_TTL_S:
            raise ValueError(f"--redis-ttl must be in (0, {MAX_TTL_S}], got {self.redis_ttl_s}")
        if self.redis_timeout_s <= 0:
            raise ValueError(f"redis timeout must be positive, got {self.redis_timeout_s}")
        if isinstance(self.offload_min_priority, bool) or not 0 <= self.offload_min_priority <= 100:
            raise ValueError(f"--offload-min-priority must be in [0, 100], got {self.offload_min_priority}")

    @property
    def enabled(self) -> bool:
        """True when any tier below the device pool is configured."""
        return self.cpu_offload_gb > 0 or self.disk_cache_dir is not None or self.redis_url is not None


# --max-pinned-gb's default: a share of the room sessions may pin (``kvhive.sessions.limits``).
PINNED_AUTO = "auto"


@dataclass(frozen=True)
class SessionConfig:
    """Sessions (``/v1/context``, ``x-session-id``, ``conversation_id``): TTLs, limits, isolation."""

    default_ttl_s: int = 600               # a conversation_id seen for the first time
    max_ttl_s: int = 86400                 # every TTL is capped here (400 above it)
    max_sessions_per_key: int | None = None
    # KV GiB one API key's sessions may hold; PINNED_AUTO: a share of the keeper tier (else of the
    # device pool), see ``kvhive.sessions.limits.KEY_PINNED_SHARE``; None: no limit.
    max_pinned_gb: float | str | None = PINNED_AUTO
    share_prefix_cache: bool = False       # False: each API key has its own prefix cache (salt)
    enable_conversation_caching: bool = True    # False: a request naming conversation_id is refused
    # Live conversation_id sessions this replica holds; one more ends the least recently used idle one.
    max_active_conversations: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.max_ttl_s <= MAX_TTL_S:
            raise ValueError(f"--max-session-ttl must be in (0, {MAX_TTL_S}], got {self.max_ttl_s}")
        if not 0 < self.default_ttl_s <= self.max_ttl_s:
            raise ValueError(f"--default-session-ttl must be in (0, --max-session-ttl={self.max_ttl_s}], "
                             f"got {self.default_ttl_s}")
        if self.max_sessions_per_key is not None and self.max_sessions_per_key < 1:
            raise ValueError(f"--max-sessions-per-key must be at least 1, got {self.max_sessions_per_key}")
        if self.max_active_conversations is not None and self.max_active_conversations < 1:
            raise ValueError(f"--max-active-conversations must be at least 1, got {self.max_active_conversations}")
        pinned = self.max_pinned_gb
        if isinstance(pinned, str) and pinned != PINNED_AUTO:
            raise ValueError(f"--max-pinned-gb must be a number of GiB, '{PINNED_AUTO}' or none, got {pinned!r}")
        if isinstance(pinned, (int, float)) and not (0 < pinned < math.inf):
            raise ValueError(f"--max-pinned-gb must be a positive number of GiB (none: no limit), got {pinned}")


MAX_QUANT_ROWS = 4096      # --quantized-matmul-rows: past a few dozen rows the dense GEMM always wins


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs: which model, on what device, with which cache and scheduler."""

    model_path: str
    served_model_name: str = "smollm2-135m"
    dtype: str = "float32"                 # "auto": resolved from the checkpoint before the engine runs
    kv_cache_dtype: str = "auto"           # kvhive.core.kv_cache_dtype; auto: ``dtype`` (see ``kv_dtype``)
    device: str = "cpu"
    num_threads: int | None = None
    quantized_matmul: bool = True          # few-row steps read GGUF Q4_1/Q8_0 blocks directly (CPU)
    quantized_matmul_rows: int | None = None   # up to how many rows they do; None: measured per machine
    native_attention: bool = True          # C++ attention kernels over the KV pool (CPU)
    attention_backend: str = "auto"        # ATTENTION_BACKENDS (kvhive.engine.attention_kernels)
    enforce_eager: bool = False            # CUDA: no decode graphs (kvhive.model.cuda_graphs)
    cpu_isa: str = "auto"                  # ISA level of the C++ kernels (kvhive.model.cpu.LEVELS)
    adaptive_threads: bool = False         # CPU: size the thread team to the cores others leave free
    grammar_mask_overlap: bool = True      # structured outputs' token masks computed during the forward
    grammar_cache_size: int = 256          # distinct structured-output specs kept compiled
    kv_events: str | None = None           # ZMQ PUB endpoint for KV events, e.g. tcp://*:5557
    kv_events_replay: str | None = None    # ZMQ ROUTER endpoint serving replay of recent batches
    kv_events_config: KVEventsConfig | None = None   # --kv-events-config; replaces the two above
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)   # --kv-role, --kv-transfer-*
    # --generation-config: auto (the model's generation_config.json), vllm (none) or a directory.
    generation_config: str = "auto"
    load_format: str = "auto"              # LOAD_FORMATS (kvhive.model.dummy_weights for dummy)
    hf_config_path: str | None = None      # a config.json (or its directory) read instead of the model's
    # --speculative-config: draft tokens verified in one forward pass (kvhive.engine.speculative); None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self._check_model_source()
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        check_kv_cache_dtype(self.kv_cache_dtype, self.dtype, self.on_cpu, self.attention_backend)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.cpu_isa not in CPU_ISAS:
            raise ValueError(f"--cpu-isa must be one of {', '.join(CPU_ISAS)}, got {self.cpu_isa!r}")
        if self.kv_events_replay and not self.kv_events:
            raise ValueError("--kv-events-replay needs --kv-events")
        if self.kv_events_config is not None and self.kv_events:
            raise ValueError("give the KV-event endpoint once: in kv_events_config or as kv_events")
        if self.grammar_cache_size < 1:
            raise ValueError(f"the grammar cache needs at least 1 entry, got {self.grammar_cache_size}")
        most = MAX_THREADS_PER_CPU * usable_cpus()
        if self.num_threads is not None and not 1 <= self.num_threads <= most:
            raise ValueError(f"--num-threads must be 1 to {most} ({MAX_THREADS_PER_CPU} per CPU this process "
                             f"may run on), got {self.num_threads}")
        if self.quantized_matmul_rows is not None and not 0 <= self.quantized_matmul_rows <= MAX_QUANT_ROWS:
            raise ValueError(f"--quantized-matmul-rows must be auto or 0..{MAX_QUANT_ROWS}, "
                             f"got {self.quantized_matmul_rows}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise ValueError(f"--generation-config must be auto, vllm or a directory holding "
                             f"generation_config.json, got {self.generation_config!r}")
        budgets = [(f"--cpu-offload-gb {self.store.cpu_offload_gb:g}", self.store.cpu_offload_gb)]
        if self.on_cpu and self.cache.num_blocks is None:     # --num-blocks: checked once the block size is known
            budgets.insert(0, (f"--kv-cache-gb {self.cache.kv_cache_gb:g}", self.cache.kv_cache_gb))
        problem = kv_memory_problem(budgets, usable_memory_bytes())
        if problem is not None:
            raise ValueError(problem)
        if self.store.enabled and not self.cache.enable_prefix_caching:
            raise ValueError("KV tiers (--cpu-offload-gb, --disk-cache-dir, --redis-url) need prefix caching")
        if self.kv_transfer.disaggregated and not self.cache.enable_prefix_caching:
            raise ValueError(f"--kv-role {self.kv_transfer.role} needs prefix caching (blocks are sent by hash)")

    def _check_model_source(self) -> None:
        """ValueError naming --load-format or --hf-config-path when either names nothing kvhive reads."""
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        path = self.hf_config_path
        if path is not None and not (os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json"))):
            raise ValueError(f"--hf-config-path must be a config.json file or a directory holding one, got {path!r}")

    def kv_events_settings(self) -> KVEventsConfig | None:
        """How the engine publishes KV events: ``kv_events_config``, else the ``kv_events`` short
        form (events on, at that endpoint); None when neither is set."""
        if self.kv_events_config is not None:
            return self.kv_events_config
        if self.kv_events:
            return KVEventsConfig(enable_kv_cache_events=True, endpoint=self.kv_events,
                                  replay_endpoint=self.kv_events_replay)
        return None

    @property
    def on_cpu(self) -> bool:
        """True when the engine runs on the CPU."""
        return self.device == "cpu"

    @property
    def kv_dtype(self) -> str:
        """The KV pool's dtype, the one place it is resolved: float32, bfloat16, float16 (``auto``: the
        model's ``dtype``), int8 or fp8 (``fp8_e4m3`` too)."""
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is resolved from the checkpoint (kvhive.cli.resolve_auto_dtype) "
                             "before the engine is built")
        return resolve_kv_dtype(self.kv_cache_dtype, self.dtype)

    def kv_bytes_per_block(self, model: ModelConfig) -> int:
        """Bytes one KV pool block takes: K and V rows of ``cache.block_size`` tokens in every layer."""
        rows = model.kv_values_per_token // model.head_dim
        return rows * self.cache.block_size * kv_row_bytes(model.head_dim, self.kv_dtype)

    def resolved(self, model: ModelConfig, external_store: bool = False) -> EngineConfig:
        """This config with what depends on the model fixed once: ``cache.num_blocks`` (from
        ``kv_cache_gb`` when unset) and ``scheduler.max_model_len`` (capped at the model's context).

        ``external_store``: the engine gets store tiers that ``store`` does not describe; they need
        prefix caching too (ValueError).
        """
        if external_store and not self.cache.enable_prefix_caching:
            raise ValueError("KV tiers need prefix caching")
        num_blocks = self.cache.resolve_num_blocks(self.kv_bytes_per_block(model))
        return replace(self, cache=replace(self.cache, num_blocks=num_blocks),
                       scheduler=self.scheduler.for_model(model.max_position_embeddings,
                                                           model.attention_balance_context))
