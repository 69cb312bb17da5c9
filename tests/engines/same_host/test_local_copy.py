"""The same-host engine's in-process copier: the native streaming-store one and its memmove fallback.

Both must move exactly the bytes asked for (any alignment, any size, ranges that overlap),
refuse ill-typed or out-of-range lists before moving a byte, and the native one must be
what a normal install on x86-64 with a C compiler uses.
"""

from __future__ import annotations

import importlib
import platform
import random
import shutil
import sys
import sysconfig

import pytest
import torch

from moriio_fsm.engines.same_host import local_copy

NATIVE = local_copy._stream_copy
COPIERS = [pytest.param("memmove", id="memmove")]
if NATIVE is not None:
    COPIERS += [pytest.param("native", id="native"), pytest.param("native-sse2", id="native-sse2")]


@pytest.fixture
def copy(request):
    """The copier named by the test's parameter; "native-sse2" is the native one without AVX2."""
    if request.param == "memmove":
        yield local_copy.memmove_ranges
        return
    before = NATIVE._use_avx2(request.param == "native")
    try:
        yield NATIVE.copy_ranges
    finally:
        NATIVE._use_avx2(before)


def buffer(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def expected_after(
    dst: torch.Tensor, src: torch.Tensor, dst_offsets, src_offsets, sizes
) -> torch.Tensor:
    out = dst.clone()
    for d, s, n in zip(dst_offsets, src_offsets, sizes):
        out[d : d + n] = src[s : s + n]
    return out


def test_a_normal_install_on_x86_64_with_a_compiler_copies_with_streaming_stores():
    if (
        platform.machine() not in ("x86_64", "AMD64")
        or shutil.which(sysconfig.get_config_var("CC").split()[0]) is None
    ):
        pytest.skip("the native copier is built only for x86-64 where a C compiler is present")
    assert NATIVE is not None, (
        "moriio_fsm.engines.same_host._stream_copy was not built by the install"
    )
    assert local_copy.copier().startswith("streaming stores (")


@pytest.mark.parametrize("copy", COPIERS, indirect=True)
@pytest.mark.parametrize("total_mib", [0, 3])  # under and over the size where streaming starts
def test_every_byte_asked_for_and_no_other_is_copied_at_any_alignment(copy, total_mib):
    rng = random.Random(total_mib)
    sizes = [0, 1, 63, 64, 65, 255, 256, 257, 4095, 4097, 131072 + 13]
    while sum(sizes) < total_mib * 2**20:
        sizes.append(rng.randrange(1, 300_000))
    src = buffer(sum(sizes) + 4096, 1)
    dst = buffer(2 * sum(sizes) + 8192, 2)
    src_offsets, dst_offsets, at = [], [], 7
    for size in sizes:
        src_offsets.append(at - 7)
        dst_offsets.append(at + rng.randrange(0, 64))  # every misalignment of the destination
        at = dst_offsets[-1] + size + rng.randrange(1, 100)
    assert at < dst.numel()
    want = expected_after(dst, src, dst_offsets, src_offsets, sizes)
    copy(dst.data_ptr(), dst_offsets, src.data_ptr(), src_offsets, sizes)
    assert torch.equal(dst, want)


@pytest.mark.parametrize("copy", COPIERS, indirect=True)
def test_a_range_overlapping_its_source_moves_as_memmove_does(copy):
    data = buffer(4 * 2**20, 3)
    want = data.clone()
    want[100 : 100 + 3 * 2**20] = data[0 : 3 * 2**20].clone()
    base = data.data_ptr()
    copy(base, [100], base, [0], [3 * 2**20])
    assert torch.equal(data, want)


@pytest.mark.parametrize("copy", COPIERS, indirect=True)
def test_tuples_and_ranges_are_accepted_as_offset_lists(copy):
    src, dst = buffer(4096, 4), torch.zeros(4096, dtype=torch.uint8)
    copy(dst.data_ptr(), range(0, 4096, 1024), src.data_ptr(), (0, 1024, 2048, 3072), [1024] * 4)
    assert torch.equal(dst, src)


BAD_LISTS = [
    pytest.param(
        ([0, 1.5], [0, 0], [1, 1]),
        TypeError,
        "dst_offsets\\[1\\]: expected an int",
        id="float offset",
    ),
    pytest.param(
        ([0, 0], [0, "8"], [1, 1]),
        TypeError,
        "src_offsets\\[1\\]: expected an int",
        id="str offset",
    ),
    pytest.param(
        ([0, 0], [0, 0], [1, None]), TypeError, "sizes\\[1\\]: expected an int", id="None size"
    ),
    pytest.param(
        ([0, 0], [0, 0], [1, -1]),
        ValueError,
        "sizes\\[1\\]: expected an int in \\[0, 2\\*\\*64\\)",
        id="negative",
    ),
    pytest.param(([0, 2**64], [0, 0], [1, 1]), ValueError, "dst_offsets\\[1\\]", id="too big"),
    pytest.param(
        ([0, 2**64 - 1], [0, 0], [1, 1]),
        ValueError,
        "range 1 runs past the end of the address space",
        id="wraps",
    ),
    pytest.param(([0], [0, 0], [1, 1]), ValueError, "differ in length", id="lengths"),
    pytest.param(([0, 0], 5, [1, 1]), TypeError, "src_offsets", id="not a sequence"),
]


@pytest.mark.skipif(NATIVE is None, reason="the native copier is not built here")
@pytest.mark.parametrize("lists, error, message", BAD_LISTS)
def test_an_ill_typed_or_out_of_range_list_is_refused_before_a_byte_moves(lists, error, message):
    src, dst = buffer(64, 5), torch.zeros(64, dtype=torch.uint8)
    dst_offsets, src_offsets, sizes = lists
    with pytest.raises(error, match=message):
        NATIVE.copy_ranges(dst.data_ptr(), dst_offsets, src.data_ptr(), src_offsets, sizes)
    assert int(dst.count_nonzero()) == 0, (
        "the valid first range was copied before the bad one was seen"
    )


@pytest.mark.skipif(NATIVE is None, reason="the native copier is not built here")
@pytest.mark.parametrize("base", [-1, 2**64, "0x1000", 1.0, None])
def test_an_out_of_range_or_ill_typed_base_address_is_refused(base):
    src = buffer(64, 6)
    with pytest.raises((TypeError, ValueError), match="dst_base"):
        NATIVE.copy_ranges(base, [0], src.data_ptr(), [0], [8])
    with pytest.raises(TypeError, match="expected 5 arguments"):
        NATIVE.copy_ranges(src.data_ptr(), [0], src.data_ptr(), [0])


def test_an_install_without_the_native_module_copies_with_memmove(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "moriio_fsm.engines.same_host._stream_copy", None
    )  # import fails
    monkeypatch.delattr(sys.modules["moriio_fsm.engines.same_host"], "_stream_copy", raising=False)
    fallback = importlib.reload(local_copy)
    try:
        assert fallback.copier() == "memmove"
        assert fallback.copy_ranges is fallback.memmove_ranges
        src, dst = buffer(256, 7), torch.zeros(256, dtype=torch.uint8)
        fallback.copy_ranges(dst.data_ptr(), [128, 0], src.data_ptr(), [0, 128], [128, 128])
        assert torch.equal(dst[128:], src[:128]) and torch.equal(dst[:128], src[128:])
    finally:
        monkeypatch.undo()
        importlib.reload(local_copy)


@pytest.mark.parametrize(
    "lists, error",
    [
        (([0, 8], [0], [8, 8]), ValueError),
        (([0, 8], [0, 8], [8, "8"]), TypeError),
        (([0, 8], [0, 8], [8, -8]), ValueError),
        (([0, 8.0], [0, 8], [8, 8]), TypeError),
    ],
)
def test_the_memmove_copier_refuses_a_bad_list_before_a_byte_moves(lists, error):
    src, dst = buffer(64, 8), torch.zeros(64, dtype=torch.uint8)
    dst_offsets, src_offsets, sizes = lists
    with pytest.raises(error):
        local_copy.memmove_ranges(dst.data_ptr(), dst_offsets, src.data_ptr(), src_offsets, sizes)
    assert int(dst.count_nonzero()) == 0


@pytest.mark.skipif(NATIVE is None, reason="the native copier is not built here")
def test_other_threads_run_while_a_large_copy_runs():
    """The copy lets go of the GIL: this thread keeps running while another copies 256 MiB."""
    import threading

    src, dst = buffer(256 * 2**20, 9), torch.zeros(256 * 2**20, dtype=torch.uint8)
    copying = threading.Event()

    def copy():
        copying.set()
        NATIVE.copy_ranges(dst.data_ptr(), [0], src.data_ptr(), [0], [dst.numel()])

    copier = threading.Thread(target=copy)
    copier.start()
    copying.wait()
    turns = 0
    while copier.is_alive():  # with the GIL held for the copy, this loop would wait it out
        turns += 1
    copier.join()
    assert torch.equal(dst, src)
    assert turns > 1000
