"""The transfer directory's per-layer sessions when two threads ask for the same one at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

from moriio_fsm.vllm.directory import TransferInfo


class SlowLink:
    """A peer link whose sessions take a while to make, so two askers overlap."""

    def __init__(self):
        self.made = []

    def new_session(self, engine, layer_name, local_memory):
        time.sleep(0.02)
        session = SimpleNamespace(layer=layer_name, killed=False)
        self.made.append(session)
        return session


def test_two_threads_asking_for_a_layers_session_at_once_both_get_the_one_that_is_kept():
    link = SlowLink()
    linked = Future()
    linked.set_result(link)
    info = TransferInfo("req-1", (1, 2, 3), None, link=linked)
    cache = SimpleNamespace(names=["layer.0"], memory={"layer.0": object()})
    start, got = threading.Barrier(4), []

    def ask():
        start.wait()
        got.append(info.session(None, cache, 0))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept = info.sessions[0]
    # Sessions that lost the race carried nothing: every caller posts on the kept one, so
    # tearing the transfer down (which kills info.sessions) stops every byte it moved.
    assert len(link.made) == 4 and all(session is kept for session in got)
