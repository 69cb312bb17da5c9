"""The fault matrix's faults: how each is made for each connector, and the steps that drive it.

Rules: a fault is the same event for every connector it applies to (P gone, P stopped, D gone,
the client gone); only how a connector's legs are sent differs. A push connector's D gets its
leg first and waits for P's writes; a pull connector's P answers first and D then fetches.
Faults injected into the mori stand-in apply to the connectors that run through it.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from fault_connectors import WATCH, Connector, Setup
from fault_run import Run, holdings

HOLD_S = 2.0  # "the client leaves" through the stand-in: how long it holds P's writes
#: "P stopped": how long P stays stopped; past every deadline here (ours: D's safety timeout
#: 20 s; the watch: 10 s), so the run shows what happens when a P that was given up on returns.
STOP_S = 25.0


@dataclass
class Fault:
    name: str
    what: str
    how: Callable[[Connector], str]  # how the fault is made for a connector
    setup: Callable[[Connector], dict]  # connector -> {side: Setup}
    drive: Callable[[Run], None]
    applies: Callable[[Connector], bool] = lambda connector: True


def normal_pair(run: Run) -> None:
    """Both legs at once, as a WRITE-mode proxy sends them; wait for D."""
    run.mark()
    d = run.send_d()
    run.send_p()
    run.await_d(d)


def p_killed(run: Run) -> None:
    if run.connector.pull:
        # D would read in milliseconds: P is stopped first so that D's read waits on it.
        to_d = run.prefill_first()
        run.signal("P", signal.SIGSTOP)
        d = run.send_d(to_d)
        run.wait_until_d_waits()
        time.sleep(1.0)
    else:
        d = run.send_d()
        run.wait_until_d_waits()
    run.mark()
    run.kill("P")
    run.await_d(d)


def p_stopped(run: Run) -> None:
    if run.connector.pull:
        to_d = run.prefill_first()
        run.mark()
        run.signal("P", signal.SIGSTOP)
        d = run.send_d(to_d)
    else:
        d = run.send_d()
        run.wait_until_d_waits()
        run.mark()
        run.signal("P", signal.SIGSTOP)
        run.send_p()  # waits in P's listen queue until P continues
    time.sleep(max(0.0, run.fault_at + STOP_S - time.time()))  # stopped that long, whatever D does
    run.signal("P", signal.SIGCONT)
    run.result.notes.append(f"P continued {time.time() - run.fault_at:.0f}s after it stopped")
    run.await_d(d)


def d_killed(run: Run) -> None:
    if run.connector.pull:
        run.prefill_first()  # P now holds the prompt's KV for D
        run.mark()
        run.kill("D")
    else:
        run.send_d()
        run.wait_until_d_waits()
        run.mark()
        run.kill("D")
        p = run.send_p()
        if not p.wait(60):
            run.result.notes.append("P's leg did not end in 60s")
    run.result.answer = "D killed"
    run.settle()


def client_leaves(run: Run) -> None:
    if run.connector.standin:
        return _leaves_while_p_writes(run)
    if run.connector.pull:
        d = run.send_d(run.prefill_first())
        run.wait_until_d_waits(poll_s=0.01)
        run.mark()
        d.cut()
    else:
        d = run.send_d()
        run.wait_until_d_waits()
        run.mark()
        d.cut()
        run.send_p()
    _watch_the_end(run, time.monotonic(), HOLD_S + 8)
    run.settle()


def _leaves_while_p_writes(run: Run) -> None:
    """Through the stand-in, P's writes are held: the client leaves while they are in flight."""
    r = run.result
    d = run.send_d()
    run.wait_until_d_waits()
    run.send_p()
    deadline = time.monotonic() + 30
    while run.workaround_time("first write held at") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if run.workaround_time("first write held at") is None:
        r.notes.append("P never posted a write")
    time.sleep(0.2)
    run.mark()
    left_at, left_wall = time.monotonic(), time.time()
    d.cut()
    freed = _watch_the_end(run, left_at, HOLD_S + 8)
    landed, deadline = None, time.monotonic() + HOLD_S + 5
    while landed is None and time.monotonic() < deadline:
        landed = run.workaround_time("held writes land at")
        time.sleep(0.1)
    # D's figures are live (its engine steps to end the request); P's engine may be inside a
    # step waiting for its writes, when its /metrics still shows an earlier step's: D only.
    at = freed.get("D")
    if at is not None and landed is not None:
        when = "BEFORE" if at < landed else "after"
        r.notes.append(f"D freed its KV {abs(landed - at):.1f}s {when} P's held writes landed")
    elif at is not None:
        r.notes.append(f"D freed its KV {at - left_wall:.1f}s after the client left")
    else:
        r.notes.append("D did not free its KV while watched")
    run.settle()


def _watch_the_end(run: Run, left_at: float, for_s: float) -> dict[str, float]:
    """After the client left: when D holds no request (its end), and when each side's KV is
    free (wall times, by side)."""
    r = run.result
    freed: dict[str, float] = {}
    ended_at = None
    r.waited_s = for_s
    while time.monotonic() < left_at + for_s:
        for side, server in run.servers.items():
            held = holdings(server)
            if held is None:
                continue
            if side == "D" and held[1] == 0 and ended_at is None:
                ended_at = time.monotonic()
            if held[0] == 0.0 and side not in freed:
                freed[side] = time.time()
        if ended_at is not None and len(freed) == 2:
            break
        time.sleep(0.05)
    r.ended = ended_at is not None
    r.seconds = None if ended_at is None else ended_at - left_at
    r.answer = "client left"
    return freed


# -- the list ------------------------------------------------------------------------------


def _same(setup: Setup) -> Callable[[Connector], dict]:
    return lambda connector: {"P": setup, "D": setup}


FAILED_WRITE = json.dumps([{"stage": "completion", "op": "write", "times": 1}])


def _lost_write_done(connector: Connector) -> str:
    if connector.name == "ours-rdma":
        return "P's fault_injection message_lose_first: write_done (its first write_done is lost)"
    return (
        "workaround moriio_drop_write_done: MoRIIOWrapper.send_notify drops its first "
        "message_type='write_done'"
    )


def _p_killed(connector: Connector) -> str:
    if connector.pull:
        return "P answers its leg; P stopped (SIGSTOP) so D's read waits; D's leg; 1s after D holds it, SIGKILL to P"
    return "D's leg; once D holds the request, SIGKILL to P's process group"


def _p_stopped(connector: Connector) -> str:
    if connector.pull:
        return f"P answers its leg; SIGSTOP to P; D's leg; SIGCONT {STOP_S:g}s later"
    return (
        f"D's leg; once D holds it, SIGSTOP to P, then P's leg (queued); SIGCONT {STOP_S:g}s later"
    )


def _d_killed(connector: Connector) -> str:
    if connector.pull:
        return "P answers its leg (it holds the KV for D); SIGKILL to D before D's leg"
    return "D's leg; once D holds it, SIGKILL to D, then P's leg (P writes to a dead D)"


def _client_leaves(connector: Connector) -> str:
    if connector.standin:
        return (
            f"workaround standin_slow_writes: the stand-in holds P's write completions {HOLD_S:g}s; "
            "the client cuts D's connection 0.2s after P's first write"
        )
    if connector.pull:
        return "P answers its leg; D's leg; the client cuts D's connection once D holds it"
    return "D's leg; once D holds it, the client cuts D's connection; then P's leg"


def _client_leaves_setup(connector: Connector) -> dict:
    if not connector.standin:
        return {}
    return {
        "P": Setup(
            workarounds=("standin_slow_writes",),
            env={"BENCH_STANDIN_WRITE_HOLD_S": str(HOLD_S)},
        )
    }


FAULTS = [
    Fault(
        "failed_write",
        "a failed write (an error completion of P's first write)",
        lambda c: f"MORI_STANDIN_FAULTS={FAILED_WRITE} (the stand-in's injection)",
        _same(Setup(env={"MORI_STANDIN_FAULTS": FAILED_WRITE})),
        normal_pair,
        applies=lambda c: c.standin,
    ),
    Fault(
        "lost_write_done",
        "a lost write_done (P's message that its writes landed)",
        _lost_write_done,
        lambda c: {
            "P": Setup(ours_faults={"message_lose_first": "write_done"})
            if c.name == "ours-rdma"
            else Setup(workarounds=("moriio_drop_write_done",))
        },
        normal_pair,
        applies=lambda c: c.standin,
    ),
    Fault(
        "p_killed",
        "P killed (SIGKILL, every process) while D waits for its KV",
        _p_killed,
        _same(Setup()),
        p_killed,
    ),
    Fault(
        "p_stopped",
        f"P stopped (SIGSTOP) while D waits, continued after {STOP_S:g}s",
        _p_stopped,
        _same(Setup()),
        p_stopped,
    ),
    Fault(
        "d_killed",
        "D killed (SIGKILL) while P holds the prompt's KV for it",
        _d_killed,
        _same(Setup()),
        d_killed,
    ),
    Fault(
        "client_leaves",
        "the client leaving while D waits for its KV (D aborts the request)",
        _client_leaves,
        _client_leaves_setup,
        client_leaves,
    ),
]
WATCH_NOTE = (
    f"the watch's deadlines here: stuck_after_s {WATCH['stuck_after_s']:g}, "
    f"stranded_after_s {WATCH['stranded_after_s']:g}"
)
