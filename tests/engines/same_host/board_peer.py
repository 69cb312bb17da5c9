"""A hostile or dying writer on another process's copy-assist board, for the board's tests.

Roles (argv[1], then the board's owner pid, fd and token): ``resize`` maps the board, then tries to
shrink and to grow it by a page through its own fd and prints what each attempt did as one JSON line
(a size change that went through is undone at once, before the line is printed); ``post JOBS SRC_PID``
maps the board, posts up to JOBS one-piece jobs naming memory 3 of SRC_PID (token "tok") into memory 7,
prints how many went on the board, then waits on stdin without ever finishing them.
"""

import errno
import json
import os
import sys

from moriio_fsm.engines.same_host import copy_assist

PAGE = 4096
RANGE = 128 << 10
# This process's addresses of both registrations: never touched, since its jobs are never finished here.
FAR = 1 << 40


def resize(owner: int, fd: int, token: str) -> None:
    board = copy_assist.PeerBoard(owner, fd, token)
    size = copy_assist._copy_assist.BOARD_BYTES
    own = os.open(f"/proc/{owner}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    outcome = {}
    try:
        for what, new_size in (("shrink", size - PAGE), ("grow", size + PAGE)):
            try:
                os.ftruncate(own, new_size)
            except OSError as exc:
                outcome[what] = errno.errorcode.get(exc.errno, str(exc.errno))
            else:
                os.ftruncate(own, size)  # undone before the owner touches the lost page
                outcome[what] = "done"
        outcome["size"] = os.fstat(own).st_size
    finally:
        os.close(own)
    del board
    print(json.dumps(outcome), flush=True)


def post(owner: int, fd: int, token: str, jobs: int, src_pid: int) -> None:
    board = copy_assist.PeerBoard(owner, fd, token)
    segment = (src_pid, 3, b"tok", 7, b"", FAR, FAR)
    posted = []
    for k in range(jobs):
        job = board.post([segment], [0], [k * RANGE], [k * RANGE], [RANGE])
        if job is None:
            break
        posted.append(job)
    print(json.dumps({"posted": len(posted)}), flush=True)
    sys.stdin.read()  # holds its jobs until killed (or, if its parent dies, gives them up)


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "resize":
        resize(int(args[0]), int(args[1]), args[2])
    elif role == "post":
        post(int(args[0]), int(args[1]), args[2], int(args[3]), int(args[4]))
    else:
        sys.exit(f"unknown role {role!r}; expected resize or post")
