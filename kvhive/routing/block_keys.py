"""Replica block hashes -> kvhive block keys (``BlockKeyMapper``), for the gateway's index.

A kvhive replica's bytes hashes are kvhive block keys already. A foreign engine (vLLM), or a kvhive
replica publishing int hashes (``hash_format: int64``), names blocks with other hashes, so the mapper
recomputes kvhive's chain from the token ids of each ``BlockStored`` (continuing from the kvhive key
of its parent) and remembers engine hash -> keys. A ``BlockStored`` without token ids (a block
entering a CPU, disk or remote tier) is resolved through that memory.
"""

from __future__ import annotations

from kvhive.core.blocks import ExtraKeys, hash_blocks
from kvhive.core.kv_events import BlockRemoved, BlockStored, WireHash, normalize_medium


class BlockKeyMapper:
    """A replica's block hashes -> kvhive block keys: identity for kvhive, recomputed for others."""

    def __init__(self, foreign: bool, block_size: int, root: bytes) -> None:
        self.foreign = foreign
        self.block_size = block_size
        self.root = root
        # Foreign only: engine hash -> (kvhive keys of its tokens, media that hold it). An entry
        # lives while any medium holds the block, so a child stored later can find its parent.
        self._keys: dict[WireHash, tuple[tuple[bytes, ...], set[str]]] = {}
        self.num_unmapped = 0

    def __len__(self) -> int:
        return len(self._keys)

    def _identity(self, hashes: list[WireHash]) -> bool:
        """Whether these hashes are kvhive block keys as they are (a kvhive replica's bytes)."""
        return not self.foreign and all(isinstance(h, bytes) for h in hashes)

    def stored(self, event: BlockStored) -> list[bytes]:
        """Keys of the blocks ``event`` stores (foreign blocks whose chain is unknown are skipped)."""
        if self._identity(event.block_hashes):
            return list(event.block_hashes)
        if not event.token_ids:
            return self._relocated(event)
        size = event.block_size
        if size <= 0 or size % self.block_size or len(event.token_ids) < size * len(event.block_hashes):
            self.num_unmapped += len(event.block_hashes)
            return []
        # Only blocks whose extra keys kvhive's hash can express are mapped: the first block that
        # has others, and every block chained after it, is left out of the index (see _salt).
        mappable = len(event.block_hashes)
        salt: str | None = None
        for i in range(len(event.block_hashes)):
            ok, found = _salt(event, i, first=event.parent_block_hash is None and i == 0)
            if not ok:
                mappable = i
                break
            salt = salt if found is None else found
        self.num_unmapped += len(event.block_hashes) - mappable
        if not mappable:
            return []
        if event.parent_block_hash is None:
            parent = self.root
            extra = ExtraKeys(cache_salt=salt, adapter_id=event.lora_name or None)
        else:
            known = self._keys.get(event.parent_block_hash)
            if known is None:           # the parent was stored before we listened, or is gone
                self.num_unmapped += mappable
                return []
            parent, extra = known[0][-1], None
        tokens = event.token_ids[: size * mappable]
        # Passing the parent's key as the root continues its chain: h = H(parent || tokens || extra).
        keys = hash_blocks(tokens, self.block_size, parent, extra)
        per_block = size // self.block_size
        medium = normalize_medium(event.medium)
        for i, engine_hash in enumerate(event.block_hashes[:mappable]):
            entry = self._keys.get(engine_hash)
            media = entry[1] if entry is not None else set()
            media.add(medium)
            self._keys[engine_hash] = (tuple(keys[i * per_block:(i + 1) * per_block]), media)
        return keys

    def _relocated(self, event: BlockStored) -> list[bytes]:
        """Keys of known blocks a location-only ``event`` (no token ids) stores in its medium."""
        medium = normalize_medium(event.medium)
        keys: list[bytes] = []
        for engine_hash in event.block_hashes:
            entry = self._keys.get(engine_hash)
            if entry is None:
                self.num_unmapped += 1
                continue
            entry[1].add(medium)
            keys.extend(entry[0])
        return keys

    def removed(self, event: BlockRemoved) -> list[bytes]:
        """Keys of the blocks ``event`` removes from its medium."""
        if self._identity(event.block_hashes):
            return list(event.block_hashes)
        medium = normalize_medium(event.medium)
        keys: list[bytes] = []
        for engine_hash in event.block_hashes:
            entry = self._keys.get(engine_hash)
            if entry is None:
                continue
            keys.extend(entry[0])
            entry[1].discard(medium)
            if not entry[1]:
                del self._keys[engine_hash]
        return keys

    def clear(self) -> None:
        """Forget every mapping (the replica dropped all its blocks)."""
        self._keys.clear()


def _salt(event: BlockStored, i: int, first: bool) -> tuple[bool, str | None]:
    """Whether block ``i`` of a foreign ``event`` maps to a kvhive key, and the cache salt it carries.

    vLLM publishes each block's extra hash keys untagged, in this order: the LoRA name (when
    ``lora_name`` is set), (multimodal id, offset) pairs, the cache salt (block 0 of a request
    only), prompt-embedding digests. kvhive's hash mixes a salt and an adapter id into block 0 and
    has no multimodal or embedding keys: the gateway hashes text prompts, and a placeholder block
    of an image must never look like text the gateway could route by. So a block is mapped when
    its keys are at most the LoRA name and, on the chain's first block, one string: the salt.
    """
    keys = event.extra_keys[i] if event.extra_keys is not None and i < len(event.extra_keys) else None
    if keys is not None and not isinstance(keys, list | tuple):
        return False, None
    rest = list(keys or ())
    if event.lora_name and rest and rest[0] == event.lora_name:
        rest = rest[1:]
    if not rest:
        return True, None
    if first and len(rest) == 1 and isinstance(rest[0], str):
        return True, rest[0]
    return False, None
