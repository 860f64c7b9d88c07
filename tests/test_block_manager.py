import random
import subprocess
import sys

from moe_serve.server.core.block_manager import BlockManager, hash_block
from moe_serve.server.core.request import Request
from moe_serve.server.core.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def compute_all(bm, r):
    """What the scheduler + engine do for a fresh request: prefix hit, allocate, compute everything."""
    r.num_computed_tokens = bm.get_computed_blocks(r)
    assert bm.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
    r.num_computed_tokens = r.num_tokens
    bm.cache_blocks(r, r.num_computed_tokens)


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = req("a", range(9))                      # 9 tokens -> 3 blocks
    assert bm.allocate_slots(r, 9)
    assert r.block_ids == [0, 1, 2] and bm.num_free_blocks == 7 and bm.usage == 0.3
    r.num_computed_tokens = 9
    assert bm.allocate_slots(r, 3)              # 12 tokens still fit in 3 blocks
    assert len(r.block_ids) == 3
    assert bm.allocate_slots(r, 4)              # 13 tokens -> 4th block
    assert r.block_ids == [0, 1, 2, 3]
    big = req("b", range(40))
    assert not bm.allocate_slots(big, 40)       # needs 10, 6 free: nothing allocated
    assert big.block_ids == [] and bm.num_free_blocks == 6
    bm.free(r)
    assert r.block_ids == [] and bm.num_free_blocks == 10 and bm.usage == 0.0


def test_prefix_hit_only_full_blocks_and_leaves_one_token():
    # The worked example of the module docstring.
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req("a", range(1, 11))
    compute_all(bm, a)
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9])
    assert bm.get_computed_blocks(b) == 8
    assert b.block_ids == a.block_ids[:2]       # shared while a still runs
    assert bm.ref_counts[a.block_ids[0]] == 2
    c = req("c", range(1, 9))                   # exactly 2 full cached blocks: drop the last
    assert bm.get_computed_blocks(c) == 4 and c.block_ids == a.block_ids[:1]
    d = req("d", range(1, 4))                   # shorter than a block: nothing to hit
    assert bm.get_computed_blocks(d) == 0 and d.block_ids == []
    assert bm.prefix_cache_query_tokens == 10 + 10 + 8 + 3
    assert bm.prefix_cache_hit_tokens == 8 + 4


def test_hit_after_free_takes_block_out_of_evictable():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", range(9))
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    b = req("b", range(9))
    assert bm.get_computed_blocks(b) == 8
    assert bm.num_free_blocks == 2 and not bm.evictable
    b.num_computed_tokens = 8
    assert bm.allocate_slots(b, 1) and bm.num_free_blocks == 1


def test_chained_hashes_same_content_after_other_prefix_misses():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute_all(bm, req("a", [1, 1, 1, 1, 5, 6, 7, 8, 0]))
    d = req("d", [2, 2, 2, 2, 5, 6, 7, 8, 0])   # block 1 equal to a's block 1, block 0 differs
    assert bm.get_computed_blocks(d) == 0
    assert hash_block(None, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 1, 1, 1]), [5, 6, 7, 8])


def test_hash_is_deterministic_across_processes():
    code = "from moe_serve.server.core.block_manager import hash_block; print(hash_block(hash_block(None, [1, 2]), [3]).hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == hash_block(hash_block(None, [1, 2]), [3]).hex()


def test_lru_eviction_oldest_first_and_drops_hashes():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = req("a", [1, 2, 3]), req("b", [7, 8, 9])
    compute_all(bm, a)                          # a: blocks [0, 1], block 0 hashed
    compute_all(bm, b)                          # b: blocks [2, 3], block 2 hashed
    bm.free(a)                                  # evictable: 0 ; free: 1
    bm.free(b)                                  # evictable: 0, 2 ; free: 1, 3
    assert list(bm.evictable) == [0, 2] and list(bm.free_blocks) == [1, 3]
    c = req("c", [50, 51, 52, 53, 54, 55])
    assert bm.allocate_slots(c, 6)              # clean blocks first, then the oldest cached (0)
    assert c.block_ids == [1, 3, 0] and list(bm.evictable) == [2]
    assert bm.block_hash[0] is None and len(bm.hash_to_block) == 1
    assert bm.get_computed_blocks(req("a2", [1, 2, 3])) == 0   # a's prefix is gone
    assert bm.get_computed_blocks(req("b2", [7, 8, 9])) == 2   # b's survived


def test_free_reverse_order_evicts_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    compute_all(bm, a)                          # blocks [0, 1, 2]; 0 and 1 full and hashed
    bm.free(a)                                  # reversed: 2 -> free list, 1 then 0 -> evictable
    assert list(bm.evictable) == [1, 0] and list(bm.free_blocks) == [3, 2]
    b = req("b", [9] * 6)
    assert bm.allocate_slots(b, 6) and b.block_ids == [3, 2, 1]   # the tail block 1 goes first
    assert bm.get_computed_blocks(req("c", [1, 2, 9])) == 2        # the prefix block 0 survives


def test_no_leak_over_many_cycles():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4)
    live = []
    for step in range(500):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 4):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        prefix = [rng.randrange(3)] * 4         # few distinct prefixes -> frequent hits
        r = req(f"r{step}", prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 12))])
        r.num_computed_tokens = bm.get_computed_blocks(r)
        if bm.allocate_slots(r, r.num_tokens - r.num_computed_tokens):
            r.num_computed_tokens = r.num_tokens
            bm.cache_blocks(r, r.num_tokens)
            live.append(r)
        else:
            bm.free(r)
        referenced = sum(len(x.block_ids) for x in live)
        assert bm.num_free_blocks + len({b for x in live for b in x.block_ids}) == 32
        assert referenced == sum(bm.ref_counts)
    for r in live:
        bm.free(r)
    assert bm.num_free_blocks == 32 and sum(bm.ref_counts) == 0
    assert bm.prefix_cache_hit_tokens > 0


def test_disabled_prefix_caching_and_reset():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3])
    compute_all(bm, a)
    bm.free(a)
    assert bm.get_computed_blocks(req("b", [1, 2, 3])) == 0 and not bm.evictable
    bm = BlockManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3])
    compute_all(bm, a)
    assert not bm.reset_prefix_cache()          # a still holds blocks
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert not bm.hash_to_block and not bm.evictable and bm.num_free_blocks == 8
    assert bm.get_computed_blocks(req("b", [1, 2, 3])) == 0
