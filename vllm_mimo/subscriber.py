"""`vllm-mimo events ENDPOINT`: follow an engine's KV cache events, one JSON line per event.

vLLM's ZMQ publisher (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": ...}'`) binds its endpoint when it has a `*` (or `::`, or is `ipc://` / `inproc://`)
and connects to it otherwise. The subscriber takes the other side by the same rule: an endpoint
with a `*` it binds, any other it connects to. So an engine started with `tcp://*:5557` is
followed with `vllm-mimo events tcp://HOST:5557`, and one started with `tcp://HOST:5557` with
`vllm-mimo events 'tcp://*:5557'` on HOST (`ipc://PATH`: the engine binds, the subscriber
connects). Each message is a batch (one per engine step with events); each line is one event
of it with the batch's sequence number, time and data-parallel rank, the event's type and its
fields as vLLM publishes them (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import IO, Any

DESCRIPTION = "Print a vLLM engine's KV cache events (--kv-events-config, publisher zmq), one JSON line per event."
EPILOG = (
    "An ENDPOINT with '*' is bound (the engine connects: its endpoint has no '*'); any other is "
    "connected to (the engine binds: its endpoint has '*', or is ipc://)."
)


def binds(endpoint: str) -> bool:
    """Whether the subscriber binds `endpoint` (a `*` in it) rather than connecting to it."""
    return "*" in endpoint


def event_lines(seq: int, batch: Any) -> list[str]:
    """One JSON line per event of a decoded `KVEventBatch`."""
    import msgspec

    head = {"seq": seq, "ts": batch.ts, "dp_rank": batch.data_parallel_rank}
    return [
        json.dumps({**head, "type": type(event).__name__, **msgspec.structs.asdict(event)}, default=repr)
        for event in batch.events
    ]


def follow(endpoint: str, topic: str = "", count: int = 0, seconds: float = 0.0, out: IO[str] = sys.stdout) -> int:
    """Print events from `endpoint` until `count` events (0: no limit) or `seconds` without one
    (0: wait forever); returns the number printed."""
    import msgspec
    import zmq

    from vllm_mimo.compat import KVEventBatch

    socket: Any = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    (socket.bind if binds(endpoint) else socket.connect)(endpoint)
    print(f"vllm-mimo events: {'bound' if binds(endpoint) else 'connected to'} {endpoint}", file=sys.stderr, flush=True)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    printed = 0
    try:
        while not count or printed < count:
            if seconds and not socket.poll(int(seconds * 1000)):
                break
            _, seq, payload = socket.recv_multipart()
            for line in event_lines(int.from_bytes(seq, "big", signed=True), decoder.decode(payload)):
                print(line, file=out, flush=True)
                printed += 1
    finally:
        socket.close(linger=0)
    return printed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoint", metavar="ENDPOINT", help="ZMQ endpoint: tcp://HOST:PORT, 'tcp://*:PORT' or ipc://PATH")
    parser.add_argument("--topic", default="", help="the engine's kv-events topic (default: every topic)")
    parser.add_argument("--count", type=int, default=0, metavar="N", help="exit after N events (default: never)")
    parser.add_argument("--idle-seconds", type=float, default=0.0, metavar="S",
                        help="exit after S seconds without a batch (default: wait forever)")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        printed = follow(args.endpoint, args.topic, args.count, args.idle_seconds)
    except KeyboardInterrupt:
        return 0
    print(f"vllm-mimo events: {printed} events in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0
