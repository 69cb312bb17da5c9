"""Malformed, truncated, huge, hostile and foreign trace files: a clear error and exit 2."""

from __future__ import annotations

import json

import pytest

from moriio_fsm.cli import main
from moriio_fsm.trace import TraceError, iter_records
from moriio_fsm.trace.format import MAX_LINE_BYTES

HEADER = json.dumps({"type": "header", "format": "moriio-fsm-trace", "version": 1})
STEP = json.dumps(
    {
        "type": "step",
        "seq": 1,
        "side": "P0",
        "table": "write_producer",
        "transfer": "tx-1",
        "event": "prefill_started",
        "t": 0.0,
        "outcome": "created",
        "data": {"num_writers": 1},
        "after": "allocated",
    }
)


@pytest.mark.parametrize(
    "content, line, expected",
    [
        (b"", 0, "the file is empty"),
        (b'{"hello": 1}\n', 1, "not a moriio-fsm-trace file"),
        (b"\x89PNG\r\n\x1a\n", 1, "not a moriio-fsm-trace file"),
        (
            HEADER.replace('"version": 1', '"version": 2').encode() + b"\n",
            1,
            "version 2 is newer than the version this moriio-fsm reads (1)",
        ),
        (HEADER.encode() + b"\n" + STEP.encode()[:60], 2, "the last record is cut off"),
        (
            HEADER.encode() + b"\n" + STEP.replace('"t": 0.0', '"t": 1e999').encode() + b"\n",
            2,
            "Number out of range",
        ),
        (
            HEADER.encode() + b"\n" + STEP.replace('"seq": 1', '"seq": "one"').encode() + b"\n",
            2,
            "Expected `int`, got `str`",
        ),
        (
            HEADER.encode() + b"\n" + STEP.replace('"seq": 1', '"seq": -4').encode() + b"\n",
            2,
            "Expected `int` >= 0",
        ),
        (HEADER.encode() + b"\n" + STEP.encode()[:-1] + b'\xff\xfe"}\n', 2, "not UTF-8"),
        (HEADER.encode() + b"\n" + HEADER.encode() + b"\n", 2, "a second header line"),
        (HEADER.encode() + b"\n" + b"[" * 100_000 + b"\n", 2, "not a valid trace record"),
    ],
)
def test_each_defect_is_named_with_file_and_line(tmp_path, content, line, expected, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceError) as caught:
        list(iter_records(path))
    assert caught.value.line == line and expected in str(caught.value)
    assert str(caught.value).startswith(f"{path}:{line}: ")
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}:" in err and "Traceback" not in err


def test_a_huge_line_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as out:
        out.write(
            HEADER.encode() + b"\n" + b'{"type": "step", "pad": "' + b"x" * (3 * MAX_LINE_BYTES)
        )
    with pytest.raises(TraceError, match=r"huge.jsonl:2: the line is longer than"):
        list(iter_records(path))


def test_an_undeclared_event_or_payload_is_refused_at_its_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(HEADER + "\n" + STEP.replace("prefill_started", "teleport") + "\n")
    assert main(["replay", str(path)]) == 2
    assert (
        "t.jsonl:2: event 'teleport' is not declared by spec 'write_producer'"
        in capsys.readouterr().err
    )
    path.write_text(HEADER + "\n" + STEP.replace('"num_writers"', '"writers"') + "\n")
    assert main(["replay", str(path)]) == 2
    assert "t.jsonl:2: the payload of 'prefill_started' does not fit" in capsys.readouterr().err


def test_overlapping_files_of_one_side_are_refused(demo_trace, capsys):
    assert main(["replay", str(demo_trace), str(demo_trace)]) == 2
    assert "does not follow seq" in capsys.readouterr().err
