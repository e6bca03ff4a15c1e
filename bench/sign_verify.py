"""What a signature costs per message: sign at the sender and verify at the receiver, per body size.

    python bench/sign_verify.py [--sizes 128 4096 65536] [--rounds 7] [--messages 2000]

Each round signs ``--messages`` envelopes of one body size with a role's Ed25519 key (the sender's
``Client.envelope`` path: encode, sign the length-prefixed fields) and opens each at the receiver
(``Client.open``: verify, check the destination and the sender's right, decode). The same work with
the HMAC-SHA256 of the shared secret that it replaced is measured beside it, for scale. The figure is
the median over rounds of the per-message time, in microseconds. Writes
``bench/results/sign_verify.json``.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import statistics
import time
from typing import Any

from parkway.actors.runtime.client import Client
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol import codec
from parkway.protocol.messages import Probe
from parkway.protocol.signing import Keyring

RESULTS = _Path(__file__).resolve().parent / "results" / "sign_verify.json"


def hmac_round(probes: list[Probe], secret: bytes) -> float:
    """The replaced scheme: HMAC over the routing facts and the body, at both ends."""
    start = time.perf_counter()
    for probe in probes:
        body = codec.encode(probe)
        head = "\n".join(("parkway-v1", "bench", "controller/0", probe.checkpoint_id, codec.MSGPACK)).encode()
        signature = hmac.new(secret, head + b"\n" + body, hashlib.sha256).hexdigest()
        expected = hmac.new(secret, head + b"\n" + body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(signature, expected)
        codec.decode(body, codec.MSGPACK)
    return time.perf_counter() - start


def ed25519_round(probes: list[Probe], sender: Client, receiver: Client) -> float:
    start = time.perf_counter()
    for probe in probes:
        envelope = sender.envelope(probe, correlation_id=probe.checkpoint_id, to="resources/0")
        receiver.open(envelope)
    return time.perf_counter() - start


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    keys = Keyring.generate()
    rows = []
    async with MemoryBroker(MemoryHub(), "bench") as broker:
        sender = Client(broker, keyring=keys.only(["controller"]), sender="controller/0")
        receiver = Client(broker, keyring=keys.only(["resources"]), sender="resources/0")
        for size in args.sizes:
            probes = [
                Probe(checkpoint_id=f"ck-{i}", deadline=time.time() + 60, note="x" * size)
                for i in range(args.messages)
            ]
            ed, hm = [], []
            for _ in range(args.rounds):
                ed.append(ed25519_round(probes, sender, receiver) / args.messages * 1e6)
                hm.append(hmac_round(probes, b"s" * 32) / args.messages * 1e6)
            rows.append(
                {
                    "body_bytes": len(codec.encode(probes[0])),
                    "ed25519_sign_verify_us_median": round(statistics.median(ed), 1),
                    "ed25519_rounds_us": [round(v, 1) for v in ed],
                    "hmac_sign_verify_us_median": round(statistics.median(hm), 1),
                }
            )
            print(
                f"body {rows[-1]['body_bytes']:>6} B: ed25519 sign+verify+decode "
                f"{rows[-1]['ed25519_sign_verify_us_median']:>7} us/message, "
                f"hmac {rows[-1]['hmac_sign_verify_us_median']:>6} us (median of {args.rounds} rounds)"
            )
    return {
        "command": "python bench/sign_verify.py " + " ".join(_sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average": os.getloadavg(),
        "messages_per_round": args.messages,
        "rounds": args.rounds,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 4096, 65536])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--messages", type=int, default=2000)
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
