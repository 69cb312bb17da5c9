"""Random batches through LoopbackEngine land exactly where a naive copy would put them.

Covers the merging of adjacent ranges and the split of large batches across
copy threads, both of which must be invisible in the bytes.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moriio_fsm.engines import LoopbackEngine

REGION = 4096


@st.composite
def batches(draw):
    """Ranges laid out left to right on both sides, some adjacent, none overlapping."""
    count = draw(st.integers(1, 24))
    sizes = draw(st.lists(st.integers(1, 64), min_size=count, max_size=count))
    local, remote, local_at, remote_at = [], [], 0, 0
    for size in sizes:
        local_at += draw(st.sampled_from([0, 0, 1, 7, 30]))
        remote_at += draw(st.sampled_from([0, 0, 3, 16]))
        local.append(local_at)
        remote.append(remote_at)
        local_at += size
        remote_at += size
    order = draw(st.permutations(range(count)))
    return [local[i] for i in order], [remote[i] for i in order], [sizes[i] for i in order]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), op=st.sampled_from(["write", "read"]), copy_threads=st.sampled_from([1, 2]))
def test_random_batches_match_a_naive_copy(batch, op, copy_threads):
    local_offsets, remote_offsets, sizes = batch
    source = torch.randint(
        0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    target = torch.zeros(REGION, dtype=torch.uint8)
    with (
        LoopbackEngine("batches-a", copy_threads=copy_threads) as engine,
        LoopbackEngine("batches-b") as peer,
    ):
        # Force the multi-threaded path even for small batches.
        engine.PARALLEL_COPY_MIN_BYTES = 1
        engine.register_remote_engine(peer.get_engine_desc())
        local_tensor, remote_tensor = (source, target) if op == "write" else (target, source)
        local_mem = engine.register_torch_tensor(local_tensor)
        remote_mem = peer.register_torch_tensor(remote_tensor)
        session = engine.create_session(local_mem, remote_mem)
        post = session.batch_write if op == "write" else session.batch_read
        status = post(local_offsets, remote_offsets, sizes, session.allocate_transfer_uid())
        assert status.wait_for(10_000) and status.succeeded(), status.message()
    expected = torch.zeros(REGION, dtype=torch.uint8)
    for lo, ro, size in zip(local_offsets, remote_offsets, sizes):
        if op == "write":
            expected[ro : ro + size] = source[lo : lo + size]
        else:
            expected[lo : lo + size] = source[ro : ro + size]
    assert torch.equal(target, expected)
