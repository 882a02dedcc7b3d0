"""How an engine is put together: the kernels' ISA, the model, the KV tiers and connector halves,
the runner, the scheduler and the KV-event publisher, each built from the resolved config.

``LLMEngine`` calls these in order (connector, disaggregation, runner, scheduler, publisher) and
holds what they return; none of them keeps state of its own.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvhive.config import EngineConfig
from kvhive.core.blocks import root_hash
from kvhive.core.kv_events_config import KVEventsConfig
from kvhive.engine.scheduler import Scheduler, TierSessionCopy
from kvhive.kv.window_group import window_layout_for

if TYPE_CHECKING:
    from kvhive.connector.disagg.build import DisaggHalves
    from kvhive.connector.offload import OffloadScheduler
    from kvhive.connector.offload_worker import OffloadWorker
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.engine.runner import ModelRunner
    from kvhive.kv.event_publisher import KVEventPublisher
    from kvhive.model.loader import LoadedModel
    from kvhive.model.threads import ThreadGovernor
    from kvhive.store.tiered import TieredStore
    from kvhive.structured import GrammarCompiler

logger = logging.getLogger(__name__)


def kernel_isa(config: EngineConfig) -> str | None:
    """The ISA level the CPU kernels run at (ValueError naming what the CPU lacks); None off the CPU."""
    if not config.on_cpu:
        return None
    from kvhive.model import cpu

    cpu.check_dtype(config.dtype, config.device)
    features = cpu.detect()
    isa = features.level(config.cpu_isa)
    logger.info("CPU: %s; kernels for %s%s", features.describe(), isa,
                "" if config.cpu_isa == "auto" else " (forced by --cpu-isa)")
    return isa


def load_model(config: EngineConfig, isa: str | None) -> LoadedModel:
    """The model ``config.model_path`` names, loaded for the config's dtype, device and kernels."""
    from kvhive.model.loader import load_model as load

    started = time.perf_counter()
    loaded = load(config.model_path, dtype=config.dtype, device=config.device,
                  quantized_matmul=config.quantized_matmul, isa=isa, load_format=config.load_format,
                  hf_config_path=config.hf_config_path)
    logger.info("loaded %s (%s, %s%s) in %.1f s", os.path.basename(config.model_path.rstrip("/")),
                config.dtype, config.device, ", random dummy weights" if config.load_format == "dummy" else "",
                time.perf_counter() - started)
    if getattr(loaded.model, "qmatmul", None) is not None and config.quantized_matmul_rows is None:
        from kvhive.model import quant_rows

        quant_rows.calibrate(loaded.model)
    return loaded


def load_tokenizer(config: EngineConfig) -> Tokenizer:
    """The tokenizer of ``config.model_path`` (with ``--load-format dummy``, a bare config.json's
    directory's); ValueError or OSError naming what is missing."""
    from kvhive.core.tokenizer import Tokenizer

    if config.load_format != "dummy":
        return Tokenizer.from_model_path(config.model_path)
    from kvhive.model.dummy_weights import check_dummy_tokenizer, dummy_tokenizer_path

    check_dummy_tokenizer(config.model_path)
    return Tokenizer.from_model_path(dummy_tokenizer_path(config.model_path))


def fix_quant_rows(config: EngineConfig, model) -> None:
    """Apply ``--quantized-matmul-rows N`` to a model with GGUF blocks (auto: left as loaded)."""
    if getattr(model, "qmatmul", None) is not None and config.quantized_matmul_rows is not None:
        model.quant_max_rows = config.quantized_matmul_rows


def thread_governor(config: EngineConfig) -> ThreadGovernor | None:
    """A ThreadGovernor sizing torch's thread team, with ``adaptive_threads`` on the CPU; else None."""
    if not (config.adaptive_threads and config.on_cpu):
        return None
    import torch

    from kvhive.model.threads import ThreadGovernor

    return ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)


class OffloadConnector(NamedTuple):
    """The store tiers and both halves of the offload connector over them."""

    store: TieredStore
    scheduler_half: OffloadScheduler
    worker_half: OffloadWorker


def tiers_for(config: EngineConfig, store: TieredStore | None) -> TieredStore | None:
    """The store tiers the engine runs over: ``store`` when handed in, else those ``config.store``
    describes (None when it describes none)."""
    if store is not None or not config.store.enabled:
        return store
    from kvhive.store.redis_keys import RedisKeys
    from kvhive.store.tier_builder import build_tiered_store

    return build_tiered_store(config.store, RedisKeys(config.served_model_name))


def build_connector(config: EngineConfig, loaded: LoadedModel, store: TieredStore, block_bytes: int) -> OffloadConnector:
    """Both halves of the offload connector over the store tiers ``store``."""
    from kvhive.connector.offload import KV_LAYOUT_VERSION, OffloadScheduler
    from kvhive.connector.offload_worker import OffloadWorker
    from kvhive.store.key import KeySpace

    key_space = KeySpace(loaded.fingerprint, KV_LAYOUT_VERSION, config.kv_dtype, config.cache.block_size)
    return OffloadConnector(store, OffloadScheduler(store, key_space, block_bytes,
                                                    min_priority=config.store.offload_min_priority),
                            OffloadWorker(store))


def build_disagg(config: EngineConfig, loaded: LoadedModel, connector_scheduler: OffloadScheduler | None,
                 connector_worker: OffloadWorker | None, store: TieredStore | None,
                 count_cached: Callable[[Sequence[bytes]], int]) -> DisaggHalves:
    """Both disaggregation halves for ``--kv-role`` around the offload connector (or none);
    ``count_cached`` counts the blocks the device prefix cache holds."""
    from kvhive.connector.disagg.build import build_disagg as build
    from kvhive.connector.disagg.build import leading_held
    from kvhive.connector.offload import KV_LAYOUT_VERSION
    from kvhive.store.key import KeySpace

    key_space = KeySpace(loaded.fingerprint, KV_LAYOUT_VERSION, config.kv_dtype, config.cache.block_size)
    root = root_hash(config.cache.hash_seed, loaded.fingerprint)
    return build(config.kv_transfer, key_space, root, loaded.config.num_layers, connector_scheduler,
                 connector_worker, store, lambda hashes: leading_held(count_cached, hashes))


def build_runner(config: EngineConfig, loaded: LoadedModel, num_blocks: int, worker_half, isa: str | None,
                 grammars: GrammarCompiler | None = None) -> ModelRunner:
    """The model runner over a KV pool of ``num_blocks`` blocks (and the connector's worker half;
    ``grammars``: the GrammarCompiler structured requests decode under)."""
    from kvhive.engine.runner import ModelRunner

    started = time.perf_counter()
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=num_blocks,
                         block_size=config.cache.block_size, dtype=config.dtype,
                         device=config.device, native_attention=config.native_attention,
                         attention_backend=config.attention_backend, kv_dtype=config.kv_dtype,
                         connector=worker_half, cuda_graphs=not config.enforce_eager,
                         max_num_seqs=config.scheduler.max_num_seqs, isa=isa,
                         window=window_layout_for(loaded.config, config, config.kv_transfer.disaggregated),
                         measure_attention=config.cpu_isa == "auto",   # a forced level runs its kernels
                         grammars=grammars, grammar_mask_overlap=config.grammar_mask_overlap)
    logger.info("KV pool: %d blocks of %d tokens (%d tokens, %.2f GiB %s on %s) in %.1f s", num_blocks,
                config.cache.block_size, num_blocks * config.cache.block_size, runner.pool_bytes() / 2**30,
                config.kv_dtype, config.device, time.perf_counter() - started)
    return runner


def session_copy(store: TieredStore | None, connector_scheduler: OffloadScheduler | None,
                 connector_worker: OffloadWorker | None) -> TierSessionCopy | None:
    """Where the store tiers hold a copy of a session's blocks (None without tiers)."""
    if store is None:
        return None
    return TierSessionCopy(store, connector_scheduler.key_space, connector_worker.is_saving)


def build_scheduler(config: EngineConfig, loaded: LoadedModel, num_blocks: int, scheduler_half,
                    copy: TierSessionCopy | None, window) -> Scheduler:
    """The scheduler over the device pool; with store tiers it spills first the sessions they hold copies of."""
    cache = config.cache
    return Scheduler(config.scheduler, cache, num_blocks, root_hash(cache.hash_seed, loaded.fingerprint),
                     connector=scheduler_half, session_copy=copy, window=window, speculative=config.speculative)


def open_publisher(events: KVEventsConfig, config: EngineConfig, scheduler: Scheduler, store: TieredStore | None,
                   connector_scheduler: OffloadScheduler | None) -> KVEventPublisher:
    """The KV-event publisher: AllBlocksCleared first (the pool starts empty), then the blocks the
    store tiers hold and, from then on, the device pool's and the tiers' changes."""
    from kvhive.kv.event_publisher import open_publisher as open_events
    from kvhive.kv.tier_events import TierEventForwarder

    publisher = open_events(events, config.served_model_name)
    publisher.publish_cleared()
    scheduler.kv.enable_events(priority_events=events.priority_events)
    if store is not None:
        store.send_events_to(TierEventForwarder(publisher, config.cache.block_size),
                             connector_scheduler.key_space.prefix)
    return publisher


def load_history(config: EngineConfig, scheduler: Scheduler, fingerprint: str, vocab_size: int):
    """With method "history" and a disk cache dir: refill the history store from the file the last
    run left there (``kvhive.engine.speculative.history_file``); the ``HistoryKeeper`` that writes
    it back while the engine runs and when it closes, else None."""
    from kvhive.engine.speculative import history_file

    speculation, directory = scheduler.speculation, config.store.disk_cache_dir
    if speculation is None or speculation.proposer.history is None or directory is None:
        return None
    history = speculation.proposer.history
    history_file.load(history, directory, fingerprint, vocab_size)
    return history_file.HistoryKeeper(history, directory, fingerprint, vocab_size)
