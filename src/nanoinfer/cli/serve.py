"""`nanoinfer serve`: its flags, checked before any model loads, then the OpenAI-compatible server (server/)
over an engine loaded off the main thread.

    nanoinfer serve --model calc-nanochat --port 8000          # then open http://127.0.0.1:8000/
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "What is 6*7?"}]}'
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from .flags import add_model_flags, add_speculate_flags
from .loading import load_engine

ABOUT = "an OpenAI-compatible HTTP server and a web chat page"
DEFAULT_KV_MEMORY_GB = 2.0
DEFAULT_PREFIX_CACHE_GB = 0.5
PACKAGES = ("fastapi", "uvicorn", "pydantic")      # the `serve` extra; the engine itself needs none of them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on; 0.0.0.0 serves every interface (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="the TCP port to listen on (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("NANOINFER_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $NANOINFER_API_KEY, else none)")
    parser.add_argument("--kv-memory-gb", type=float, default=DEFAULT_KV_MEMORY_GB,
                        help="KV cache bound; requests past it wait in the queue (default %(default)s)")
    parser.add_argument("--prefix-cache-gb", type=float, default=DEFAULT_PREFIX_CACHE_GB,
                        help="KV of shared prompt prefixes kept for reuse (a hit equals a miss, bitwise); 0 turns "
                             "it off (default %(default)s)")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="rows (sequences) decoding together at most, as vLLM's --max-num-seqs or llama-server's "
                             "-np; more requests wait in the queue (default: the engine's bound, 64)")
    parser.add_argument("--max-pending", type=int, default=256,
                        help="requests in flight at most; past it the server answers 429 (default %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds SIGTERM waits for in-flight requests (default %(default)s)")
    add_speculate_flags(parser)
    parser.add_argument("--kv-events", metavar="ENDPOINT",
                        help="publish the prefix cache's stored and evicted blocks as vLLM's KV events on a ZMQ PUB "
                             "socket, e.g. tcp://*:5557 (binds; an address without * connects); off by default "
                             "(kv_events.py; needs the kv-events extra)")
    parser.add_argument("--kv-events-topic", default="", help="the ZMQ topic of the KV events (default: none)")


def run(args: argparse.Namespace) -> int:
    check_flags(args)                           # before any model loads or any server package is imported
    from ..server.loop import off_the_main_thread

    if args.kv_events is None:
        return serve(off_the_main_thread(lambda: load_engine(args, **engine_options(args))), args)
    if args.prefix_cache_gb == 0:
        raise ValueError("--kv-events needs the prefix cache (--prefix-cache-gb > 0): its blocks are the events")
    from ..kv_events import KVEventPublisher
    from ..kv.budget import BLOCK_TOKENS

    publisher = KVEventPublisher(args.kv_events, BLOCK_TOKENS, topic=args.kv_events_topic)   # the endpoint checked
    try:
        engine = off_the_main_thread(lambda: load_engine(args, **engine_options(args)))
        publisher.medium = "GPU" if engine.model.device.type == "cuda" else "CPU"
        engine.pool.listener = publisher
        return serve(engine, args)
    finally:
        publisher.close()


def serve(engine, args: argparse.Namespace) -> int:
    """Serve `engine` until SIGTERM (a drain, then exit with status 0)."""
    from ..server.app import create_app
    from ..server.running import DrainingServer

    app = create_app(engine, args.model, api_key=args.api_key, max_pending=args.max_pending,
                     drain_timeout=args.drain_timeout)
    print(f"[nanoinfer] serving {args.model} on http://{args.host}:{args.port}/ (chat page at /)",
          file=sys.stderr, flush=True)
    DrainingServer(app, args.host, args.port).run()
    return 0


def check_flags(args: argparse.Namespace) -> None:
    """Refuse, before any model loads, missing server packages and out-of-range flags."""
    missing = [package for package in PACKAGES if importlib.util.find_spec(package) is None]
    if missing:
        raise ValueError(f"nanoinfer serve needs the serve extra ({', '.join(missing)} not installed): "
                         f"pip install 'nanoinfer[serve]'")
    rows_out_of_range = args.max_rows is not None and args.max_rows < 1      # None: the engine's own bound
    if args.kv_memory_gb <= 0 or args.max_pending < 1 or args.prefix_cache_gb < 0 or rows_out_of_range:
        raise ValueError("--kv-memory-gb must be > 0, --prefix-cache-gb >= 0, --max-rows >= 1 and --max-pending >= 1")


def engine_options(args: argparse.Namespace) -> dict:
    """The Engine's bounds from the flags."""
    rows = {} if args.max_rows is None else {"max_rows": args.max_rows}
    return {"kv_memory_bytes": int(args.kv_memory_gb * 2**30), **rows,
            "prefix_cache_bytes": int(args.prefix_cache_gb * 2**30) or None}
