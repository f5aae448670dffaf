"""`kvstore events`: subscribe to the daemon's KV events (vLLM's format, server/event_wire.py) and print them.

The endpoints come from the daemon (its hello over the socket) unless given
with `--endpoint`/`--replay`. `--from-seq N` first asks the replay socket for
every batch it still holds from N on, then follows the live stream without
printing a batch twice. Both encodings (maps with "type", tagged arrays) are read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvstore.client import KVClient
from kvstore.errors import KVStoreError
from kvstore.server.event_wire import WireError, decode_batch

END_SEQ = -1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="print the daemon's KV events (vLLM's KVEventBatch over ZMQ)")
    p.add_argument("--socket", help="the daemon's Unix socket, to learn its event endpoints (default: the per-user one)")
    p.add_argument("--endpoint", help="subscribe here instead of asking the daemon, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay", help="the replay (ROUTER) endpoint, for --from-seq")
    p.add_argument("--from-seq", type=int, help="first print the buffered batches from this sequence number on")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--count", type=int, help="exit after this many batches")
    p.add_argument("--timeout", type=float, help="exit after this many seconds (exit 1 if nothing arrived)")
    p.add_argument("--json", action="store_true", help="one JSON object per batch")
    p.set_defaults(run=run)


def _local(endpoint: str) -> str:
    """A bound wildcard address, as a subscriber on this host connects to it."""
    return endpoint.replace("://0.0.0.0:", "://127.0.0.1:").replace("://*:", "://127.0.0.1:")


def _endpoints(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.endpoint:
        return args.endpoint, args.replay
    with KVClient(args.socket, name="kvstore-events") as client:
        events = client.server_info.get("events")
    if not events:
        raise KVStoreError("the daemon publishes no KV events; set [events] endpoint in its config "
                           "(or kvstore serve --events-endpoint tcp://127.0.0.1:5557)")
    replay = args.replay or events.get("replay_endpoint")
    return _local(events["endpoint"]), _local(replay) if replay else None


def run(args: argparse.Namespace) -> int:
    try:
        import zmq
    except ImportError:
        print("kvstore: `kvstore events` needs pyzmq (pip install 'kvstore[events]')", file=sys.stderr)
        return 1
    try:
        endpoint, replay = _endpoints(args)
    except KVStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1
    if args.from_seq is not None and replay is None:
        print("kvstore: --from-seq needs a replay endpoint (the daemon's [events] replay_endpoint, or --replay)",
              file=sys.stderr)
        return 1
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(endpoint)  # before the replay: what is published meanwhile is not missed
    printed = 0
    last_seq = None
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        if args.from_seq is not None:
            for topic, seq, payload in _replayed(ctx, replay, args.from_seq, args.topic.encode(), deadline):
                _print(topic, seq, payload, args.json)
                printed, last_seq = printed + 1, seq
                if args.count is not None and printed >= args.count:
                    return 0
        while args.count is None or printed < args.count:
            wait_ms = 1000 if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)
            if deadline is not None and wait_ms == 0:
                break
            if not sub.poll(wait_ms):
                continue
            topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if last_seq is not None and seq <= last_seq:
                continue  # the replay printed it already
            _print(topic, seq, payload, args.json)
            printed, last_seq = printed + 1, seq
    except KeyboardInterrupt:
        return 0
    except KVStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1
    finally:
        sub.close()
    if printed == 0 and deadline is not None:
        print(f"kvstore: no KV events on {endpoint} within {args.timeout:g} s", file=sys.stderr)
        return 1
    return 0


def _replayed(ctx, endpoint: str, start: int, prefix: bytes, deadline: float | None):
    import zmq

    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    try:
        req.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            wait_ms = 5000 if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)
            if not req.poll(wait_ms):
                raise KVStoreError(f"the replay endpoint {endpoint} did not answer")
            _, topic, seq_bytes, payload = req.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                return
            if topic.startswith(prefix):
                yield topic, seq, payload
    finally:
        req.close()


def _hex(value):
    return value.hex() if isinstance(value, bytes) else value


def _print(topic: bytes, seq: int, payload: bytes, as_json: bool) -> None:
    try:
        batch = decode_batch(payload)
    except WireError as exc:
        print(f"#{seq} {topic.decode(errors='replace')}: undecodable payload ({exc})", flush=True)
        return
    if as_json:
        events = [{k: ([_hex(h) for h in v] if k == "block_hashes" else _hex(v)) for k, v in e.items()}
                  for e in batch["events"]]
        print(json.dumps({"seq": seq, "topic": topic.decode(errors="replace"), "ts": batch["ts"], "events": events}),
              flush=True)
        return
    print(f"#{seq} {topic.decode(errors='replace')}  {len(batch['events'])} events", flush=True)
    for e in batch["events"]:
        hashes = e.get("block_hashes") or []
        shown = ", ".join(_hex(h)[:12] for h in hashes[:3]) + (", ..." if len(hashes) > 3 else "")
        line = f"  {e['type']:16} {e.get('medium') or '':8}"
        if hashes:
            line += f" {len(hashes)} blocks [{shown}]"
        if e["type"] == "BlockStored":
            parent = e.get("parent_block_hash")
            line += (f" parent {_hex(parent)[:12] if parent else '-'}, {len(e.get('token_ids') or [])} tokens, "
                     f"block_size {e.get('block_size')}")
        print(line, flush=True)
