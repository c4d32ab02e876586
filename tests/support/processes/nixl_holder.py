"""A process holding a NIXL-registered buffer of known bytes, for the NIXL tests.

Prints one JSON line (its agent's metadata in hex, the buffer's address and
size), then holds the buffer until stdin closes.
"""

from __future__ import annotations

import json
import sys

import torch

from kvwire.media.peer._agent import PeerAgent


def pattern(size: int) -> torch.Tensor:
    return (torch.arange(size, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def main() -> None:
    name, size = sys.argv[1], int(sys.argv[2])
    buffer = pattern(size)
    agent = PeerAgent(name, [buffer])
    print(
        json.dumps({"metadata": agent.metadata.hex(), "address": buffer.data_ptr(), "size": size}),
        flush=True,
    )
    sys.stdin.read()
    agent.close()


if __name__ == "__main__":
    main()
