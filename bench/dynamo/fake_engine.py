"""Minimal stdlib-only fake vLLM KV-event publisher (ZMQ PUB over ZMTP 3.0 + msgpack).

Used by capture.py to feed KV events into Dynamo's selection service so that the
captured fixtures show non-zero overlap and a non-empty /dump. Loopback only.

Wire format (what vLLM's ZmqEventPublisher sends): multipart [topic, seq(8 bytes BE),
msgpack([ts, [event, ...], dp_rank])], events in the array encoding, e.g.
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium].
"""

import socket
import struct
import threading
import time


# ----------------------------------------------------------------------------- msgpack
def mp_pack(obj) -> bytes:
    if obj is None:
        return b"\xc0"
    if obj is True:
        return b"\xc3"
    if obj is False:
        return b"\xc2"
    if isinstance(obj, int):
        if 0 <= obj <= 0x7F:
            return bytes([obj])
        if -32 <= obj < 0:
            return struct.pack(">b", obj)
        if obj >= 0:
            if obj <= 0xFF:
                return b"\xcc" + struct.pack(">B", obj)
            if obj <= 0xFFFF:
                return b"\xcd" + struct.pack(">H", obj)
            if obj <= 0xFFFFFFFF:
                return b"\xce" + struct.pack(">I", obj)
            return b"\xcf" + struct.pack(">Q", obj)
        if obj >= -0x80:
            return b"\xd0" + struct.pack(">b", obj)
        if obj >= -0x8000:
            return b"\xd1" + struct.pack(">h", obj)
        if obj >= -0x80000000:
            return b"\xd2" + struct.pack(">i", obj)
        return b"\xd3" + struct.pack(">q", obj)
    if isinstance(obj, float):
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, str):
        raw = obj.encode()
        n = len(raw)
        if n < 32:
            return bytes([0xA0 | n]) + raw
        if n <= 0xFF:
            return b"\xd9" + bytes([n]) + raw
        return b"\xda" + struct.pack(">H", n) + raw
    if isinstance(obj, (bytes, bytearray)):
        n = len(obj)
        if n <= 0xFF:
            return b"\xc4" + bytes([n]) + bytes(obj)
        return b"\xc5" + struct.pack(">H", n) + bytes(obj)
    if isinstance(obj, (list, tuple)):
        n = len(obj)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
        return head + b"".join(mp_pack(x) for x in obj)
    if isinstance(obj, dict):
        n = len(obj)
        head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
        return head + b"".join(mp_pack(k) + mp_pack(v) for k, v in obj.items())
    raise TypeError(type(obj))


# ----------------------------------------------------------------------------- ZMTP 3.0
def _greeting() -> bytes:
    mech = b"NULL" + b"\x00" * 16
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mech + b"\x00" + b"\x00" * 31


def _command(name: bytes, body: bytes) -> bytes:
    payload = bytes([len(name)]) + name + body
    if len(payload) <= 255:
        return b"\x04" + bytes([len(payload)]) + payload
    return b"\x06" + struct.pack(">Q", len(payload)) + payload


def _prop(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _frame(data: bytes, more: bool) -> bytes:
    if len(data) <= 255:
        return bytes([0x01 if more else 0x00, len(data)]) + data
    return bytes([0x03 if more else 0x02]) + struct.pack(">Q", len(data)) + data


def _recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return buf


def _read_frame(sock):
    flags = _recv_exact(sock, 1)[0]
    if flags & 0x02:
        size = struct.unpack(">Q", _recv_exact(sock, 8))[0]
    else:
        size = _recv_exact(sock, 1)[0]
    return flags, _recv_exact(sock, size)


class FakeEnginePublisher:
    """A ZMQ PUB socket bound on 127.0.0.1:port that accepts SUB peers."""

    def __init__(self, port: int, topic: bytes = b""):
        self.topic = topic
        self.seq = 0
        self.peers = []
        self.subscribed = threading.Event()
        self.lock = threading.Lock()
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", port))
        self.srv.listen(8)
        self.closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self):
        while not self.closed:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn,), daemon=True).start()

    def _handshake(self, conn):
        try:
            conn.sendall(_greeting())
            _recv_exact(conn, 64)
            conn.sendall(_command(b"READY", _prop(b"Socket-Type", b"PUB")))
            flags, _ready = _read_frame(conn)  # peer READY (Socket-Type SUB)
            with self.lock:
                self.peers.append(conn)
            while True:  # subscriptions: message frames starting with 0x01 (ZMTP 3.0)
                flags, body = _read_frame(conn)
                if (flags & 0x04) or (body[:1] == b"\x01"):
                    self.subscribed.set()
        except (ConnectionError, OSError):
            with self.lock:
                if conn in self.peers:
                    self.peers.remove(conn)

    def wait_subscribed(self, timeout=10.0) -> bool:
        return self.subscribed.wait(timeout)

    def publish(self, events, dp_rank=0):
        payload = mp_pack([time.time(), events, dp_rank])
        msg = (
            _frame(self.topic, True)
            + _frame(struct.pack(">Q", self.seq), True)
            + _frame(payload, False)
        )
        self.seq += 1
        with self.lock:
            for p in list(self.peers):
                try:
                    p.sendall(msg)
                except OSError:
                    self.peers.remove(p)

    def close(self):
        self.closed = True
        try:
            self.srv.close()
        except OSError:
            pass
        with self.lock:
            for p in self.peers:
                try:
                    p.close()
                except OSError:
                    pass
            self.peers.clear()


def block_stored(block_hashes, parent, token_ids, block_size, medium="GPU", *, lora_name=None,
                 extra_keys=None, block_mm_infos=None):
    """Array form. Positions 7-9 (lora_name, extra_keys, block_mm_infos) are appended only when
    one of them is given: vLLM's `extra_keys` is a per-block list of strings (a 64-hex-digit MM
    identifier maps to mm_hash = its first 16 hex digits); `block_mm_infos` is Dynamo's own
    per-block `{"mm_objects": [{"mm_hash", "offsets"}]}` form, read at position 9."""
    event = ["BlockStored", block_hashes, parent, token_ids, block_size, None, medium]
    if lora_name is not None or extra_keys is not None or block_mm_infos is not None:
        event += [lora_name, extra_keys, block_mm_infos]
    return event


def block_removed(block_hashes, medium="GPU"):
    return ["BlockRemoved", block_hashes, medium]


def all_cleared():
    return ["AllBlocksCleared"]
