"""READ mode with P's first token handed to the client: D gets the prompt plus that token, loads the KV P
computed for the prompt and computes only the token after it.

Each scenario runs vLLM's real schedulers and workers with the connector (real sockets, real KV tensors) and
checks what a user would see: D's tokens are exactly the single instance's after the first, the prompt's KV came
from P (not recomputed), and both schedulers end empty.
"""

from __future__ import annotations

import pytest
from harness import BLOCK_SIZE, run_until

from moriio_fsm.vllm.transfer_ids import prompt_digest

pytestmark = pytest.mark.integration

TOKENS = 5


def reference(make_instance, prompt):
    single = make_instance("single", "kv_consumer")
    single.add("ref", prompt, TOKENS, None)
    assert run_until([single], lambda: len(single.outputs.get("ref", [])) >= TOKENS)
    return single.outputs["ref"]


def prefill(make_instance, prompt, transfer_id):
    P = make_instance("P", "kv_producer", True)
    P.add("p", prompt, 1, {"do_remote_decode": True, "transfer_id": transfer_id})
    assert run_until([P], lambda: "p" in P.params_out and P.outputs.get("p"))
    return P, P.outputs["p"][0], P.params_out["p"]


@pytest.mark.parametrize(
    "length",
    [2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 7],
    ids=["prompt_ends_a_block", "prompt_ends_mid_block"],
)
def test_d_continues_from_ps_first_token_with_the_prompts_kv_from_p(make_instance, length):
    prompt = list(range(20, 20 + length))
    want = reference(make_instance, prompt)
    P, first, params = prefill(make_instance, prompt, f"tx-first-{length}")
    assert first == want[0]
    assert params["remote_prompt_tokens"] == length
    D = make_instance("D", "kv_consumer", True)
    D.add("d", prompt + [first], TOKENS - 1, params)
    assert run_until(
        [P, D], lambda: len(D.outputs.get("d", [])) >= TOKENS - 1 and P.empty() and D.empty()
    )
    assert [first] + D.outputs["d"] == want
    assert D.reported_recving == ["d"], "D computed the prompt instead of loading P's KV"
    assert P.reported_sending == ["p"]


def test_kv_offered_for_a_shorter_prompt_than_ds_own_start_is_refused(make_instance):
    """The covered tokens are D's prompt's first ones only when their fingerprint matches."""
    prompt = list(range(20, 20 + 2 * BLOCK_SIZE))
    other = list(range(400, 400 + 2 * BLOCK_SIZE))
    want = reference(make_instance, other + [7])
    P, first, params = prefill(make_instance, prompt, "tx-first-other")
    D = make_instance("D", "kv_consumer", True)
    D.add("d", other + [7], TOKENS, params)
    assert run_until([D], lambda: len(D.outputs.get("d", [])) >= TOKENS)
    assert D.outputs["d"] == want
    assert D.reported_recving == []
    assert params["prompt_digest"] == prompt_digest(prompt)


@pytest.mark.parametrize("covered", [-1, "ten", 1.5, 1 << 40, True])
def test_an_ill_typed_covered_count_is_refused_naming_the_field(covered):
    from moriio_fsm.vllm.params import TransferParamsError, parse_transfer_params

    params = {"do_remote_prefill": True, "transfer_id": "tx-x", "remote_prompt_tokens": covered}
    with pytest.raises(TransferParamsError, match="remote_prompt_tokens"):
        parse_transfer_params(params)


def test_a_covered_count_past_ds_prompt_loads_no_more_than_the_prompt(make_instance):
    prompt = list(range(20, 20 + 2 * BLOCK_SIZE + 3))
    want = reference(make_instance, prompt)
    P, _, params = prefill(make_instance, prompt, "tx-first-long")
    D = make_instance("D", "kv_consumer", True)
    D.add("d", prompt, TOKENS, dict(params, remote_prompt_tokens=10_000))
    assert run_until(
        [P, D], lambda: len(D.outputs.get("d", [])) >= TOKENS and P.empty() and D.empty()
    )
    assert D.outputs["d"] == want and D.reported_recving == ["d"]
