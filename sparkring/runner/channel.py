"""Driver <-> task message channel: length-prefixed JSON frames (runner.protocol's types)
signed with a per-run HMAC key.

Written by hand because the channel must bind to the driver's own address, speak only
to holders of the run's secret, and push aborts back to tasks; Spark's accumulators and
py4j offer none of that while a job runs.

Each frame's MAC covers, besides the body, a nonce the server sends when it accepts the
connection, the sender's side and the frame's sequence number on that connection: a
captured frame replayed on another connection, reflected back, or sent twice is refused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ..collective import environment
from ..errors import ChannelError
from . import protocol
from .protocol import ConnectionClosed, Frame

_HEADER = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_MAC_LEN = 32
NONCE_LEN = 16
MAX_FRAME = 64 * 1024 * 1024
CLIENT, SERVER = b"C", b"S"

Handler = Callable[[Frame, "Connection"], None]


def _sign(secret: bytes, context: bytes, body: bytes) -> bytes:
    return hmac.new(secret, context + body, hashlib.sha256).digest()


def frame_context(nonce: bytes, side: bytes, seq: int) -> bytes:
    """What a frame's MAC covers besides its body: the connection, the sender's side, its place."""
    return nonce + side + _SEQ.pack(seq)


def encode_frame(secret: bytes, context: bytes, frame: Frame) -> bytes:
    """One frame on the wire: its length, its MAC under ``secret`` and ``context``, its JSON body."""
    body = protocol.dumps(frame)
    return _HEADER.pack(_MAC_LEN + len(body)) + _sign(secret, context, body) + body


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, secret: bytes, context: bytes) -> Optional[Frame]:
    """The next verified frame, or None when the peer closed the connection; ChannelError for a
    forged or misplaced one, ValueError for one that is no sparkring frame."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length < _MAC_LEN or length > MAX_FRAME:
        raise ChannelError(f"frame length {length} out of bounds")
    frame = _recv_exact(sock, length)
    if frame is None:
        return None
    mac, body = frame[:_MAC_LEN], frame[_MAC_LEN:]
    if not hmac.compare_digest(mac, _sign(secret, context, body)):
        raise ChannelError("frame signature does not match this run's secret, this connection and its place "
                           "(forged or replayed)")
    return protocol.loads(body)


class DriverChannel:
    """TCP server on the driver's address; calls ``handler(frame, connection)`` for each
    verified frame (and ``ConnectionClosed()`` when a peer leaves) and can push frames back to
    every connected task.

    >>> ch = DriverChannel("127.0.0.1", os.urandom(32), lambda msg, conn: print(msg))
    >>> ch.address  # doctest: +SKIP
    ('127.0.0.1', 41234)
    >>> ch.close()
    """

    def __init__(self, host: str, secret: bytes, handler: Handler):
        if host in ("", "0.0.0.0", "::"):
            raise ValueError("the driver channel binds to the driver's own address, never a wildcard")
        self.secret = secret
        self._handler = handler
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.address: Tuple[str, int] = (host, self._sock.getsockname()[1])
        self._conns: List[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self.rejected = 0
        self._thread = threading.Thread(target=self._accept_loop, name="sparkring-channel", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            nonce = os.urandom(NONCE_LEN)
            try:
                sock.sendall(nonce)
            except OSError:
                sock.close()
                continue
            conn = Connection(sock, self.secret, nonce, SERVER)
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: "Connection") -> None:
        try:
            while True:
                msg = conn.recv()
                if msg is None:
                    break
                self._handler(msg, conn)
        except (ChannelError, ValueError):
            self.rejected += 1
        except OSError:
            pass
        finally:
            conn.close()
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            if not self._closed:
                self._handler(ConnectionClosed(), conn)

    def broadcast(self, frame: Frame, where: Callable[["Connection"], bool] = lambda c: True) -> None:
        """Send ``frame`` to every connection ``where`` accepts."""
        with self._lock:
            targets = [c for c in self._conns if where(c)]
        for conn in targets:
            conn.send(frame)

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        try:
            # close() alone does not wake a thread blocked in accept() on Linux: shutdown does
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class Connection:
    """One socket speaking signed, sequenced frames; ``info`` holds what the peer said about itself."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes, side: bytes):
        self.sock = sock
        self.secret = secret
        self.info: Dict[str, Any] = {}
        self._nonce = nonce
        self._side = side
        self._peer = SERVER if side == CLIENT else CLIENT
        self._sent = 0
        self._received = 0
        self._send_lock = threading.Lock()

    def send(self, frame: Frame) -> bool:
        """Send ``frame``; False where the connection is gone."""
        try:
            with self._send_lock:
                data = encode_frame(self.secret, frame_context(self._nonce, self._side, self._sent), frame)
                self._sent += 1
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self) -> Optional[Frame]:
        """The peer's next frame (verified in its place), or None when it closed the connection."""
        msg = recv_frame(self.sock, self.secret, frame_context(self._nonce, self._peer, self._received))
        self._received += 1
        return msg

    def close(self) -> None:
        """Close the socket (shut down both ways first)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(host: str, port: int, secret: bytes, timeout: float = 30.0) -> Connection:
    """Open a client connection to a DriverChannel.

    >>> conn = connect("127.0.0.1", 41234, secret)  # doctest: +SKIP
    >>> conn.send(protocol.Hello(rank=0))  # doctest: +SKIP
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = _recv_exact(sock, NONCE_LEN)  # the server speaks first: this connection's nonce
    if nonce is None:
        sock.close()
        raise ChannelError(f"the channel at {host}:{port} closed the connection before its nonce")
    sock.settimeout(None)
    return Connection(sock, secret, nonce, CLIENT)


_worker_conn: Optional[Connection] = None
_worker_lock = threading.Lock()


def report_raw(frame: Union[protocol.Event, protocol.Error]) -> bool:
    """Send a frame from a worker process to the driver (or, when the driver is out of the
    tasks' reach, to the file its task returns with the results), as this rank of this attempt;
    False outside a run."""
    place = environment.RankEnv.from_env()
    address, event_file = place.driver, place.event_file
    if not address and not event_file:
        return False
    frame = dataclasses.replace(frame, rank=place.rank, attempt=place.attempt)
    with _worker_lock:
        if not address:
            assert event_file  # one of the two is set (above)
            with open(event_file, "ab") as f:
                f.write(protocol.dumps(frame) + b"\n")
            return True
        return _worker_connection(address).send(frame)


def _worker_connection(address: str) -> Connection:
    """This worker process's one connection to the driver at ``address`` (made on first use;
    the caller holds ``_worker_lock``)."""
    global _worker_conn
    if _worker_conn is None:
        host, port = address.rsplit(":", 1)
        _worker_conn = connect(host.strip("[]"), int(port), take_secret())
    return _worker_conn


_worker_secret: Optional[bytes] = None


def take_secret() -> bytes:
    """The run's secret, read once from the rank's environment and removed from it, so that
    the user's code and the processes it starts do not inherit it.

    >>> take_secret()  # doctest: +SKIP
    b'...'
    """
    global _worker_secret
    if _worker_secret is None:
        _worker_secret = bytes.fromhex(os.environ.pop(environment.SECRET))
    else:
        os.environ.pop(environment.SECRET, None)
    return _worker_secret


def measure_link(nbytes: int, timeout: float = 30.0) -> Optional[float]:
    """Bytes per second from this rank to the driver: ``nbytes`` characters sent through the rank's
    channel, timed until the driver says they arrived; None outside a run, where the driver is out
    of the ranks' reach, or where no answer came within ``timeout`` seconds.

    >>> measure_link(8 << 20)  # doctest: +SKIP
    117440512.0
    """
    global _worker_conn
    place = environment.RankEnv.from_env()
    if not place.driver:
        return None
    with _worker_lock:
        conn = _worker_connection(place.driver)
        began = time.monotonic()
        if not conn.send(protocol.Probe(data="x" * nbytes, rank=place.rank)):
            return None
        conn.sock.settimeout(timeout)
        try:
            while True:  # nothing else is read on a rank's connection (an Abort is its task's to act on)
                frame = conn.recv()
                if frame is None:
                    raise ConnectionError("the driver closed the channel")
                if isinstance(frame, protocol.ProbeReceived):
                    return nbytes / max(time.monotonic() - began, 1e-9)
        except (OSError, ChannelError, ValueError):  # no answer in time: the next report connects afresh
            conn.close()
            _worker_conn = None
            return None
        finally:
            if _worker_conn is conn:
                conn.sock.settimeout(None)


def report(payload: Any) -> bool:
    """Send an event from inside a rank to the driver's ``on_event`` callback of ``run()``.
    Returns False outside a sparkring run.

    >>> from sparkring.runner import report
    >>> report({"epoch": 1, "loss": 0.3})  # doctest: +SKIP
    True
    """
    return report_raw(protocol.Event(payload=payload))
