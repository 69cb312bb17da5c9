"""What a replay builds a traced table with: the options and config of its ``table`` line, checked.

Rules: a trace is input, so nothing of a ``table`` line reaches ``TransferTable`` or the
machine unchecked. Options that decide what a step does (``shards``, which splits the
capacities; the capacities of the ended set and of the early-fact buffer; their time
limit; check mode) are replayed as recorded, up to maxima far above any real table, and
a larger value is refused with a ``ValueError`` naming the option. An option that only
tunes housekeeping nobody can observe (``timer_compaction_threshold``) is not replayed:
the replay table keeps its default, so a hostile value cannot make the heap grow with
the trace. An integer config value is a limit (layers, writers): one above
``MAX_CONFIG_LIMIT`` is refused, because a per-transfer bitmap grows with it.
"""

from __future__ import annotations

import math
from typing import Any

#: Maxima of the options that are replayed as recorded (the defaults are 1, 65536,
#: 4096, 8 and a quarter of the pending capacity).
MAX_SHARDS = 1024
MAX_ENDED_CAPACITY = 1 << 20
MAX_PENDING_CAPACITY = 1 << 20
MAX_PENDING_PER_TRANSFER = 1 << 16
#: The largest integer config value (a limit) a replay accepts; the shipped specs'
#: defaults are 64 and 4096.
MAX_CONFIG_LIMIT = 1 << 16

_MAXIMA = {
    "shards": MAX_SHARDS,
    "ended_capacity": MAX_ENDED_CAPACITY,
    "pending_capacity": MAX_PENDING_CAPACITY,
    "pending_per_transfer": MAX_PENDING_PER_TRANSFER,
    "pending_per_source": MAX_PENDING_CAPACITY,
}
_NOT_REPLAYED = frozenset({"timer_compaction_threshold"})
_KNOWN = sorted({*_MAXIMA, *_NOT_REPLAYED, "pending_ttl_s", "check_invariants"})


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def replay_options(options: dict[str, Any]) -> dict[str, Any]:
    """The ``TransferTable`` options to replay a table recorded with ``options``.
    ``ValueError`` naming the first option that is unknown, of the wrong type or above
    its maximum."""
    kept: dict[str, Any] = {}
    for name, value in options.items():
        if name in _NOT_REPLAYED:
            continue
        if name in _MAXIMA:
            _check_count(name, value)
        elif name == "check_invariants":
            if type(value) is not bool:
                raise ValueError(
                    f"table option 'check_invariants' must be true or false, got {_show(value)}"
                )
        elif name == "pending_ttl_s":
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"table option 'pending_ttl_s' must be a positive, finite "
                    f"number of seconds, got {_show(value)}"
                )
        else:
            raise ValueError(
                f"unknown table option {_show(name)}; a replay knows {', '.join(_KNOWN)}"
            )
        kept[name] = value
    return kept


def _check_count(name: str, value: Any) -> None:
    if name == "pending_per_source" and value is None:  # None: the table's default
        return
    if type(value) is not int or value < 1:
        raise ValueError(f"table option {name!r} must be an integer >= 1, got {_show(value)}")
    if value > _MAXIMA[name]:
        raise ValueError(
            f"table option {name!r} is {value}, more than a replay builds (at "
            f"most {_MAXIMA[name]}); a table that large is not replayed"
        )
    if name == "shards" and value & (value - 1):
        raise ValueError(f"table option 'shards' must be a power of two, got {value}")


def replay_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every integer limit checked against ``MAX_CONFIG_LIMIT`` (the
    machine checks the rest: known keys, positive finite numbers)."""
    for key, value in config.items():
        if type(value) is int and value > MAX_CONFIG_LIMIT:
            raise ValueError(
                f"config key {_show(key)} is {value}, more than a replay accepts "
                f"for a limit (at most {MAX_CONFIG_LIMIT})"
            )
    return dict(config)
