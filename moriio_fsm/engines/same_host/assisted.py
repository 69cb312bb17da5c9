"""Copy assist, the writer's side: large writes into a peer's shared pages go on the peer's job board, the peer's
idle serving loop copies part of them, and this side copies the rest and waits for the peer's part.

Rules: a write on a board holds both its registrations until its job ends, and ends exactly once: by its copy,
or given up (by close, or a failed flush); this side never waits for the peer beyond
``Tuning.assist_finish_timeout_s`` after its own part, and fails the write after that; a session killed
meanwhile copies nothing more. The board itself (both sides) is ``copy_assist.py``.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any

from ..inflight import closed_text
from ..status import StatusCode
from .copy_assist import copy_left, job_slot
from .strategy import CopyStrategy
from .tuning import Tuning

__all__ = ["AssistedCopy"]

_log = logging.getLogger(__name__)


class AssistedCopy(CopyStrategy):
    """Writes into one peer, copied together with that peer. ``counts``: jobs carried out with a peer's
    help, their pieces (``PeerBoard.finish``), and the pieces the peer copied."""

    name = "copy_assist"

    def __init__(self, key: str, tuning: Tuning) -> None:
        self._key = key
        self._tuning = tuning
        self._lock = threading.Lock()
        self.posted: set[Any] = set()  # writes on a peer's board now, their registrations held
        self.counts = {"jobs": 0, "pieces": 0, "pieces_by_peer": 0}

    # -- a whole group at flush time -----------------------------------------------------------

    def copy(self, op: str, pid: int, held: list[Any]) -> list[str | None] | None:
        """Copy held writes into one peer with that peer's help; None where it cannot help (no board,
        too small, too many ranges, memory it cannot read, a full board)."""
        peer = held[0].session.peer
        board = peer.board
        if (
            op != "write"
            or board is None
            or sum(posted.batch.total_bytes for posted in held) < self._tuning.assist_min_bytes
        ):
            return None
        job = self._post_group(board, peer, held)
        if job is None:
            return None
        try:
            by_peer, pieces = board.finish(
                job, peer.pidfd if peer.gone() is None else -1, self._tuning.assist_finish_timeout_s
            )
        except OSError as exc:  # TimeoutError, ProcessLookupError
            return [f"{exc} (engine {peer.desc.key!r})"] * len(held)
        self._count(pieces, by_peer)
        return [None] * len(held)

    @staticmethod
    def _post_group(board: Any, peer: Any, held: list[Any]):
        """The job of every held write on ``board``, or None (nothing posted)."""
        segments: list[tuple] = []
        segment_of_session: dict[int, int] = {}
        segment_of, src, dst, sizes = [], [], [], []
        for posted in held:
            session, batch = posted.session, posted.batch
            if session.peer is not peer or not session.helpable(batch):
                return None  # the peer could not read this memory
            index = segment_of_session.get(id(session))
            if index is None:
                index = segment_of_session[id(session)] = len(segments)
                segments.append(session.assist_segment())
            segment_of.extend([index] * len(batch.sizes))
            src.extend(batch.local_offsets)
            dst.extend(batch.remote_offsets)
            sizes.extend(batch.sizes)
        if len(sizes) > board.MAX_RANGES or len(segments) > board.MAX_SEGMENTS:
            return None
        return board.post(segments, segment_of, src, dst, sizes)

    # -- a write put on the board as it is posted ----------------------------------------------

    def post_early(self, posted: Any) -> tuple | None:
        """Hold the registrations of a large write and put it on the peer's board, so that the peer
        may copy it while this thread posts the next ones; (board, job), or None (nothing held)
        where the write is not for help or the board is full."""
        session, batch = posted.session, posted.batch
        board = session.peer.board
        if (
            posted.op != "write"
            or not posted.here
            or board is None
            or batch.total_bytes < self._tuning.assist_min_bytes
            or len(batch.sizes) > board.MAX_RANGES
            or not session.helpable(batch)
        ):
            return None
        if session.hold() is not None:
            return None  # refused: the copy at the end says why
        job = None
        try:
            job = board.post(
                [session.assist_segment()],
                [0] * len(batch.sizes),
                batch.local_offsets,
                batch.remote_offsets,
                batch.sizes,
            )
        finally:
            if job is None:
                session.let_go()
        if job is None:
            return None
        with self._lock:
            self.posted.add(posted)  # close gives up what is still posted
        return board, job

    def finish(self, posts: list[Any]) -> list[tuple[int, str]]:
        """The outcomes of writes posted early: their jobs are taken first (close can no longer give
        them up), their pieces left copied here, then each waits for the peer's piece in hand; only
        then are their registrations let go, so that each end time is taken as its wait saw it end,
        not after the others' bookkeeping. A job that never reaches its wait (an exception) is given
        up, so that its registrations go."""
        pending = {index: self.take(posted) for index, posted in enumerate(posts)}
        waited: list[tuple[int, tuple | None, Any]] = []
        outcomes: list[tuple[int, str]] = [(StatusCode.ERR_BAD_STATE, "")] * len(posts)
        try:
            self._copy_left(
                [(posts[index], job) for index, job in pending.items() if job is not None]
            )
            for index, posted in enumerate(posts):
                job = pending.pop(index)
                ended = None  # let go below, even if the wait is cut short
                try:
                    ended = self._wait_for_helper(posted, job)
                finally:
                    waited.append((index, job, ended))
        finally:
            for index, job in pending.items():
                if job is not None:
                    try:
                        self.give_up_taken(posts[index], job)
                    except Exception:  # its registrations went all the same; the others still go
                        _log.exception("copy assist: giving up a job failed")
            for index, job, ended in waited:
                try:
                    outcomes[index] = self._after_help(posts[index], job, ended)
                except Exception as exc:  # the other jobs are still let go
                    _log.exception("cross-memory transfer failed unexpectedly")
                    outcomes[index] = StatusCode.ERR_BAD_STATE, str(exc)
        return outcomes

    @staticmethod
    def _copy_left(taken: list[tuple[Any, tuple]]) -> None:
        """Copy the unclaimed pieces of taken jobs (posted, (board, job)) in one call without the
        GIL, last slot first: the peer works through a board from the first, so the two meet in
        one job. A session killed meanwhile stops its jobs between two pieces (its stop word)."""
        live = [(posted, job) for posted, (_, job) in taken if posted.session.why_dead() is None]
        live.sort(key=lambda item: job_slot(item[1]), reverse=True)
        if not live:
            return
        try:
            copy_left([job for _, job in live], [posted.session.stop_word for posted, _ in live])
        except Exception:  # each job's finish still copies what is left
            _log.exception("copy assist: copying the pieces left failed")

    def _wait_for_helper(self, posted: Any, taken: tuple | None):
        """Copy what is still left of a write posted for help (``taken``: its board and job, None
        if close gave it up) and wait for the peer's part, noting when the wait saw it end (jobs
        are waited for in turn, so a later one may have ended a little earlier); what
        ``_after_help`` needs. Never raises, lets go of nothing.

        A session killed (or a peer gone) since the post copies nothing more: the job is given up."""
        if taken is None:
            return None
        board, job = taken
        session = posted.session
        peer = session.peer
        try:
            reason = session.why_dead()
            by_peer, pieces = board.finish(
                job,
                peer.pidfd if peer.gone() is None else -1,
                self._tuning.assist_finish_timeout_s,
                copy=reason is None,
            )
        except OSError as exc:  # TimeoutError, ProcessLookupError
            return exc.with_traceback(None)
        except Exception as exc:  # a bug: said with its traceback as text, so that a kept
            # log record does not keep the job's frames, and with them the board's mapping, alive
            _log.error(
                "cross-memory transfer failed unexpectedly:\n%s",
                "".join(traceback.format_exception(exc)),
            )
            return exc.with_traceback(None)
        posted.ended_at = time.monotonic()
        return by_peer, pieces, reason

    def _after_help(self, posted: Any, taken: tuple | None, ended) -> tuple[int, str]:
        """Let go of a write posted for help once ``_wait_for_helper`` saw it end (``ended``: what
        it returned; None: it never ran); the outcome."""
        session = posted.session
        if taken is None:  # given up by close meanwhile
            return session.failure(closed_text(self._key))
        if ended is None:  # an exception came before the wait: nothing more is copied
            try:
                self.give_up_taken(posted, taken)
            except RuntimeError:  # it was finished already; its registrations went all the same
                pass
            return StatusCode.ERR_BAD_STATE, "the engine failed to carry it out"
        session.let_go()
        if isinstance(ended, OSError):
            return session.failure(f"{ended} (engine {session.peer.desc.key!r})")
        if isinstance(ended, BaseException):  # a bug, logged by the wait: this transfer fails alone
            return StatusCode.ERR_BAD_STATE, str(ended)
        by_peer, pieces, reason = ended
        self._count(pieces, by_peer)
        reason = reason or session.why_dead()  # or killed while the copy ran
        return session.failure(reason) if reason is not None else session.after_copy()

    # -- ending a write on the board without its copy ------------------------------------------

    def take(self, posted: Any) -> tuple | None:
        """The (board, job) of a write posted early, taken once: by its copy, or by close."""
        with self._lock:
            taken, posted.job = posted.job, None
            self.posted.discard(posted)
        return taken

    def give_up(self, posted: Any) -> None:
        """A write posted early that ends without its copy: take it off the board, let go."""
        taken = self.take(posted)
        if taken is not None:
            self.give_up_taken(posted, taken)

    def give_up_taken(self, posted: Any, taken: tuple) -> None:
        """Take a taken job off the board without copying (the peer's piece in hand is waited
        for), then let go of its registrations."""
        board, job = taken
        try:
            board.finish(job, -1, self._tuning.assist_finish_timeout_s, copy=False)
        except OSError:
            pass  # the helper did not leave in time: nothing more can be done for it
        finally:
            posted.session.let_go()

    def still_posted(self) -> list[Any]:
        with self._lock:
            return list(self.posted)

    def _count(self, pieces: int, by_peer: int) -> None:
        with self._lock:
            counts = self.counts
            counts["jobs"] += 1
            counts["pieces"] += pieces
            counts["pieces_by_peer"] += by_peer
