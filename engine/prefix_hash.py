"""The prefix cache's content names, shared by the engine (engine/cache/prefix.py) and the router
(router/prefix.py): chained page hashes, snapshot keys, their low 64 bits for the digest, with
MTP `page_name`, and a tenant's salted view of a prompt. Pure Python (hashlib), so importing it loads no torch."""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0  # the parent of a prompt's first page
MASK64 = (1 << 64) - 1


def block_hash(parent: int, tokens) -> int:
    """Content hash of a full page given its parent's: 128 bits, the same in every process."""
    h = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def prompt_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The chained hash of every full page of `tokens`."""
    out, parent = [], ROOT_HASH
    for j in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[j * block_size : (j + 1) * block_size])
        out.append(parent)
    return out


def salted(ids: list[int], salt: str) -> list[int]:
    """A tenant's view of a prompt (`cache_salt`, docs/prefix-caching.md): its first token replaced
    by a number from (salt, that token), 63 bits with bit 61 set, far above any vocabulary. Every
    page hash and snapshot key chains through the first token, so a salted prompt shares no cached
    state with an unsalted or differently salted one, and prompts with the same salt still do.
    No salt: `ids` itself."""
    if not salt or not ids:
        return ids
    h = hashlib.blake2b(salt.encode(), digest_size=8, person=b"pdserve-salt")
    h.update(ids[0].to_bytes(8, "little", signed=True))
    out = list(ids)
    out[0] = (int.from_bytes(h.digest(), "little") >> 3) | (1 << 61)
    return out


def prefix_key(parent: int, tail) -> int:
    """The name of a snapshot's prefix: the hash of its full pages (`parent`) chained with the
    tokens after them. A different salt from `block_hash`, so that a snapshot's key never equals a
    page's hash even when its tail is a full page's worth of tokens."""
    h = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16, person=b"pdserve-snapshot")
    h.update(array("q", tail).tobytes())
    return int.from_bytes(h.digest(), "little")


def page_name(h: int, after: int | None = None) -> int:
    """A page's name in a digest: `short(h)`, or with MTP drafting, where a cached page serves
    only a prompt whose token after it matches the one it was computed with
    (`BlockManager.after`), the short hash of (h, that token). The router names a prompt's page
    j with the prompt's token after it; a prompt that ends on the page has none, and the page
    never matches, as in the engine's lookup."""
    return short(h if after is None else block_hash(h, [after]))


def short(h: int) -> int:
    """The 64 bits of a hash a digest carries (a routing hint: a collision costs a cache miss)."""
    return h & MASK64
