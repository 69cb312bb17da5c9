"""Failure injection for the stand-in: the ways a real mori RDMA transfer goes wrong, with mori's codes.

Rules: a rule applies to the next posts that match it (``times`` of them, after letting ``skip`` pass), in the
order rules were added;
``post`` fails the status on the posting thread after ``landed`` ranges were handed to the NIC (mori's "SQ full":
those ranges still land and complete later, into the failed status); ``completion`` lets ``landed`` ranges land
and then fails the status from the transfer thread (an error completion); ``notification`` fails the status on
the posting thread while every range still lands (mori's failed notification send; only with notifications on);
``hold`` makes a post's completions wait until its gate opens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..faults import HeldTransfers
from .codes import StatusCode

__all__ = ["Fault", "Faults", "Gate", "STAGES"]

STAGES = ("post", "completion", "notification", "hold")
_ERR_RDMA_OP = 13
_MESSAGES = {
    "post": "SQ full (stand-in: injected) while posting the batch",
    "completion": "RDMA work completion error (stand-in: injected): remote access error",
    "notification": "ibv_post_send (notify) failed (stand-in: injected)",
}


class Gate:
    """Holds the completions of posts until ``open`` (once open, it stays open)."""

    def __init__(self) -> None:
        self._held = HeldTransfers()  # the same latch the project's own engines hold transfers in

    def when_open(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the gate is open: now if it is."""
        if not self._held.keep(callback):
            callback()

    def open(self) -> None:
        self._held.release()

    @property
    def is_open(self) -> bool:
        return self._held.released


@dataclass(eq=False)
class Fault:
    """One rule: which posts it matches (``op``, ``engine_key``; None: any) and what happens to them."""

    stage: str
    code: int = _ERR_RDMA_OP
    message: str = ""
    landed: int = 0
    op: str | None = None
    engine_key: str | None = None
    gate: Gate | None = None
    times: int = 1
    skip: int = 0

    def matches(self, engine_key: str, op: str, notifications: bool) -> bool:
        if self.times <= 0 or (self.op is not None and self.op != op):
            return False
        if self.engine_key is not None and self.engine_key != engine_key:
            return False
        return self.stage != "notification" or notifications


class Faults:
    """The process's rules; the stand-in's engines ask ``take`` at each post."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[Fault] = []

    def inject(
        self,
        stage: str,
        *,
        code: int = _ERR_RDMA_OP,
        message: str | None = None,
        landed: int = 0,
        op: str | None = None,
        engine_key: str | None = None,
        hold: Gate | None = None,
        times: int = 1,
        skip: int = 0,
    ) -> Fault:
        """Add a rule (see the module's rules); ``code`` is a mori failure code (11-15)."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if (
            stage != "hold"
            and not StatusCode.ERR_INVALID_ARGS.value <= int(code) <= StatusCode.ERR_GPU_OP.value
        ):
            raise ValueError(f"code must be a mori failure code (11-15), got {code!r}")
        if op not in (None, "read", "write"):
            raise ValueError(f"op must be 'read', 'write' or None, got {op!r}")
        for name, value in (("landed", landed), ("times", times), ("skip", skip)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a count >= 0, got {value!r}")
        if stage == "hold" and hold is None:
            hold = Gate()
        rule = Fault(
            stage,
            int(code),
            message or _MESSAGES.get(stage, ""),
            landed,
            op,
            engine_key,
            hold,
            times,
            skip,
        )
        with self._lock:
            self._rules.append(rule)
        return rule

    def hold(self, *, op: str | None = None, engine_key: str | None = None, times: int = 1) -> Gate:
        """Hold the completions of the next matching posts until the returned gate opens."""
        return self.inject("hold", op=op, engine_key=engine_key, times=times).gate  # type: ignore[return-value]

    def take(self, engine_key: str, op: str, notifications: bool) -> Fault | None:
        """The first rule matching this post, used up by one."""
        with self._lock:
            for rule in self._rules:
                if rule.matches(engine_key, op, notifications):
                    if rule.skip:
                        rule.skip -= 1
                        continue
                    rule.times -= 1
                    return rule
        return None

    def inject_from_json(self, text: str, source: str = "MORI_STANDIN_FAULTS") -> list[Fault]:
        """Add the rules a JSON list of ``inject`` keyword objects gives (no ``hold``: its gate would be out
        of reach); nothing is added when one entry is wrong, and the error names it."""
        import json

        try:
            entries = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{source} must be a JSON list of fault objects: {exc}") from None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError(f"{source} must be a JSON list of fault objects, got {text[:80]!r}")
        allowed = {"stage", "code", "message", "landed", "op", "engine_key", "times", "skip"}
        for index, entry in enumerate(entries):
            unknown = set(entry) - allowed
            if unknown or entry.get("stage") not in set(STAGES) - {"hold"}:
                raise ValueError(
                    f"{source}[{index}]: expected a stage of {STAGES[:3]} and keys among "
                    f"{sorted(allowed)}, got {entry!r}"
                )
        probe = Faults()
        for index, entry in enumerate(entries):
            try:
                probe.inject(**entry)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{source}[{index}]: {exc}") from None
        return [self.inject(**entry) for entry in entries]

    def clear(self) -> None:
        """Drop every rule (gates already handed out stay as they are)."""
        with self._lock:
            self._rules.clear()
