"""KV-cache events in vLLM's wire format, for prefix-aware routers (llm-d's KV-cache indexer, NVIDIA Dynamo,
SGLang's router): `nanoinfer serve --kv-events tcp://*:5557` publishes, on a ZMQ PUB socket, what the prefix cache
stores and evicts, so a router knows which replica holds which prefix. Off by default; needs the `kv-events`
extra (pyzmq, msgpack).

Each message is vLLM's ZmqEventPublisher's three frames: the topic (b"", or --kv-events-topic), an 8-byte
big-endian sequence number from 0, and a msgpack payload, a `KVEventBatch` encoded as vLLM's msgspec structs with
`array_like=True` (fields in declaration order, each event led by its tag, as vLLM 0.10-0.11 and llm-d's decoder
read them):

    KVEventBatch       [ts (float, unix seconds), [event, ...], data_parallel_rank (0)]
    BlockStored        ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved       ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared   ["AllBlocksCleared"]

One BlockStored per cached block (block_hashes holds its one hash; token_ids its block_size token ids;
parent_block_hash the block before it in the prompt, nil for a prompt's first block), sent the step the block
enters the prefix cache; one BlockRemoved per evicted block; AllBlocksCleared when the server stops (its cache is
gone). lora_id is nil; medium is "CPU" (or "GPU" for a model on a GPU). block_size is the pool's block (4 tokens).
A model with several layer groups (Gemma 3's sliding windows) reports its first group's blocks: a prefix hit
needs those.

Block hashes: the prefix cache's own chain names as unsigned 64-bit ints. A block's name is
blake2b(digest_size=16) over (parent name, or b"" for a first block) + b"|" + its token ids as decimal text
joined by ","; the hash sent is that digest's first 8 bytes, big-endian. There is no seed: the same tokens give
the same hashes on every replica and across restarts. vLLM instead hashes sha256 over pickle or CBOR of
(parent hash, token ids, extra keys), its first block's parent a NONE_HASH that is random per process unless
PYTHONHASHSEED is set; so our hashes are not vLLM's for the same tokens. A consumer that only matches the hashes
an engine sent (and the token ids each event carries) reads both alike; one that recomputes hashes from a
request's tokens must compute ours for a nanoinfer replica.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

HWM = 100_000                   # messages the PUB socket queues for a slow subscriber before it drops


def block_hash(name: bytes) -> int:
    """The hash sent for a block of chain `name` (kv.pool.BlockPool.names): its first 8 bytes, big-endian."""
    return int.from_bytes(name[:8], "big")


class KVEventPublisher:
    """A BlockPool's listener that sends each change as a KVEventBatch. Called on the engine's thread only (a
    ZMQ socket is used by one thread at a time); sending never blocks (past HWM a slow subscriber loses
    messages, as with vLLM)."""

    def __init__(self, endpoint: str, block_size: int, medium: str = "CPU", topic: str = ""):
        try:
            import msgpack
            import zmq
        except ImportError:
            raise ValueError("--kv-events needs pyzmq and msgpack: pip install 'nanoinfer[kv-events]'") from None
        self.pack = msgpack.packb
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.set_hwm(HWM)
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self.socket.bind(endpoint)            # vLLM's rule: a wildcard binds, an address connects
            else:
                self.socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self.socket.close(linger=0)
            raise ValueError(f"--kv-events {endpoint}: {exc}") from None
        self.block_size, self.medium, self.topic = block_size, medium, topic.encode()
        self.seq = 0

    def blocks_stored(self, blocks: Sequence[tuple[bytes, bytes | None, Sequence[int]]]) -> None:
        self._send([["BlockStored", [block_hash(name)], None if parent is None else block_hash(parent),
                     list(tokens), self.block_size, None, self.medium] for name, parent, tokens in blocks])

    def blocks_removed(self, names: Sequence[bytes]) -> None:
        self._send([["BlockRemoved", [block_hash(name) for name in names], self.medium]])

    def close(self) -> None:
        """Say the cache is gone (AllBlocksCleared), then close the socket (waiting up to 1 s to send)."""
        self._send([["AllBlocksCleared"]])
        self.socket.close(linger=1000)

    def _send(self, events: list) -> None:
        payload = self.pack([time.time(), events, 0])
        self.socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
