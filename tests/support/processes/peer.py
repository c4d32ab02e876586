"""One engine with the peer medium, in a process of its own, driven over stdin/stdout.

Started by :class:`tests.support.peers.PeerProcess`. It reads one JSON
command per line: ``{"generate": [[request_id, prompt, max_tokens], ...]}``
runs the requests, waits for their saves (announced in the directory once
stored), and answers ``{"outputs": [...], "stats": {...}}``; ``{"quit":
true}`` (or the end of stdin) closes the engine. The first line it writes
says it is ready, with its peer name.
"""

from __future__ import annotations

import json
import sys

from kvwire.engine.engine import GenerationRequest, LLMEngine
from tests.support.peers import peer_config


def main() -> None:
    config = peer_config(**json.loads(sys.argv[1]))
    with LLMEngine(config) as engine:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("quit"):
                break
            requests = [
                GenerationRequest(request_id, tuple(prompt), max_tokens)
                for request_id, prompt, max_tokens in command["generate"]
            ]
            outputs = engine.generate(requests)
            engine.wait_for_saves()
            reply = {
                "outputs": [
                    {
                        "request_id": output.request_id,
                        "output_token_ids": list(output.output_token_ids),
                        "external_tokens": output.external_tokens,
                        "error": output.error,
                    }
                    for output in outputs
                ],
                "stats": dict(engine.connector_stats.data),
            }
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
