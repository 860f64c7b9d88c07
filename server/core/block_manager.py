"""CPU bookkeeping of the paged KV cache: which blocks each request holds, and which full blocks are
cached by content so a later request with the same prefix can reuse them. Never touches tensors.

A block is in exactly one of three states:
    referenced   ref_count > 0, listed in some request's block_ids
    evictable    ref_count == 0 but hashed (its KV is still valid); LRU order, oldest evicted first
    free         ref_count == 0, no hash; handed out before any evictable block is evicted

Block hashes are chained: hash_i = H(hash_{i-1}, tokens of block i), so a hit on block i means blocks
0..i all match. Worked example, block_size 4, request A = [1..10] computed, then freed:
    A's full blocks [1,2,3,4] -> h0, [5,6,7,8] -> h1 (tokens 9, 10 sit in a partial block, never hashed)
    B = [1,2,3,4, 5,6,7,8, 9,9]  -> hits h0, h1: get_computed_blocks returns 8
    C = [1,2,3,4, 5,6,7,8]       -> whole sequence cached, but 1 token must remain to compute: returns 4
    D = [0,0,0,0, 5,6,7,8, 1]    -> block 1 has A's content after another prefix: no hit, returns 0
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

from moe_serve.server.core.request import Request


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Deterministic across processes and runs (unlike Python's salted hash of str/bytes)."""
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class BlockManager:
    """CPU bookkeeping of paged KV blocks. Never touches tensors."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free_blocks: deque[int] = deque(range(num_blocks))       # popleft to allocate
        self.evictable: OrderedDict[int, None] = OrderedDict()       # oldest first
        self.req_hashes: dict[str, list[bytes]] = {}  # request_id -> hashes of its registered blocks
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references: the free list plus evictable cached blocks."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, in [0, 1]."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> int:
        """Reference the longest cached prefix of full blocks of a request that holds no blocks yet;
        return the number of tokens it covers (a multiple of block_size, < request.num_tokens)."""
        if not self.enable_prefix_caching:
            return 0
        assert not request.block_ids, f"{request.request_id} already holds blocks"
        tokens, bs = request.all_token_ids, self.block_size
        max_blocks = (len(tokens) - 1) // bs   # leave at least one token to compute
        hashes: list[bytes] = []
        for i in range(max_blocks):
            h = hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs])
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hashes.append(h)
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            request.block_ids.append(block)
        if hashes:
            self.req_hashes[request.request_id] = hashes
        num_hit = len(hashes) * bs
        self.prefix_cache_query_tokens += len(tokens)
        self.prefix_cache_hit_tokens += num_hit
        return num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow request.block_ids to cover num_computed_tokens + num_new_tokens tokens. Returns False,
        allocating nothing, if there are not enough unreferenced blocks."""
        need = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            block = self.free_blocks.popleft() if self.free_blocks else self._evict_oldest()
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def _evict_oldest(self) -> int:
        block, _ = self.evictable.popitem(last=False)
        h = self.block_hash[block]
        if self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        return block

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the hashes of the request's blocks that are now full of computed tokens. A block
        whose content is already cached under another block id stays unregistered (no dedupe)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes.setdefault(request.request_id, [])
        tokens, bs = request.all_token_ids, self.block_size
        for i in range(len(hashes), num_computed_tokens // bs):
            h = hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs])
            hashes.append(h)
            block = request.block_ids[i]
            if h not in self.hash_to_block and self.block_hash[block] is None:
                self.hash_to_block[h] = block
                self.block_hash[block] = h

    def free(self, request: Request) -> None:
        """Drop the request's references, last block first, so its tail is evicted before its prefix
        (a tail is less likely to be shared)."""
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None   # newest at the end, evicted last
                else:
                    self.free_blocks.append(block)
        request.block_ids = []
        self.req_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes. Refuses (returns False) while any request holds blocks."""
        if self.num_free_blocks != self.num_blocks:
            return False
        while self.evictable:
            self.free_blocks.append(self._evict_oldest())
        self.hash_to_block.clear()
        self.req_hashes.clear()
        return True
