"""The P2P connector's wire: a producer answers pulls of finished requests' KV blocks over
ZMQ/TCP, a consumer pulls them.

Request (one frame, JSON): ``{"op": "pull", "request_id", "fingerprint", "block_hashes": [hex]}``
(the blocks the consumer wants, from the first one it lacks). Reply: a JSON header, then for
``"status": "ok"`` one frame of ``num_blocks * bytes_per_block`` bytes: the records of the longest
prefix of the wanted blocks whose hashes match what the producer holds (a different prompt
matches nothing). ``"unknown"``: the producer holds nothing under that id (not exported yet,
pulled already, or expired).
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pagedlm.core.logger import init_logger

logger = init_logger(__name__)

_POLL_MS = 100

#: ``(request_id, wanted block hashes as hex) -> records [n, bytes_per_block] uint8, or None``
Lookup = Callable[[str, list[str]], "torch.Tensor | None"]


def matching_prefix(held: list[str], wanted: list[str]) -> tuple[int, int]:
    """(index in ``held`` of ``wanted[0]``, how many of ``wanted`` follow it there); (0, 0) if none."""
    if not wanted or wanted[0] not in held:
        return 0, 0
    start = held.index(wanted[0])
    count = 0
    while count < len(wanted) and start + count < len(held) and held[start + count] == wanted[count]:
        count += 1
    return start, count


class KVBlockServer:
    """A thread answering pulls on ``tcp://host:port`` with ``lookup``."""

    def __init__(self, host: str, port: int, lookup: Lookup, fingerprint: str, bytes_per_block: int) -> None:
        import zmq

        self.lookup = lookup
        self.fingerprint = fingerprint
        self.bytes_per_block = bytes_per_block
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._socket.close()
            self._context.term()
            raise ValueError(f"the P2P KV connector cannot listen on tcp://{host}:{port} (kv_transfer_config kv_ip / "
                             f"kv_port): {e}") from None
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedlm-kv-p2p-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        sock = self._socket
        while not self._stop.is_set():
            if not sock.poll(_POLL_MS):
                continue
            identity, _, payload = sock.recv_multipart()
            try:
                header, data = self._answer(json.loads(payload))
            except Exception as e:  # noqa: BLE001 - a bad pull gets an error reply, the server goes on
                header, data = {"status": "error", "detail": f"{type(e).__name__}: {e}"}, None
            frames = [identity, b"", json.dumps(header).encode()]
            if data is not None:
                frames.append(data)
            try:
                sock.send_multipart(frames, copy=False)
            except zmq.ZMQError as e:
                logger.warning("P2P KV server: reply failed: %s", e)

    def _answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        if request.get("op") != "pull":
            return {"status": "error", "detail": f"unknown op {request.get('op')!r}"}, None
        if request.get("fingerprint") != self.fingerprint:
            return {"status": "error", "detail": "the two instances' KV layouts differ (model, dtype or block "
                                                 "size)"}, None
        records = self.lookup(str(request["request_id"]), [str(h) for h in request["block_hashes"]])
        if records is None:
            return {"status": "unknown"}, None
        return ({"status": "ok", "num_blocks": int(records.shape[0]), "bytes_per_block": self.bytes_per_block},
                records.contiguous().numpy())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_MS / 1000 + 1)
        self._socket.close()
        self._context.term()


class PullError(Exception):
    """The producer did not answer (dead or unreachable), or answered with an error."""


def pull_blocks(address: str, request_id: str, fingerprint: str, block_hashes: list[bytes], bytes_per_block: int, *,
                timeout_s: float, unknown_grace_s: float) -> torch.Tensor:
    """The records the producer at ``address`` holds for ``request_id`` (a matching prefix of
    ``block_hashes``; empty when it holds nothing after ``unknown_grace_s``). Raises
    :class:`PullError` when it gives no answer within ``timeout_s``."""
    import zmq

    header = json.dumps({"op": "pull", "request_id": request_id, "fingerprint": fingerprint,
                         "block_hashes": [h.hex() for h in block_hashes]}).encode()
    context = zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    grace_end = time.monotonic() + min(unknown_grace_s, timeout_s)
    while True:
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
            sock.send(header)
            wait_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            if not sock.poll(wait_ms):
                raise PullError(f"no answer from the KV producer at {address} within {timeout_s:g}s (is the prefill "
                                "instance running?)")
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close()
        reply = json.loads(frames[0].bytes)
        status = reply.get("status")
        if status == "ok":
            num_blocks = int(reply["num_blocks"])
            if int(reply["bytes_per_block"]) != bytes_per_block or len(frames) < 2 or \
                    len(frames[1].buffer) != num_blocks * bytes_per_block:
                raise PullError(f"the KV producer at {address} sent blocks of another size")
            with warnings.catch_warnings():
                # NOTE: read-only, and only read (copied into the paged cache); the tensor keeps
                # the frame's buffer alive. No copy of a request's whole KV on the host.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                data = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
            return data.reshape(num_blocks, bytes_per_block)
        if status == "unknown":
            if time.monotonic() >= grace_end:
                return torch.empty((0, bytes_per_block), dtype=torch.uint8)
            time.sleep(0.02)  # not exported yet: the producer does so in its next step
            continue
        raise PullError(f"the KV producer at {address} refused the pull: {reply.get('detail')}")
