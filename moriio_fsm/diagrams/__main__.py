"""``python -m moriio_fsm.diagrams [DIR]``: regenerate the docs' drawings (default
docs/diagrams) and docs/machines.md's diagram; prints each path written."""

from __future__ import annotations

import sys

from .docs import write_docs

if __name__ == "__main__":
    for written_path in write_docs(sys.argv[1] if len(sys.argv) > 1 else "docs/diagrams"):
        print(written_path)
