"""The same-host engine's numbers, in one place, each with the reason for its value.

Rules: every engine holds its own ``Tuning`` (``engine.tuning``), so changing one engine's figures changes no
other's; the copy-assist board's bounds against hostile writers are limits, not tuning, and stay with the board
(``copy_assist.AssistBoard``). Measurements behind these values are in docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Tuning"]


@dataclass
class Tuning:
    """How the same-host engine spends threads and waits."""

    #: A batch of at least this many bytes is split across the engine's copy threads: the kernel
    #: pins and copies page by page, and one thread leaves memory bandwidth unused; below it, a
    #: hand-off to another thread costs more than it saves.
    parallel_copy_min_bytes: int = 8 << 20
    #: At most this many due batches go to the kernel in one call: enough for every layer of a
    #: transfer, few enough that one call's iovec arrays stay small.
    max_coalesced: int = 64
    #: How often an idle worker looks for peers that exited, to let go of their mapped pages: a
    #: dead decode instance's KV cache must not stay resident because this process mapped it.
    sweep_interval_s: float = 1.0
    #: Writes smaller than this are copied by the writer alone: posting a job and waking the
    #: helper cost more than the helper saves.
    assist_min_bytes: int = 1 << 20
    #: How long an idle serving loop waits for a writer's job to help with (``help_writers``). It
    #: holds back the loop's next step, so a request arriving meanwhile is scheduled up to this
    #: much later; shorter, the helper is often elsewhere when the writer posts.
    assist_wait_s: float = 0.02
    #: After helping, how long the helper waits for the transfer's next layer: a transfer posts a
    #: job per layer, within well under a millisecond of each other.
    assist_linger_s: float = 0.0005
    #: Longest wait for the helper once the writer has copied every piece left: a helper holds one
    #: piece (about 256 KiB) at a time, so only a stopped or starved helper is that slow; the
    #: write then fails.
    assist_finish_timeout_s: float = 1.0
    #: How long a serving loop on a core it shares with inline copies waits for a copy to end
    #: (``wait_for_copies``) before asking for finished transfers again: spinning would take half
    #: the core from the copy it waits for.
    copy_wait_s: float = 0.05
