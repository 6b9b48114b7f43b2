"""Defences found by an adversarial pass: each test fails without its fix.

Text that is not valid Unicode, bodies over the cap however they are framed, prompts too long to
tokenize on the event loop, requests that would create too many sequences, loose logit_bias
keys, and small responses held back by Nagle's algorithm.
"""

from __future__ import annotations

import socket
import statistics
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"


def _read_response(sock: socket.socket, buffer: bytearray) -> bytes:
    """One HTTP/1.1 response with a Content-Length from a keep-alive socket; returns its body."""
    while b"\r\n\r\n" not in buffer:
        buffer += sock.recv(65536)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    del buffer[:]
    buffer += rest
    while len(buffer) < length:
        buffer += sock.recv(65536)
    body = bytes(buffer[:length])
    del buffer[:length]
    return body


def test_small_responses_are_not_delayed_by_nagle(server):
    # The client disables Nagle itself, so a delay can only come from the server's side.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode()
        buffer = bytearray()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            sock.sendall(request)
            assert b"ok" in _read_response(sock, buffer)
            times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.005, times
