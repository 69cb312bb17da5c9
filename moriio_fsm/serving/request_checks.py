"""Which completion requests one P/D transfer can serve: each field checked before P is asked.

Rules: a refusal is a 400 ``TransferFailed`` naming the field (as a path: ``stop[1]``) and what
it must be; a value P and D could not both take (not finite, a lone surrogate) is refused too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from .failures import TransferFailed

__all__ = ["FIELD_TYPES", "KINDS", "UNSUPPORTED", "check_request", "check_values"]

#: Request fields a P/D split cannot serve: D never computes the prompt itself.
UNSUPPORTED = {
    "best_of": "best_of > 1",
    "use_beam_search": "beam search",
    "prompt_logprobs": "prompt_logprobs",
    "echo": "echo",
}


#: What a field may hold, each kind by its name in error messages.
KINDS: dict[str, Callable[[Any], bool]] = {
    "a number": lambda v: type(v) in (int, float),
    "an integer": lambda v: type(v) is int,
    "true or false": lambda v: type(v) is bool,
    "a string": lambda v: type(v) is str,
    "a string or a list of strings": lambda v: (
        type(v) is str or (type(v) is list and all(type(x) is str for x in v))
    ),
    "a list of token ids (ints >= 0)": lambda v: (
        type(v) is list and all(type(x) is int and x >= 0 for x in v)
    ),
    "an object of numbers": lambda v: (
        type(v) is dict and all(type(x) in (int, float) for x in v.values())
    ),
    "an object": lambda v: type(v) is dict,
}
#: The sampling fields and the kind each must be (or null: OpenAI clients send null for
#: unset). Checked here because in WRITE mode P runs before D is asked, and some of them
#: reach D only (``stream_options``, ``min_tokens``).
FIELD_TYPES = {
    **dict.fromkeys(
        (
            "temperature",
            "top_p",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ),
        "a number",
    ),
    **dict.fromkeys(("top_k", "seed", "logprobs", "min_tokens"), "an integer"),
    **dict.fromkeys(
        ("ignore_eos", "skip_special_tokens", "return_token_ids", "include_stop_str_in_output"),
        "true or false",
    ),
    **dict.fromkeys(("model", "suffix", "user"), "a string"),
    "stop": "a string or a list of strings",
    "stop_token_ids": "a list of token ids (ints >= 0)",
    "logit_bias": "an object of numbers",
    "stream_options": "an object",
}


def _bad(message: str) -> TransferFailed:
    return TransferFailed(400, message, "invalid_request_error")


def _shown(value: Any, limit: int = 80) -> str:
    """``repr`` of a client's value, short enough for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): JSON allows it, UTF-8 not
        return False


def _where(parent: str, key: str | int | None) -> str:
    """The path of ``key`` in the value at ``parent``: ``logit_bias."50256"``, ``stop[1]``."""
    if key is None:
        return parent
    if isinstance(key, int):
        return f"{parent}[{key}]"
    shown = key if key.isidentifier() else json.dumps(key)  # escapes what is unprintable
    return f"{parent}.{shown}" if parent else shown


_CHECKED = (float, str, dict, list)


def check_values(body: Any) -> None:
    """Refuse a value that cannot be sent on to P and D, naming where it is: a number that is
    not finite (``NaN``, ``-Infinity``, ``1e999``) or a string or key with a lone surrogate.
    Walks without recursion; a path is only made for containers and for what is refused."""
    stack: list[tuple[str, Any, Any]] = [("", None, body)]  # (parent's path, key, value)
    while stack:
        parent, key, value = stack.pop()
        kind = type(value)
        if kind is float:
            if not math.isfinite(value):
                raise _bad(f"'{_where(parent, key)}' must be a finite number, got {value!r}")
        elif kind is str:
            if not _encodes(value):
                raise _bad(
                    f"'{_where(parent, key)}' is not valid Unicode: it holds a lone surrogate"
                )
        elif kind is dict:
            where = _where(parent, key)
            for name, item in value.items():
                if not _encodes(name):
                    raise _bad(
                        f"a key of '{where or 'the request'}' is not valid Unicode: "
                        f"{json.dumps(name)} holds a lone surrogate"
                    )
                if type(item) in _CHECKED:
                    stack.append((where, name, item))
        elif kind is list:
            where = _where(parent, key)
            stack.extend(
                (where, index, item) for index, item in enumerate(value) if type(item) in _CHECKED
            )


def check_request(body: Any) -> None:
    """Refuse what one P/D transfer cannot serve, naming the field and what was expected."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    check_values(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' is empty")
    elif isinstance(prompt, list):
        if not prompt or not all(type(t) is int and t >= 0 for t in prompt):
            raise _bad(
                "'prompt' must be a string or one non-empty list of token ids (ints >= 0); "
                "send one prompt per request behind a P/D proxy"
            )
    else:
        raise _bad(
            f"'prompt' must be a string or a list of token ids, got "
            f"{type(prompt).__name__ if 'prompt' in body else 'nothing'}"
        )
    if "kv_transfer_params" in body:
        raise _bad("'kv_transfer_params' is set by the proxy; leave it out")
    if not isinstance(body.get("stream", False), bool):
        raise _bad(f"'stream' must be true or false, got {_shown(body['stream'])}")
    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):
        raise _bad(f"'n' must be 1 behind a P/D proxy, got {_shown(n)}")
    for key, what in UNSUPPORTED.items():
        value = body.get(key)
        if value not in (None, False, 1) or (key == "prompt_logprobs" and value is not None):
            raise _bad(f"{what} ('{key}') is not served behind a P/D proxy, got {_shown(value)}")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and not (type(max_tokens) is int and max_tokens >= 1):
        raise _bad(f"'max_tokens' must be an integer >= 1, got {_shown(max_tokens)}")
    for key, kind in FIELD_TYPES.items():
        value = body.get(key)
        if value is not None and not KINDS[kind](value):
            raise _bad(f"'{key}' must be {kind}, got {_shown(value)}")
