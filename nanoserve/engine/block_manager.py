"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, and the prefix cache."""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from nanoserve.engine.sequence import Sequence


def chain_hash(parent: int, token_ids: list[int]) -> int:
    """Hash of a full block that also commits to every block before it."""
    return xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + array("q", token_ids).tobytes())


def first_parent(cache_salt: str | None) -> int:
    """What the first block's hash chains from: 0, or the hash of the request's cache salt.

    The salt goes into the first block, as in vLLM, and so into every hash after it: requests of
    different salts share no block, whatever their tokens; requests of one salt share as before."""
    if cache_salt is None:
        return 0
    # surrogatepass: a JSON string may hold a lone surrogate, which strict UTF-8 cannot encode
    return xxhash.xxh3_128_intdigest(b"salt:" + cache_salt.encode("utf-8", "surrogatepass"))


class BlockManager:
    """Hands out KV blocks to sequences and shares full blocks between equal prefixes.

    A block with reference count 0 sits in `free`, in LRU order (evicted from the front).
    Full blocks are registered under a chain hash; a freed block keeps its hash, so a later
    sequence with the same prefix can take it back until it is evicted for a new allocation.

    With `window` (every layer's sliding window: a query at position p attends keys k > p - window)
    the blocks whose keys no query of the sequence will attend again are given back as it moves on
    (vLLM's sliding-window manager). Their places in the block table name a stand-in, the first
    block still held, so that every entry names a block of the sequence: the kernels read whole
    tiles, which may begin before the window, and mask the keys outside it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        # tokens of a full block never change, so hashes are computed once per sequence
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else first_parent(seq.params.cache_salt)
            hashes.append(chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def _take(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def admit(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks of its longest prefix that can be reused:
        every block of it, or under a window the blocks that the prefix's next query attends."""
        assert not seq.block_table, "admit() is for sequences that hold no blocks"
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_hashed_blocks = seq.num_dropped_blocks = 0
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return  # (prompt logprobs need every prompt position computed)
        # the last token is always computed: its logits are what the step samples from
        found = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            found.append(self.cached.get(h))
            if found[-1] is None and self.window is None:
                break
        hit, behind = self._longest_hit(found)
        for block_id in found[behind:hit]:
            self._take(block_id)
        if hit:
            seq.block_table = [found[behind]] * behind + found[behind:hit]
        seq.num_computed_tokens = seq.num_cached_tokens = hit * self.block_size
        seq.num_hashed_blocks, seq.num_dropped_blocks = hit, behind

    def _longest_hit(self, found: list[int | None]) -> tuple[int, int]:
        """(blocks of the longest reusable prefix, how many of them lie behind the window of the
        query after it). Without a window all must be cached; with one, only those the window
        reaches (vLLM's sliding-window lookup), the rest being stand-ins."""
        if self.window is None:
            hit = found.index(None) if None in found else len(found)
            return hit, 0
        best, run = (0, 0), 0
        for i, block_id in enumerate(found):
            run = run + 1 if block_id is not None else 0
            behind = self._blocks_behind((i + 1) * self.block_size, i + 1)
            if run >= i + 1 - behind:
                best = (i + 1, behind)
        return best

    def _blocks_behind(self, position: int, num_blocks: int) -> int:
        """Leading blocks of `num_blocks` that hold only keys before the window of a query at
        `position` (it and every later one attend keys k > position - window), keeping the last."""
        return max(0, min((position - self.window + 1) // self.block_size, num_blocks - 1))

    def record_prefix_hit(self, seq: Sequence) -> None:
        """Count an admitted sequence's lookup in the hit statistics."""
        # not in admit(): a sequence that then finds no room looks up again next step
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_cached_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False if blocks ran out.
        Blocks behind the window of the step's first query are given back first."""
        if self.window is not None:   # (every running sequence comes here every step)
            self._drop_behind_window(seq)
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            block_id, _ = self.free.popitem(last=False)
            old = self.block_hash[block_id]
            if old is not None:
                if self.cached.get(old) == block_id:
                    del self.cached[old]
                self.block_hash[block_id] = None
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        return True

    def commit(self, seq: Sequence, num_known_tokens: int | None = None) -> None:
        """Register the blocks that the last step filled completely in the prefix cache.

        `num_known_tokens` limits it to blocks whose tokens are all known on the host."""
        computed = seq.num_computed_tokens if num_known_tokens is None else min(seq.num_computed_tokens,
                                                                                 num_known_tokens)
        full = computed // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_hashed_blocks:
            return
        hashes = self._hashes(seq, full)
        # a block dropped behind the window before the step that filled it was read back may
        # already hold another sequence's tokens: it is not registered
        for i in range(max(seq.num_hashed_blocks, seq.num_dropped_blocks), full):
            block_id = seq.block_table[i]
            # an equal block computed twice (two prompts admitted together) stays unregistered
            if hashes[i] not in self.cached:
                self.cached[hashes[i]] = block_id
                self.block_hash[block_id] = hashes[i]
        seq.num_hashed_blocks = full

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks; cached ones stay reusable until evicted."""
        # tail blocks first, so that eviction takes a sequence's end before its shared start
        for block_id in reversed(seq.block_table[seq.num_dropped_blocks:]):
            self._give_back(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.num_dropped_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset: later prompts compute their prefixes afresh);
        False, and nothing forgotten, while any block is held."""
        if len(self.free) < self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def _give_back(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None
            if self.block_hash[block_id] is None:
                # holds nothing reusable: hand it out before any cached block
                self.free.move_to_end(block_id, last=False)

    def _drop_behind_window(self, seq: Sequence) -> None:
        """Give back the leading blocks that hold only keys before the window of the sequence's next
        query (at num_computed_tokens): that query and every later one attend keys k > p - window.
        The last block is always kept, to stand in for the dropped ones."""
        behind = self._blocks_behind(seq.num_computed_tokens, len(seq.block_table))
        if behind <= seq.num_dropped_blocks:
            return
        table = seq.block_table
        for i in range(seq.num_dropped_blocks, behind):
            self._give_back(table[i])
        table[:behind] = [table[behind]] * behind
        seq.num_dropped_blocks = behind
