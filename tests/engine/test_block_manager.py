"""Paged KV blocks: reference counts, chain-hashed prefix cache, LRU reuse of freed cached blocks."""

from __future__ import annotations

import itertools

from nanoserve.engine.block_manager import BlockManager, chain_hash
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(tokens: list[int], cache_salt: str | None = None) -> Sequence:
    return Sequence(f"r{next(_ids)}", tokens, SamplingParams(cache_salt=cache_salt))


def prefill(bm: BlockManager, tokens: list[int], cache_salt: str | None = None) -> Sequence:
    """Admit a sequence and compute its whole prompt, as one engine step would."""
    seq = make_seq(tokens, cache_salt)
    bm.admit(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return seq


def hit_tokens(bm: BlockManager, tokens: list[int], cache_salt: str | None = None) -> int:
    """How many leading tokens a new sequence would find cached (and give the blocks back)."""
    seq = make_seq(tokens, cache_salt)
    bm.admit(seq)
    hit = seq.num_cached_tokens
    bm.release(seq)
    return hit


def assert_all_free(bm: BlockManager, *release: Sequence) -> None:
    """Once `release`'s sequences give their blocks back, every block is free and unreferenced."""
    for seq in release:
        bm.release(seq)
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.ref_counts == [0] * bm.num_blocks


def test_equal_prefixes_share_blocks_and_count_references():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = prefill(bm, list(range(1, 11)))              # 2 full blocks + 2 tokens
    b = make_seq(list(range(1, 9)) + [50, 51, 52])   # same first 2 blocks, different tail
    bm.admit(b)

    assert b.block_table == a.block_table[:2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.ref_counts[i] for i in a.block_table] == [2, 2, 1]

    assert bm.allocate_slots(b, b.num_tokens - b.num_computed_tokens)
    assert len(b.block_table) == 3 and b.block_table[2] not in a.block_table
    bm.release(a)
    assert [bm.ref_counts[i] for i in b.block_table] == [1, 1, 1]
    bm.release(b)
    assert_all_free(bm)


def test_reset_forgets_cached_prefixes_only_once_no_block_is_held():
    bm = BlockManager(num_blocks=10, block_size=BS)
    tokens = list(range(1, 11))
    held = prefill(bm, tokens)
    assert not bm.reset_prefix_cache()   # a held block: nothing forgotten
    assert hit_tokens(bm, tokens) == 8
    bm.release(held)
    assert hit_tokens(bm, tokens) == 8
    assert bm.reset_prefix_cache()
    assert hit_tokens(bm, tokens) == 0
    again = prefill(bm, tokens)          # and it caches afresh
    assert hit_tokens(bm, tokens) == 8
    assert_all_free(bm, again)


def test_freed_prefix_blocks_are_reused_before_evicting():
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = list(range(1, 10))                      # 2 full blocks + 1 token
    a = prefill(bm, prompt)
    shared = a.block_table[:2]
    bm.release(a)
    assert_all_free(bm)

    # an unrelated allocation that fits in the other free blocks leaves the cached ones alone
    other = prefill(bm, [90, 91, 92, 93, 94])
    assert not set(other.block_table) & set(shared)

    b = make_seq(prompt + [7])
    bm.admit(b)
    assert b.block_table == shared
    assert b.num_cached_tokens == 8
    assert [bm.ref_counts[i] for i in shared] == [1, 1]
    bm.release(b)
    bm.release(other)
    assert_all_free(bm)


def test_allocation_evicts_unhashed_free_blocks_before_cached_ones():
    bm = BlockManager(num_blocks=3, block_size=BS)
    prompt = [1, 2, 3, 4, 5]                         # one cached block + a partial (unhashed) tail
    a = prefill(bm, prompt)
    b = prefill(bm, [60, 61, 62])                    # one partial block, never hashed
    bm.release(a)
    bm.release(b)                                    # freed last, yet holds nothing worth keeping

    x = prefill(bm, [70, 71, 72, 73, 74])            # two blocks: both unhashed ones go, the prefix stays
    assert hit_tokens(bm, prompt) == 4
    bm.release(x)
    assert_all_free(bm)


def test_allocation_under_pressure_evicts_the_least_recently_freed_cached_block():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = [1, 2, 3, 4, 5]                            # one cached block each, plus a partial tail
    new = [11, 12, 13, 14, 15]
    bm.release(prefill(bm, old))
    bm.release(prefill(bm, new))

    # three blocks needed: both unhashed tails, then the cached block freed longest ago
    x = prefill(bm, [20, 21, 22, 23, 24, 25, 26, 27, 28])
    assert hit_tokens(bm, old) == 0
    assert hit_tokens(bm, new) == 4
    bm.release(x)
    assert_all_free(bm)


def test_a_sequence_frees_its_tail_before_its_shared_start():
    # the tail of a chain is useless without its head: evicting it first keeps more hits
    prompt = list(range(1, 13)) + [99]               # 3 cached blocks (the 4th would be partial)
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.release(prefill(bm, prompt))
    assert hit_tokens(bm, prompt) == 12

    x = prefill(bm, [40, 41, 42, 43, 44])            # takes the unhashed tail and the last cached block
    assert hit_tokens(bm, prompt) == 8
    bm.release(x)
    assert_all_free(bm)


def test_chain_hash_does_not_match_equal_blocks_after_different_prefixes():
    block = [7, 8, 9, 10]
    assert chain_hash(0, block) != chain_hash(chain_hash(0, [1, 2, 3, 4]), block)

    bm = BlockManager(num_blocks=12, block_size=BS)
    a = prefill(bm, [1, 2, 3, 4] + block + [0])
    b = make_seq([5, 6, 7, 8] + block + [0])         # second block equal, first differs
    bm.admit(b)
    assert b.num_cached_tokens == 0 and b.block_table == []
    c = make_seq([1, 2, 3, 4] + [7, 8, 9, 11, 0])    # first equal, second differs in its last token
    bm.admit(c)
    assert c.block_table == a.block_table[:1]
    for seq in (a, b, c):
        bm.release(seq)
    assert_all_free(bm)


def test_last_token_is_always_recomputed():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(1, 13))                      # exactly 3 full blocks
    a = prefill(bm, prompt)
    assert bm.num_blocks - bm.num_free_blocks == 3

    # the step must sample from the last token's logits, so at most 2 of the 3 blocks are reused
    b = make_seq(prompt)
    bm.admit(b)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_table == a.block_table[:2]
    # one more token and all 3 full blocks are reused
    assert hit_tokens(bm, prompt + [13]) == 12
    bm.release(a)
    bm.release(b)
    assert_all_free(bm)


def test_commit_registers_only_full_computed_blocks():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(1, 12))                      # 11 tokens
    a = make_seq(prompt)
    bm.admit(a)
    assert bm.allocate_slots(a, 6)                   # a first chunk of 6: one full block
    a.num_computed_tokens = 6
    bm.commit(a)
    assert hit_tokens(bm, prompt) == 4

    assert bm.allocate_slots(a, 5)
    a.num_computed_tokens = 11
    bm.commit(a)
    assert hit_tokens(bm, prompt + [12, 13]) == 8    # the third block holds 3 tokens: not registered

    a.token_ids.append(12)                           # sampled, not yet computed: block 3 full but not in cache
    bm.commit(a)
    assert hit_tokens(bm, prompt + [12, 13]) == 8
    assert bm.allocate_slots(a, 1)
    a.num_computed_tokens = 12
    bm.commit(a)
    assert hit_tokens(bm, prompt + [12, 13]) == 12
    bm.release(a)
    assert_all_free(bm)


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq(list(range(1, 14)))                 # needs 4 blocks
    bm.admit(a)
    assert not bm.allocate_slots(a, a.num_tokens)
    assert a.block_table == []
    assert_all_free(bm)
    assert bm.allocate_slots(a, 12)
    assert bm.num_free_blocks == 0
    bm.release(a)
    assert_all_free(bm)


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(1, 10))
    a = prefill(bm, prompt)
    b = make_seq(prompt)
    bm.admit(b)
    assert b.block_table == [] and b.num_computed_tokens == 0
    bm.release(a)
    assert hit_tokens(bm, prompt) == 0
    assert_all_free(bm)


def test_blocks_are_shared_only_between_sequences_of_the_same_cache_salt():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(1, 14))                      # 3 full blocks + 1 token
    a = prefill(bm, prompt, cache_salt="tenant-a")
    assert hit_tokens(bm, prompt, "tenant-a") == 12
    assert hit_tokens(bm, prompt, "tenant-b") == 0   # another salt: not even the first block
    assert hit_tokens(bm, prompt) == 0               # no salt is a salt of its own
    b = prefill(bm, prompt)
    assert hit_tokens(bm, prompt) == 12
    assert hit_tokens(bm, prompt, "tenant-a") == 12  # each keeps its own copy
    assert not set(a.block_table) & set(b.block_table)
    bm.release(a)
    bm.release(b)
    assert_all_free(bm)


def decode(bm: BlockManager, seq: Sequence, steps: int) -> None:
    """`steps` decode steps, each computing the last token and appending the next, committed."""
    for _ in range(steps):
        assert bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        seq.token_ids.append(7)
        bm.commit(seq)


def test_a_sliding_window_gives_back_the_blocks_no_query_attends_again():
    # window 6, blocks of 4: the query at p attends keys p-5..p, so keys < p-5 are behind every later one
    bm = BlockManager(num_blocks=16, block_size=BS, window=6)
    seq = prefill(bm, list(range(1, 12)))            # keys 0-10 computed; next query at 11: keys 6.. live
    assert seq.num_dropped_blocks == 0               # dropped when the next step is placed
    decode(bm, seq, 1)                               # placed at p=11: block 0 (keys 0-3) is behind 6
    assert seq.num_dropped_blocks == 1 and len(seq.block_table) == 3
    held = seq.block_table[1:]
    assert seq.block_table[0] == held[0]             # the stand-in: finite data that the kernels mask
    assert bm.num_free_blocks == 16 - 2
    decode(bm, seq, 8)                               # placed up to p=19: keys < 14 behind, blocks 0-2
    assert seq.num_dropped_blocks == 3 and len(seq.block_table) == 5
    assert seq.block_table[:3] == [seq.block_table[3]] * 3
    assert bm.num_free_blocks == 16 - 2
    assert sum(bm.ref_counts) == 2
    assert_all_free(bm, seq)


def test_a_sequence_longer_than_the_pool_runs_through_its_window():
    # 3 blocks hold 12 keys; a window of 5 keeps at most 2 blocks live, plus the one being filled
    bm = BlockManager(num_blocks=3, block_size=BS, window=5)
    seq = prefill(bm, [1, 2, 3])
    decode(bm, seq, 60)
    assert seq.num_tokens == 63 and len(seq.block_table) == 16
    assert bm.num_free_blocks == 1 and len(set(seq.block_table)) == 2
    assert_all_free(bm, seq)


def test_blocks_dropped_behind_the_window_stay_in_the_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=BS, window=4)
    prompt = list(range(1, 14))
    a = prefill(bm, prompt)
    decode(bm, a, 1)                                 # p=13: keys < 10 behind, blocks 0 and 1 dropped
    assert a.num_dropped_blocks == 2
    assert hit_tokens(bm, prompt) == 12              # kept under their hashes, as a finished sequence's are
    assert_all_free(bm, a)


def test_a_block_dropped_before_its_step_was_committed_is_not_cached():
    # pipelined steps: the next step is placed before the last one's tokens are read back and committed.
    # A block behind the window by then may already be another sequence's: it must not be registered
    bm = BlockManager(num_blocks=8, block_size=BS, window=2)
    seq = make_seq(list(range(1, 11)))
    bm.admit(seq)
    assert bm.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10
    first_two = seq.block_table[:2]
    assert bm.allocate_slots(seq, 1)                 # placed at p=10 before the commit: keys < 9 behind
    assert seq.num_dropped_blocks == 2
    other = prefill(bm, [50, 51, 52, 53, 54])        # takes the blocks just given back
    assert set(other.block_table) == set(first_two)
    bm.commit(seq)
    assert hit_tokens(bm, list(range(1, 11))) == 0   # the chain's first blocks are not registered
    assert hit_tokens(bm, [50, 51, 52, 53, 54]) == 4
    assert_all_free(bm, seq, other)


def test_without_a_window_nothing_is_dropped():
    bm = BlockManager(num_blocks=32, block_size=BS)
    seq = prefill(bm, list(range(1, 12)))
    decode(bm, seq, 40)
    assert seq.num_dropped_blocks == 0 and len(set(seq.block_table)) == len(seq.block_table) == 13
    assert_all_free(bm, seq)


def occupy(bm: BlockManager, num_tokens: int) -> Sequence:
    """A sequence of tokens no other shares, holding blocks for all of them: the eviction of others'."""
    seq = make_seq(list(range(100, 100 + num_tokens)))
    bm.admit(seq)
    assert seq.num_cached_tokens == 0 and bm.allocate_slots(seq, num_tokens)
    return seq


def test_under_a_window_a_prefix_hit_needs_only_the_blocks_its_window_reaches():
    bm = BlockManager(num_blocks=8, block_size=BS, window=6)
    a = prefill(bm, list(range(1, 22)))              # 21 tokens: blocks 0-4 full and cached, 5 partial
    decode(bm, a, 3)                                 # placed at p=21: keys < 16 behind, blocks 0-3 given back
    tokens = list(a.token_ids)                       # 24 tokens, 6 full blocks
    assert a.num_dropped_blocks == 4
    bm.release(a)
    b = occupy(bm, 16)                               # 4 blocks: the 2 never used, then the oldest given back
    c = make_seq(tokens + [9])
    bm.admit(c)                                      # blocks 0-1 evicted; 2-5 still cached
    # a query at 24 attends keys 19-24: blocks 4 and 5 suffice, and every later query needs no more
    assert c.num_cached_tokens == 24
    assert c.num_dropped_blocks == 4 and c.block_table[:4] == [c.block_table[4]] * 4
    assert sum(bm.ref_counts) == 4 + 2
    assert bm.allocate_slots(c, 1)
    assert_all_free(bm, b, c)


def test_without_a_window_a_prefix_hit_stops_at_the_first_evicted_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = prefill(bm, list(range(1, 22)))
    bm.release(a)                                    # tail first: blocks 5, 4, ... are evicted first
    b = occupy(bm, 12)                               # the 2 never used and block 5 (uncached, partial)
    assert hit_tokens(bm, list(range(1, 22))) == 20
    assert bm.allocate_slots(b, 16)                  # one block more: evicts block 4
    assert hit_tokens(bm, list(range(1, 22))) == 16
    assert_all_free(bm, b)
