"""READ mode's early first token: P's first output token goes to the client as soon as P answers, and D gets the
prompt plus that token, loads the KV P computed for the prompt and computes from the token after it.

Rules: only a request the split serves exactly takes this way (one prompt, every field in ``_SAFE`` or at its
neutral value, ``max_tokens`` >= 2): greedy output then is the single instance's, token for token, and with
sampling the stream is still one sequence. P's answer must give its first token and the prompt's token ids and
must have stopped only for length; otherwise the request goes the plain READ way. D's usage is told as the
client's request: the token P made counts as output, not prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

__all__ = [
    "FirstToken",
    "decode_body",
    "first_event",
    "merge_answer",
    "parse",
    "serves",
    "shift_event",
]

# Fields that mean the same to D continuing from the first token as to one instance making every token.
_SAFE = frozenset(
    {
        "model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k",
        "min_p", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty", "logit_bias",
        "return_token_ids", "user", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "priority", "request_id",
    }
)  # fmt: skip
# Fields that are safe at these values only (penalties on output counts would count the first token anew,
# stop strings could straddle P's token and D's first, logprobs come from two engines).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "stop": (None, "", []),
    "logprobs": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "echo": (None, False),
}


@dataclass(frozen=True)
class FirstToken:
    """What P answered: its first output token, that token's text, and the prompt's token ids."""

    token_id: int
    text: str
    prompt_token_ids: list[int]


def serves(body: dict) -> bool:
    """Whether ``body`` can take the early-first-token way (see the module's rules)."""
    prompt, max_tokens = body.get("prompt"), body.get("max_tokens")
    if not (isinstance(prompt, str) and prompt) and not _token_ids(prompt):
        return False
    if type(max_tokens) is not int or max_tokens < 2:
        return False
    for key, value in body.items():
        if key not in _SAFE and not (key in _NEUTRAL and _is_neutral(value, _NEUTRAL[key])):
            return False
    return True


def prefill_body(p_body: dict) -> dict:
    """P's part, asked to return its token ids (the first token and the prompt's)."""
    return dict(p_body, return_token_ids=True)


def parse(answer: Any) -> FirstToken | None:
    """P's first token from its whole answer, or None when it did not give one D can continue from."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    token_ids, prompt_ids, text = (
        choice.get("token_ids"),
        choice.get("prompt_token_ids"),
        choice.get("text"),
    )
    if choice.get("finish_reason") != "length" or not isinstance(text, str):
        return None
    if not _token_ids(token_ids) or len(token_ids) != 1 or not _token_ids(prompt_ids):
        return None
    return FirstToken(token_ids[0], text, list(prompt_ids))


def decode_body(body: dict, first: FirstToken, params: dict) -> dict:
    """D's part: the prompt's token ids plus P's token, one token fewer to make, P's KV to load."""
    d_body = dict(
        body, prompt=first.prompt_token_ids + [first.token_id], max_tokens=body["max_tokens"] - 1
    )
    if type(body.get("min_tokens")) is int:
        d_body["min_tokens"] = max(0, body["min_tokens"] - 1)
    d_body["kv_transfer_params"] = params
    return d_body


def first_event(answer: dict, first: FirstToken, body: dict) -> dict:
    """The client's first stream event: P's token, as one instance would have streamed it."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": first.text,
        "logprobs": None,
        "finish_reason": None,
    }
    if body.get("return_token_ids"):
        choice.update(token_ids=[first.token_id], prompt_token_ids=first.prompt_token_ids)
    head = {key: answer[key] for key in ("id", "created", "model") if key in answer}
    return {**head, "object": "text_completion", "choices": [choice]}


def shift_event(event: dict) -> dict:
    """One of D's events as the client's request would have it: the prompt's token ids are P's (already sent
    first), and the token P made counts as output in the usage."""
    for choice in event.get("choices") or ():
        if isinstance(choice, dict):
            choice.pop("prompt_token_ids", None)
    usage = event.get("usage")
    if isinstance(usage, dict) and type(usage.get("prompt_tokens")) is int:
        usage["prompt_tokens"] -= 1
        if type(usage.get("completion_tokens")) is int:
            usage["completion_tokens"] += 1
    return event


def merge_answer(answer: dict, first: FirstToken, body: dict) -> dict:
    """D's whole answer with P's token in front of its text (and of its token ids, where there are any)."""
    for choice in answer.get("choices") or ():
        choice["text"] = first.text + (choice.get("text") or "")
        if body.get("return_token_ids") or "token_ids" in choice:
            choice["token_ids"] = [first.token_id] + list(choice.get("token_ids") or ())
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = first.prompt_token_ids
    return answer


def _token_ids(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)
