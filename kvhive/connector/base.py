"""The two halves of a KV connector and the plain data that passes between them (torch-free).

The scheduler half runs inside ``Scheduler``: it finds KV for a request outside the device pool,
records which blocks to load into and which blocks to save, and packs both into a ``ConnectorMeta``
that rides on the ``StepPlan``. The worker half runs inside ``ModelRunner``: it moves the bytes on
background threads and reports finished transfers. The engine is the one place that hands the
meta from one half to the other and the finished transfers back (the split of vLLM's KV connector).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from kvhive.core.retention import DEFAULT_PRIORITY
from kvhive.store.base import StoreStats
from kvhive.store.key import StoreKey


class CachedBlock(NamedTuple):
    """A device block that a step just computed and registered in the prefix cache."""

    block_id: int
    block_hash: bytes
    window_block_id: int | None = None      # its window part's block in the window pool; None: one pool
    priority: int = DEFAULT_PRIORITY        # the retention priority its request gives it (kvhive.core.retention)


@dataclass(frozen=True)
class SchedulerOutput:
    """What the scheduler decided this step, as far as a connector needs to know."""

    scheduled_request_ids: tuple[str, ...]
    finished_request_ids: tuple[str, ...]
    # Blocks computed by earlier steps and registered since the last output (never loaded ones).
    newly_cached: tuple[CachedBlock, ...]
    # Requests that ended (aborted) while their asynchronous load was in flight.
    cancelled_loads: tuple[str, ...] = ()
    # This step's tokens and block table of each scheduled request (a disaggregating connector
    # sends the blocks a step computes while it computes them).
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    block_tables: Mapping[str, Sequence[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadSpec:
    """Load the objects ``keys`` into device blocks ``block_ids`` (same order) for one request.

    ``payloads`` is set for a synchronous load: the bytes are already in hand (memory tier) and the
    worker copies them layer by layer during the step. Otherwise the load is asynchronous: the
    worker fetches the objects itself and reports the request in ``get_finished``.
    """

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[StoreKey, ...]
    payloads: tuple[Any, ...] | None = None
    # With a window pool: per block, the window-pool block that receives its window layers
    # (0: none, no row after the load sees them); None: one pool.
    window_block_ids: tuple[int, ...] | None = None

    @property
    def is_async(self) -> bool:
        """True when the worker must fetch the objects (a slow tier holds some of them)."""
        return self.payloads is None


@dataclass(frozen=True)
class KVSend:
    """Send layer by layer, as this step computes them, blocks of a prompt to a decode instance."""

    transfer_id: str
    endpoint: tuple[str, int]
    first_block: int                        # index in the prompt of block_ids[0]
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]         # every full prompt block's hash known so far
    last: bool                              # the prompt is complete after this step: end the transfer


@dataclass(frozen=True)
class RemoteLoad:
    """Load blocks ``first_block`` on of a prompt arriving from a prefill instance into ``block_ids``."""

    request_id: str
    transfer_id: str
    first_block: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]         # the hashes of those blocks (the shared tier's keys)


@dataclass(frozen=True)
class ConnectorMeta:
    """One step's transfers: blocks to snapshot and save, blocks to load, loads to cut short."""

    saves: tuple[tuple[int, StoreKey], ...] = ()     # (device block id, key)
    save_window_ids: tuple[int, ...] = ()             # with a window pool: each save's window block
    loads: tuple[LoadSpec, ...] = ()
    # Requests whose asynchronous loads are no longer wanted: the worker stops each at its next
    # block and reports it in ``get_finished`` as usual (the blocks loaded so far).
    cancelled_loads: tuple[str, ...] = ()
    kv_sends: tuple[KVSend, ...] = ()           # prefill instance: blocks to push this step
    remote_loads: tuple[RemoteLoad, ...] = ()   # decode instance: blocks arriving from a prefill
    ended_sends: tuple[str, ...] = ()           # transfer ids whose request ended before its prompt

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to move or cancel."""
        return not (self.saves or self.loads or self.cancelled_loads or self.kv_sends
                    or self.remote_loads or self.ended_sends)


class FinishedTransfers(NamedTuple):
    """Transfers the worker completed since the last poll."""

    done_sending: set[str]              # requests whose async saves ended (their blocks may be freed)
    done_recving: dict[str, int]        # request id -> blocks loaded intact (a prefix of its LoadSpec)


class ConnectorScheduler(Protocol):
    """The scheduler half: decides what to load and save; never touches tensors."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (device hits) that the store can supply, and
        whether loading them is asynchronous (the request must wait) or happens during the step.

        None tokens (as in vLLM): the lookup is still running off the engine loop; ask again next
        step. The answer for one ``num_computed_tokens`` is kept until the request is admitted
        (``update_state_after_alloc``) or finished, so asking again repeats no store query.
        """
        ...

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int,
                                 window_block_ids: Sequence[int] | None = None) -> None:
        """Record that ``block_ids`` (the request's blocks after its device hits) will receive
        ``num_external_tokens`` tokens from the store, and forget the lookup; 0 drops it unused.
        ``window_block_ids``: with a window pool, the blocks' window entries (0: not loaded)."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        """The transfers for this step (loads recorded since the last call, saves of new blocks)."""
        ...

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """A request ended (finished or aborted): forget its lookup and anything it holds. True
        would mean its blocks must stay allocated until saves finish."""
        ...


class ConnectorWorker(Protocol):
    """The worker half: moves bytes between the KV pool and the store, off the engine loop."""

    def register_kv_caches(self, kv_cache: Any) -> None:
        """Remember the pool tensor ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``."""
        ...

    def register_window_cache(self, window_cache: Any, window_layers: tuple[bool, ...]) -> None:
        """Remember the window layers' own pool (``window_layers``: per layer, True where it lives
        there); the main pool then holds the other layers. A block still moves as every layer."""
        ...

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Snapshot the blocks to save, then start this step's loads on background threads."""
        ...

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer ``layer`` of every synchronous load of this step is in the pool."""
        ...

    def save_kv_layer(self, layer: int) -> None:
        """Called after layer ``layer`` ran; a connector may start saving that layer."""
        ...

    def wait_for_save(self) -> None:
        """Block until every save handed over so far is in the store."""
        ...

    def get_finished(self, finished_request_ids: Sequence[str]) -> FinishedTransfers:
        """Requests whose asynchronous saves or loads completed since the last call."""
        ...


@dataclass
class TierCounters:
    """Connector-side counters of one tier, in tokens (lookups at admission)."""

    hit_tokens: int = 0            # prefix tokens this tier supplied
    miss_tokens: int = 0           # tokens asked of this tier that it did not hold


@dataclass
class ConnectorStats:
    """Counters the scheduler half keeps: per-tier lookups, loads started, saves asked for."""

    tiers: dict[str, TierCounters] = field(default_factory=dict)
    sync_loads: int = 0            # loads started with the bytes in hand (memory tier)
    async_loads: int = 0           # loads that fetch from a slow tier while the request waits
    saved_blocks: int = 0          # blocks handed to the worker for saving
    unsaved_low_priority: int = 0  # blocks not saved: retention priority below --offload-min-priority


@dataclass(frozen=True)
class TierStats:
    """One tier for metrics: connector lookups in tokens, and the store's own counters."""

    name: str
    hit_tokens: int
    miss_tokens: int
    store: StoreStats
