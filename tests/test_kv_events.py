"""KV-cache events in vLLM's wire format, read by a ZMQ subscriber on loopback and decoded by field order: a
prompt of several blocks gives one BlockStored per full block with its token ids, parents chained and hashes as
documented; evictions send BlockRemoved for stored blocks; closing sends AllBlocksCleared; `serve --kv-events`
refuses what cannot work, before the model loads."""

from __future__ import annotations

import pytest

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (the kv-events extra)")
msgpack = pytest.importorskip("msgpack", reason="KV events need msgpack (the kv-events extra)")

from nanoinfer.cli import main  # noqa: E402
from nanoinfer.engine import Engine  # noqa: E402
from nanoinfer.frontend.prompts import prompt_ids  # noqa: E402
from nanoinfer.kv_events import KVEventPublisher, block_hash  # noqa: E402
from nanoinfer.kv.budget import BLOCK_TOKENS  # noqa: E402
from nanoinfer.sampling import SamplingParams  # noqa: E402

RECEIVE_MS = 5000
PROMPT = "What is 123 times 45? Then add 6789 and divide by 3."


@pytest.fixture
def subscriber():
    """A SUB socket bound on 127.0.0.1 (the publisher connects, as vLLM's rule for an address says)."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, f"tcp://127.0.0.1:{port}"
    socket.close(linger=0)


def receive(socket) -> tuple[int, list]:
    """(sequence number, events) of the next KVEventBatch, decoded by vLLM's field order."""
    assert socket.poll(RECEIVE_MS), "no KV event arrived"
    topic, seq, payload = socket.recv_multipart()
    assert topic == b""
    ts, events, data_parallel_rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and data_parallel_rank == 0
    return int.from_bytes(seq, "big"), events


def connected(socket, publisher: KVEventPublisher) -> int:
    """Wait until the subscription reached the publisher (a PUB drops what it sends before): send removals of
    a made-up block until one arrives, then drain. The next sequence number."""
    for _ in range(100):
        publisher.blocks_removed([b"\xff" * 16])
        if socket.poll(50):
            break
    else:
        raise AssertionError("the subscriber never connected")
    seq = 0
    while socket.poll(200):
        seq, _ = receive(socket)
    return seq + 1


def test_a_prompt_of_several_blocks_is_stored_block_by_block_with_parents_chained(calc, subscriber):
    socket, endpoint = subscriber
    model, tokenizer = calc
    engine = Engine(model, tokenizer, prefix_cache_bytes=64 * 1024 * 1024)
    publisher = KVEventPublisher(endpoint, BLOCK_TOKENS)
    engine.pool.listener = publisher
    next_seq = connected(socket, publisher)
    ids = prompt_ids(tokenizer, PROMPT)
    full_blocks = len(ids) // BLOCK_TOKENS
    assert full_blocks >= 4
    engine.complete(ids, SamplingParams(temperature=0, max_tokens=3))

    cached = sum(name.endswith(b"\x00\x00") for name in engine.pool.cached)   # the first group's blocks
    stored = []
    while len(stored) < cached:        # every event was sent during complete(); each receive waits up to 5 s
        seq, events = receive(socket)
        assert seq == next_seq
        next_seq += 1
        stored += [event for event in events if event[0] == "BlockStored"]
    assert not socket.poll(200), "more events than blocks cached"
    assert all(len(event) == 7 for event in stored)
    hashes = [event[1] for event in stored]
    assert all(len(block) == 1 for block in hashes)              # one BlockStored per block
    names = engine.pool.names(ids, full_blocks)
    assert [block[0] for block in hashes[:full_blocks]] == [block_hash(name) for name in names]
    tokens = [event[3] for event in stored[:full_blocks]]
    assert tokens == [ids[i * BLOCK_TOKENS: (i + 1) * BLOCK_TOKENS] for i in range(full_blocks)]
    parents = [event[2] for event in stored]
    assert parents[0] is None
    assert parents[1:] == [block[0] for block in hashes[:-1]]    # the prompt's and then its answer's blocks
    assert {(event[4], event[5], event[6]) for event in stored} == {(BLOCK_TOKENS, None, "CPU")}
    publisher.close()


def test_evicted_blocks_are_removed_and_closing_clears_all(calc, subscriber):
    socket, endpoint = subscriber
    model, tokenizer = calc
    block_bytes = Engine(model, tokenizer).pool.block_bytes
    engine = Engine(model, tokenizer, prefix_cache_bytes=2 * block_bytes)     # keeps 2 idle blocks
    publisher = KVEventPublisher(endpoint, BLOCK_TOKENS)
    engine.pool.listener = publisher
    connected(socket, publisher)
    engine.complete(prompt_ids(tokenizer, PROMPT), SamplingParams(temperature=0, max_tokens=3))

    held = {block_hash(name[:-2]) for name in engine.pool.cached if name.endswith(b"\x00\x00")}
    assert len(held) == 2
    stored, removed = [], []
    while not stored or set(stored) - set(removed) != held:     # each receive waits up to 5 s
        _, events = receive(socket)
        stored += [event[1][0] for event in events if event[0] == "BlockStored"]
        removed += [block for event in events if event[0] == "BlockRemoved" for block in event[1]]
    assert not socket.poll(200), "more events than the blocks cached and evicted"
    assert len(removed) == len(stored) - 2 and set(removed) <= set(stored)
    publisher.close()
    _, events = receive(socket)
    assert events == [["AllBlocksCleared"]]


def test_serve_refuses_kv_events_without_a_prefix_cache_before_loading(capsys):
    code = main(["serve", "--model", "no-such-model", "--kv-events", "tcp://127.0.0.1:5557",
                 "--prefix-cache-gb", "0"])
    assert code == 2
    assert "--kv-events needs the prefix cache" in capsys.readouterr().err


def test_serve_with_kv_events_publishes_a_requests_blocks(subscriber):
    import httpx
    from serving import start_cli_server

    socket, endpoint = subscriber
    proc, url = start_cli_server("--kv-events", endpoint)
    try:
        for attempt in range(20):     # a PUB drops what it sends before the subscription reaches it: ask again
            question = f"Attempt {attempt}: {PROMPT}"      # new from its first block on
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": question, "max_tokens": 2,
                                                              "temperature": 0}, timeout=60)
            assert answer.status_code == 200
            if socket.poll(500):
                break
        _, events = receive(socket)
        assert {event[0] for event in events} == {"BlockStored"}      # the new blocks of one prompt, chained
        assert [event[2] for event in events[1:]] == [event[1][0] for event in events[:-1]]
        assert {len(event[3]) for event in events} == {BLOCK_TOKENS}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    _, events = receive(socket)
    while events != [["AllBlocksCleared"]]:
        _, events = receive(socket)
