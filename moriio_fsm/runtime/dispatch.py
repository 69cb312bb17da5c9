"""A table's dispatch function: one template, specialised once per table and recorder.

Theory of operation: ``TEMPLATE`` is the one dispatch path. A line tagged ``[feature]``
is kept only in the variants that have that feature, so each variant is compiled from
the same text once and then runs only its own lines, as a logging library picks a
function per level once instead of testing the level on every call. The features:
``one`` or ``many`` shards (one shard: its lock and dict are bound once, no id is
hashed), and what is recorded: nothing, ``results`` (a ``recorder(event, result)``) or
``steps`` (a step recorder, which also sees the state before, the rows taken and the
steps that raised). Everything the function touches is a name of its namespace
(``make_dispatch``'s ``bindings``): it runs once per layer per transfer, where every
attribute lookup shows.

Rules (``table.py`` states them for the table): a malformed event is rejected and
counted before any lock is taken; one step, and its record, run under the shard's lock;
a malformed event is never recorded; a recorder that raises never loses the step.
"""

from __future__ import annotations

import functools
import linecache
import types
from collections.abc import Callable
from typing import Any

#: Features that pick a variant; a table has one of ``SHARDING`` and one of ``RECORDING``.
SHARDING = ("one", "many")
RECORDING = ("none", "results", "steps")

TEMPLATE = """\
def dispatch(ev):
    try:
        time = ev.time
        tid = ev.transfer_id
    except AttributeError:                          # not an event at all
        return malformed()
    kind = time.__class__
    if ((kind is not float and kind is not int) or not low < time < high
            or tid.__class__ is not str):           # NaN, infinite, huge, a non-str id
        return malformed()
[results]    refuse_reentry()
[many]    shard = shards[hash(tid) & mask]
[many]    lock = shard.lock
[many]    lock.acquire()
[one]    acquire()
    try:
[one]        tx = live_get(tid)                      # a str key: this cannot raise
[many]        tx = shard.live.get(tid)
[steps]        before = None if tx is None else tx.state
[steps]        shard.fired = no_rows
        try:
            if tx is None:
                result = absent(shard, ev)
            else:
                step = steps[tx.state].get(ev.kind)
                if step is None:
                    shard.counts[REJECTED_INDEX] += 1
                    result = rejected_in[tx.state]
                else:
                    result = step(shard, tx, ev)    # counts its own outcome
        except TypeError:
            # An unhashable kind or source: nothing changed, since a step turns its own
            # errors into TransitionError before they get here. Malformed: not recorded.
            shard.counts[REJECTED_INDEX] += 1
            return Result(REJECTED, None if tx is None else tx.state, NO_EFFECTS)
[steps]        except (TransitionError, InvariantViolation) as exc:
[steps]            record_raised(ev, before, None, shard.fired, exc)   # rolled back; traced
[steps]            raise
[results]        record(ev, result)
[steps]        try:
[steps]            record_step(ev, before, result, shard.fired)
[steps]        except Exception as exc:            # the step stands; the failure is reported
[steps]            recorder_failed(ev, exc)
        return result
    finally:
[one]        release()
[many]        lock.release()
"""


def specialise(template: str, features: frozenset[str]) -> str:
    """``template`` with the tags of ``features`` removed and every other tagged line
    dropped; untagged lines are kept as they are."""
    kept = []
    for line in template.splitlines(keepends=True):
        if line.startswith("["):
            tag, _, rest = line[1:].partition("]")
            if tag not in features:
                continue
            line = rest
        kept.append(line)
    return "".join(kept)


@functools.cache
def _compiled(sharding: str, recording: str) -> types.CodeType:
    """The variant's code, compiled once per process and registered with ``linecache``
    so that a traceback through it shows its lines."""
    source = specialise(TEMPLATE, frozenset((sharding, recording)))
    filename = f"<moriio-fsm dispatch {sharding} shard(s), recording {recording}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return compile(source, filename, "exec")


def make_dispatch(bindings: dict[str, Any], *, sharding: str, recording: str) -> Callable:
    """The dispatch function of one variant, its free names taken from ``bindings``.

    Every variant needs ``malformed``, ``low``, ``high``, ``absent``, ``steps``,
    ``rejected_in``, ``Result``, ``REJECTED``, ``REJECTED_INDEX`` and ``NO_EFFECTS``;
    ``one``: ``shard``, ``acquire``, ``release``, ``live_get``; ``many``: ``shards``,
    ``mask``; ``results``: ``refuse_reentry``, ``record``; ``steps``: ``no_rows``,
    ``record_step``, ``record_raised``, ``recorder_failed``, ``TransitionError``,
    ``InvariantViolation``.
    """
    if sharding not in SHARDING or recording not in RECORDING:
        raise ValueError(
            f"no dispatch variant {sharding!r}/{recording!r}; expected one of "
            f"{SHARDING} and one of {RECORDING}"
        )
    namespace = dict(bindings)
    exec(_compiled(sharding, recording), namespace)  # noqa: S102 - the template above
    return namespace["dispatch"]
