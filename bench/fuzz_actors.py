"""Hostile input at live actors: thousands of fuzzed deliveries over RabbitMQ, every one accounted for.

    python bench/fuzz_actors.py [--messages 3000] [--seed 0]

The longer run of ``tests/integration/test_fuzz_process.py``, with the same generators
(``tests/support/fuzz.py``) and the same cluster (``tests/support/fuzz_cluster.py``): every role its
own ``parkway actor`` process, the deliveries spread over their queues in turn, hypothesis drawing
them from a fixed seed. Then the fate of each (refused by code, answered, no reply) per category is
printed as a table, the processes must all be the ones that started, no delivery may have been
``internal``, and a fresh controller must seal every rollout of a workload over the fuzzed
participants. Writes ``bench/results/fuzz_actors.json``.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package
_sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))  # the fuzzers live in tests/support

import functools
import json
import subprocess
import tempfile
import time
from collections import Counter

import common
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from parkway.actors.launch.roles import ROLES
from parkway.brokers.memory import MemoryBroker, MemoryHub

from tests.support.fuzz import fuzzed
from tests.support.fuzz_cluster import TARGETS, FuzzCluster, table
from tests.support.processes import actor_env, status_of
from tests.support.rabbit import AMQP_URL

CONFIG = """
run: fuzzb
seed: 11
policy: {host: inline, per_token_delay_s: 0.001}
tasks: {builtin: bank, limit: 4}
rollout: {group_size: 2, max_turns: 4}
topology: {agents: 1, resources: 1}
trainer: {batch_groups: 1, checkpoint_every: 1}
snapshot_interval_s: 0.2
"""


@functools.cache
def handled_types(address: str) -> tuple[str, ...]:
    actor = ROLES[address.split("/")[0]](MemoryBroker(MemoryHub(), "types"), secret=b"x")
    return tuple(cls.__name__ for cls in actor.handlers)


def fuzz(cluster: FuzzCluster, messages: int, fixed_seed: int) -> None:
    """Draw ``messages`` deliveries (a burst counts once here), each to a role drawn with it."""

    @seed(fixed_seed)
    @settings(
        max_examples=messages,
        phases=[Phase.generate],  # no shrinking: nothing here fails, it is counted
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        address = data.draw(st.sampled_from(TARGETS))
        cluster.send(address, data.draw(fuzzed(focus=handled_types(address))))

    one()


def workload(cluster: FuzzCluster) -> dict[str, object]:
    """Stop the fuzzed controller; a fresh one runs a whole workload over the fuzzed participants."""
    controller = cluster.processes["controller/0"]
    controller.stop()
    result = subprocess.run(
        [_sys.executable, "-m", "parkway.actors", "run", "--config", str(cluster.config), "--json"],
        env=actor_env(cluster.run, cluster.state, PARKWAY_BROKER_URL=AMQP_URL),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise SystemExit(f"the workload after the fuzz failed:\n{result.stderr[-3000:]}")
    summary: dict[str, object] = json.loads(result.stdout)
    return summary


def main() -> None:
    parser = common.parser(__doc__)
    common.add_name(parser, "fuzz_actors")
    parser.add_argument("--messages", type=int, default=3000, help="fuzzed draws in all (a burst is one)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    args = parser.parse_args()
    began = common.machine()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="parkway-fuzz-") as root:
        cluster = FuzzCluster(_Path(root), CONFIG)
        try:
            fuzz(cluster, args.messages, args.seed)
            cluster.runner.run(cluster.settle())
            outcomes, others = cluster.runner.run(cluster.outcomes())
            alive = {a: p.alive() for a, p in cluster.processes.items()}
            pids = {a: cluster.runner.run(_pid(cluster, a)) for a in TARGETS}
            fuzzed_s = time.monotonic() - start
            summary = workload(cluster)
        finally:
            cluster.close()
    fates = Counter(o.fate for o in outcomes)
    print(table(outcomes))
    internal = fates["refused:internal"] + sum(1 for x in others if x.code == "internal")
    survived = all(alive.values()) and pids == cluster.pids
    sealed = f"{summary['rollouts_sealed']}/{summary['rollouts_expected']}"
    print(
        f"\n{len(outcomes)} deliveries ({args.messages} draws), internal: {internal}, "
        f"every process survived: {survived}, the workload after sealed {sealed} "
        f"({summary['snapshots_published']} snapshots); {fuzzed_s:.0f} s to start, fuzz and settle"
    )
    rows: dict[str, Counter[str]] = {}
    for o in outcomes:
        rows.setdefault(o.sent.category, Counter())[o.fate] += 1
    results = {
        "deliveries": len(outcomes),
        "fuzz_s": round(fuzzed_s, 1),
        "by_category": {k: dict(v) for k, v in rows.items()},
        "other_dead_letters": Counter(x.code for x in others),
        "internal": internal,
        "survived": survived,
        "workload": summary,
    }
    common.write_record(args.name, "fuzz_actors", began, args, results)
    if internal or not survived or summary["rollouts_sealed"] != summary["rollouts_expected"]:
        raise SystemExit(1)


async def _pid(cluster: FuzzCluster, address: str) -> int:
    return (await status_of(cluster.client, address)).pid


if __name__ == "__main__":
    main()
