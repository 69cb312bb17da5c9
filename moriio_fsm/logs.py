"""Loggers of the package: structlog's key=value style, written through stdlib logging.

Rules: a library never prints on its own. Every logger here hands its records to the
stdlib logger of the same name (``moriio_fsm.*``), which prints nothing unless the
application configured logging; events read ``zmq.listening host='127.0.0.1' port=1``.
Loaded into vLLM as its connector, the package writes where vLLM's own records go
(``share_handlers_of``), at vLLM's level, so a server's log shows what the connector saw.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import structlog


def _to_stdlib(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple, dict]:
    """Render the event and its key/values into one message; keep the traceback for
    stdlib to format."""
    exc_info = event_dict.pop("exc_info", None)
    event = event_dict.pop("event", "")
    text = " ".join([str(event), *(f"{key}={value!r}" for key, value in event_dict.items())])
    return (text,), ({"exc_info": exc_info} if exc_info else {})


def get_logger(name: str):
    """A structlog logger whose records go to ``logging.getLogger(name)``."""
    return structlog.wrap_logger(
        logging.getLogger(name), processors=[_to_stdlib], wrapper_class=structlog.BoundLogger
    )


def share_handlers_of(host: str = "vllm") -> None:
    """Let the package's records go to the handlers of the application's logger ``host``
    (vLLM's, as vLLM configured it), at its level. Nothing when that logger has no handler
    (the application configured no logging) or the package has handlers of its own."""
    ours, theirs = logging.getLogger("moriio_fsm"), logging.getLogger(host)
    if not theirs.handlers or any(not isinstance(h, logging.NullHandler) for h in ours.handlers):
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = theirs.propagate  # as vLLM's own records: written once, not again by root
