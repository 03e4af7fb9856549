"""Store keys for KV blocks and state checkpoints.

A key names the deployment namespace explicitly *and* the chained block hash:

    kvsched/v1/<namespace root, 32 hex>/kv/<block hash, 32 hex>
    kvsched/v1/<namespace root, 32 hex>/st/<block hash, 32 hex>

``namespace_root`` (``identity.namespace_root``) digests the model, KV dtype and layout, block
size, adapter and cache salt; the block hash is chained from that root, so it already differs
between namespaces. Repeating the root in the key makes that independent of the hash: two
deployments never read each other's KV even if a chain hash collided, and a namespace's keys
share a prefix (``namespace_prefix``) for inspection or bulk removal.

A state key names the hybrid-model checkpoint (conv + recurrent state) taken at the boundary
*after* the block whose hash it carries: restoring it makes a prefix hit of exactly the blocks
up to and including that block usable.
"""

from __future__ import annotations

from kvsched.identity import DIGEST_SIZE

__all__ = ["KEY_VERSION", "block_key", "namespace_prefix", "parse_key", "state_key"]

KEY_VERSION = "v1"
_KIND_BLOCK = "kv"
_KIND_STATE = "st"


def _check(name: str, digest: bytes) -> str:
    if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
        raise ValueError(f"{name} must be {DIGEST_SIZE} bytes, got {digest!r:.60}")
    return digest.hex()


def namespace_prefix(namespace_root: bytes) -> str:
    """The common prefix of every key of one namespace."""
    return f"kvsched/{KEY_VERSION}/{_check('namespace_root', namespace_root)}/"


def block_key(namespace_root: bytes, block_hash: bytes) -> str:
    """Key of one KV block (all layers' K and V of the block's tokens)."""
    return f"{namespace_prefix(namespace_root)}{_KIND_BLOCK}/{_check('block_hash', block_hash)}"


def state_key(namespace_root: bytes, block_hash: bytes) -> str:
    """Key of the state checkpoint at the boundary after block ``block_hash`` (hybrid models)."""
    return f"{namespace_prefix(namespace_root)}{_KIND_STATE}/{_check('block_hash', block_hash)}"


def parse_key(key: str) -> tuple[bytes, str, bytes]:
    """Inverse of ``block_key`` / ``state_key``: ``(namespace_root, "kv" | "st", block_hash)``."""
    parts = key.split("/")
    if len(parts) != 5 or parts[0] != "kvsched" or parts[1] != KEY_VERSION:
        raise ValueError(f"not a kvsched {KEY_VERSION} key: {key!r}")
    if parts[3] not in (_KIND_BLOCK, _KIND_STATE):
        raise ValueError(f"unknown key kind {parts[3]!r} in {key!r}")
    root, digest = bytes.fromhex(parts[2]), bytes.fromhex(parts[4])
    if len(root) != DIGEST_SIZE or len(digest) != DIGEST_SIZE:
        raise ValueError(f"bad digest length in {key!r}")
    return root, parts[3], digest
