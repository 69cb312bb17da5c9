"""``moriio-fsm chaos``: the whole stack under every fault at once, seeded.

Run TRANSFERS transfers of both modes through the producer and consumer machines, their
drivers, the wire codec and loopback engines, losing, duplicating and delaying messages,
failing and stalling RDMA operations, leaving teardowns unanswered and crashing one rank;
judge every block with a ledger. The last line printed is the verdict, exactly
``transfers=<n> completed=<n> failed=<n> not_final=<n> double_handback=<n>
freed_in_flight=<n>``. Exit 0: every transfer ended and no block was handed back twice or
under an operation; 1 otherwise; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys

from ._command import add_command


def _chaos(args: argparse.Namespace) -> int:
    from ..chaos import ChaosSettings, ChaosUsageError, run_chaos

    try:
        settings = ChaosSettings(
            transfers=args.transfers, seed=args.seed, fault_rate=args.fault_rate, layers=args.layers
        )
    except ChaosUsageError as exc:
        print(f"moriio-fsm chaos: {exc}", file=sys.stderr)
        return 2
    print(
        f"chaos: {settings.transfers} transfers ({settings.layers} layers, both modes) between "
        f"{settings.producers} P and {settings.consumers} D ranks, seed {settings.seed}, "
        f"fault rate {settings.fault_rate:g}"
    )
    sys.stdout.flush()
    result = run_chaos(settings)
    faults = ", ".join(f"{name.replace('_', ' ')} {count}" for name, count in result.faults.items())
    print(f"faults injected: {faults}" + (f"; {result.crashed} crashed" if result.crashed else ""))
    for example in result.examples:
        print(f"  breach: {example}")
    for stuck in result.stuck:
        print(f"  not final: {stuck}")
    print(f"ran in {result.seconds:.1f} s")
    print(result.line())
    return 0 if result.ok else 1


def register(sub) -> None:
    p = add_command(sub, "chaos", __doc__)
    p.add_argument(
        "--transfers", type=int, default=1000, metavar="N", help="how many transfers (default 1000)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="the seed that decides every latency and fault (default 0)",
    )
    p.add_argument(
        "--fault-rate",
        type=float,
        default=0.05,
        metavar="R",
        help="the chance of each fault at each chance it has (default 0.05)",
    )
    p.add_argument(
        "--layers", type=int, default=4, metavar="N", help="layers per transfer (default 4)"
    )
    p.set_defaults(run=_chaos)
