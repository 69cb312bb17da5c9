"""Field checks shared by the decoders and the encoder: one rule per kind of wire value.

Rules: each check returns the value it accepts (normalised where the wire allows two
spellings) or raises ``error(field, reason)``: ``WireDecodeError`` inbound, ``WireEncodeError`` out.
"""

from __future__ import annotations

import math

from .messages import BlockIds
from .wire_limits import WireLimits

__all__ = [
    "WHOLE_FRAME",
    "check_blocks",
    "check_bool",
    "check_digest",
    "check_id",
    "check_int",
    "check_reason",
    "check_seconds",
    "type_name",
]

# The field an error names when it is about the message as a whole.
WHOLE_FRAME = "<frame>"


def type_name(value: object) -> str:
    return type(value).__name__


def _check_text(value: object, name: str, max_length: int, if_empty: str, error: type) -> str:
    """A non-empty string of at most ``max_length`` characters; ``if_empty`` is the error otherwise."""
    if type(value) is not str:
        raise error(name, f"expected a string, got {type_name(value)}")
    if not value:
        raise error(name, if_empty)
    if len(value) > max_length:
        raise error(name, f"{len(value)} characters exceeds the limit of {max_length}")
    return value


def check_id(value: object, name: str, limits: WireLimits, error: type) -> str:
    value = _check_text(value, name, limits.max_id_length, "must not be empty", error)
    # Ids end up in logs and maps: no control characters or spaces.
    if not value.isprintable() or " " in value:
        raise error(name, "must contain only printable characters and no whitespace")
    return value


def check_int(value: object, name: str, low: int, high: int, error: type) -> int:
    if type(value) is not int:  # excludes bool, which msgpack maps to True/False
        raise error(name, f"expected an integer, got {type_name(value)}")
    if value < low or value > high:
        raise error(name, f"{value} is out of range [{low}, {high}]")
    return value


def check_reason(value: object, name: str, limits: WireLimits, error: type) -> str:
    value = _check_text(
        value,
        name,
        limits.max_reason_length,
        "must not be empty (leave the field out instead)",
        error,
    )
    # A reason ends up in logs: spaces are fine, control characters are not.
    if not value.isprintable():
        raise error(name, "must contain only printable characters")
    return value


def check_bool(value: object, name: str, error: type) -> bool:
    if type(value) is not bool:  # 0 and 1 are integers, not verdicts
        raise error(name, f"expected a boolean, got {type_name(value)}")
    return value


def check_seconds(value: object, name: str, high: float, error: type) -> float:
    # Whole seconds may arrive as a msgpack integer; bool is refused (it is an int in Python).
    if type(value) is not float and type(value) is not int:
        raise error(name, f"expected a number of seconds, got {type_name(value)}")
    if type(value) is float and not math.isfinite(value):
        raise error(name, f"expected a finite number of seconds, got {value!r}")
    if value < 0 or value > high:  # compared before float(): a huge int must not overflow
        raise error(name, f"{value!r} is out of range [0, {high!r}]")
    return float(value) + 0.0  # + 0.0 turns -0.0 into 0.0


def _check_block_list(value: object, name: str, limits: WireLimits, error: type) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise error(name, f"expected a list of block ids, got {type_name(value)}")
    if len(value) > limits.max_blocks:
        raise error(name, f"{len(value)} block ids exceeds the limit of {limits.max_blocks}")
    items = tuple(value)
    # Fast path first; the slow loop only runs to name the offending index.
    if all(type(b) is int for b in items) and (
        not items or (min(items) >= 0 and max(items) <= limits.max_block_id)
    ):
        return items
    for index, block in enumerate(items):
        check_int(block, f"{name}[{index}]", 0, limits.max_block_id, error)
    raise AssertionError("unreachable: a bad block id was not found")  # pragma: no cover


def check_blocks(value: object, name: str, limits: WireLimits, error: type) -> BlockIds:
    if not isinstance(value, (tuple, list)):
        raise error(
            name, f"expected a list of block ids or of per-group lists, got {type_name(value)}"
        )
    if not value:
        raise error(name, "must not be empty")
    if not isinstance(value[0], (tuple, list)):
        return _check_block_list(value, name, limits, error)
    if len(value) > limits.max_groups:
        raise error(name, f"{len(value)} KV cache groups exceeds the limit of {limits.max_groups}")
    groups = []
    total = 0
    for index, group in enumerate(value):
        if not isinstance(group, (tuple, list)):
            raise error(
                f"{name}[{index}]",
                f"expected a list of block ids (the first entry was a group), got {type_name(group)}",
            )
        checked = _check_block_list(group, f"{name}[{index}]", limits, error)
        total += len(checked)
        groups.append(checked)
    if total == 0:
        raise error(name, "every KV cache group is empty")
    if total > limits.max_blocks:
        raise error(
            name, f"{total} block ids in all groups exceeds the limit of {limits.max_blocks}"
        )
    return tuple(groups)


def check_digest(value: object, name: str, error: type) -> str:
    if type(value) is not str:
        raise error(name, f"expected a string, got {type_name(value)}")
    if not 0 < len(value) <= 64 or value.strip("0123456789abcdef"):
        raise error(name, "expected 1-64 lower-case hex digits")
    return value
