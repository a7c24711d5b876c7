"""`nanoinfer serve`: the OpenAI-compatible server (server/) over an engine loaded off the main thread."""

from __future__ import annotations

import argparse

from ..server import add_flags, check_flags, engine_options, serve
from .flags import add_model_flags, add_speculate_flags
from .loading import load_engine

ABOUT = "an OpenAI-compatible HTTP server and a web chat page"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    add_flags(parser)
    add_speculate_flags(parser)
    parser.add_argument("--kv-events", metavar="ENDPOINT",
                        help="publish the prefix cache's stored and evicted blocks as vLLM's KV events on a ZMQ PUB "
                             "socket, e.g. tcp://*:5557 (binds; an address without * connects); off by default "
                             "(kv_events.py; needs the kv-events extra)")
    parser.add_argument("--kv-events-topic", default="", help="the ZMQ topic of the KV events (default: none)")


def run(args: argparse.Namespace) -> int:
    from ..server.loop import off_the_main_thread

    check_flags(args)                                   # before any model loads
    if args.kv_events is None:
        return serve(off_the_main_thread(lambda: load_engine(args, **engine_options(args))), args)
    if args.prefix_cache_gb == 0:
        raise ValueError("--kv-events needs the prefix cache (--prefix-cache-gb > 0): its blocks are the events")
    from ..kv_events import KVEventPublisher
    from ..kv_pool import BLOCK_TOKENS

    publisher = KVEventPublisher(args.kv_events, BLOCK_TOKENS, topic=args.kv_events_topic)   # the endpoint checked
    try:
        engine = off_the_main_thread(lambda: load_engine(args, **engine_options(args)))
        publisher.medium = "GPU" if engine.model.device.type == "cuda" else "CPU"
        engine.pool.listener = publisher
        return serve(engine, args)
    finally:
        publisher.close()
