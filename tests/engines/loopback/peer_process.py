"""A decode-side peer for cross-process tests: owns registered memory and does nothing else.

Run as a script: prints one JSON line of packed descriptors, then answers JSON-line commands (dump, fill, exit);
while waiting it runs no transfer code, so bytes that show up in its tensors were written one-sidedly.
"""

import json
import sys

import torch

from moriio_fsm.engines import LoopbackEngine


def main() -> None:
    size = int(sys.argv[1])
    with LoopbackEngine(sys.argv[2]) as engine:
        shared = engine.allocate_shared_tensor(size)
        private = torch.zeros(size, dtype=torch.uint8)
        print(
            json.dumps(
                {
                    "engine": engine.get_engine_desc().pack().hex(),
                    "shared": engine.register_torch_tensor(shared).pack().hex(),
                    "private": engine.register_torch_tensor(private).pack().hex(),
                }
            ),
            flush=True,
        )
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "dump":
                data = bytes(
                    shared[command["offset"] : command["offset"] + command["size"]].tolist()
                )
                print(json.dumps({"hex": data.hex()}), flush=True)
            elif command["op"] == "fill":
                data = bytes.fromhex(command["hex"])
                shared[command["offset"] : command["offset"] + len(data)] = torch.frombuffer(
                    bytearray(data), dtype=torch.uint8
                )
                print(json.dumps({"ok": True}), flush=True)
            else:
                break


if __name__ == "__main__":
    main()
