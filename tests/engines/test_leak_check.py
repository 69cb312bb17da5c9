"""The per-test region leak check in conftest.py can fail: it sees a region left open or mapped.

Each test leaks on purpose, asks the check, then cleans up so that the
autouse check, which runs after it, passes.
"""

from moriio_fsm.engines import LoopbackEngine


def test_an_open_region_and_its_mapping_are_reported_until_released(region_leak_check):
    check = region_leak_check()
    engine = LoopbackEngine("leaky")
    tensor = engine.allocate_shared_tensor(4096)
    try:
        leaked = check.leaked()
        assert any(h.startswith("fd ") for h in leaked), leaked
        assert any(h.startswith("mapping ") for h in leaked), leaked
    finally:
        engine.close()
    # The tensor still maps the memory (and its mmap holds a duplicate fd).
    assert any(h.startswith("mapping ") for h in check.leaked())
    del tensor
    assert check.leaked() == []
