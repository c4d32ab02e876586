"""The serving benchmark's round-robin proxy (its fleet's front door), against two real HTTP
servers on loopback. In the vLLM venv: the proxy runs on vLLM's aiohttp."""

from __future__ import annotations

import contextlib
import http.server
import threading
import urllib.request
from collections.abc import Iterator

from benchmarks.serve import round_robin_proxy


@contextlib.contextmanager
def named_server(name: str) -> Iterator[str]:
    """An HTTP server on a free loopback port answering every request with its name."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = f"{name} {self.command} {self.path} {self.rfile.read(length).decode()}"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST = answer

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def call(url: str, body: bytes | None = None) -> str:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: bytes = response.read()
        return answer.decode()


def test_completions_alternate_between_the_servers_and_other_requests_go_to_the_first() -> None:
    with named_server("a") as a, named_server("b") as b, round_robin_proxy([a, b]) as proxy:
        answers = [call(f"{proxy}/v1/completions", f"prompt {n}".encode()) for n in range(4)]
        models = call(f"{proxy}/v1/models")
    assert answers == [
        "a POST /v1/completions prompt 0",
        "b POST /v1/completions prompt 1",
        "a POST /v1/completions prompt 2",
        "b POST /v1/completions prompt 3",
    ]
    assert models == "a GET /v1/models "
