"""A minimal WebSocket client (RFC 6455) over a plain socket, enough for ComfyUI's /ws: the opening
handshake, text and binary messages (fragmented ones too), ping/pong and close. Standard library only.

    ws = WebSocket.connect("ws://127.0.0.1:8188/ws?clientId=abc", timeout=10)
    message = ws.receive(timeout=1.0)   # str (text), bytes (binary) or None (nothing within the timeout)
    ws.close()

The frame functions (encode_frame, parse_frame, accept_key) serve a server too: the tests' stand-in
ComfyUI uses them.
"""
from __future__ import annotations

import base64
import hashlib
import os
import reprlib
import socket
import ssl
import struct
import time
import urllib.parse

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3
CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
MAX_MESSAGE_BYTES = 256 * 2**20  # a preview image is well under this; more means a broken stream

_SHORT = reprlib.Repr()  # the server's status line in an error: quoted, control characters escaped, cut short
_SHORT.maxstring = 80


class WebSocketError(ConnectionError):
    """The handshake was refused, the stream broke the protocol, or the connection dropped."""


class WebSocketClosed(WebSocketError):
    """The server closed the connection (its close code and reason are in the message)."""


def accept_key(key: str) -> str:
    """The Sec-WebSocket-Accept a server answers to a client's Sec-WebSocket-Key."""
    return base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()


def _masked(payload: bytes, key: bytes) -> bytes:
    if not payload:
        return payload
    repeated = (key * (len(payload) // 4 + 1))[: len(payload)]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(len(payload), "big")


def encode_frame(opcode: int, payload: bytes, mask: bool, fin: bool = True) -> bytes:
    """One frame. A client masks what it sends (mask=True); a server does not."""
    head = bytes([(0x80 if fin else 0) | opcode])
    flag = 0x80 if mask else 0
    if len(payload) < 126:
        head += bytes([flag | len(payload)])
    elif len(payload) < 2**16:
        head += bytes([flag | 126]) + struct.pack(">H", len(payload))
    else:
        head += bytes([flag | 127]) + struct.pack(">Q", len(payload))
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + _masked(payload, key)


def parse_head(buffer) -> tuple | None:
    """(fin, opcode, payload length, mask key or b"", header length) of the frame at the start of
    `buffer` (bytes or bytearray); None until its whole header has arrived. WebSocketError if it sets
    a reserved bit: no extension was agreed."""
    if len(buffer) < 2:
        return None
    if buffer[0] & 0x70:
        raise WebSocketError(f"a websocket frame with reserved bits set (first byte {buffer[0]:#04x}): "
                             "no extension was agreed")
    fin, opcode = bool(buffer[0] & 0x80), buffer[0] & 0x0F
    masked, length, at = bool(buffer[1] & 0x80), buffer[1] & 0x7F, 2
    if length == 126:
        if len(buffer) < 4:
            return None
        length, at = struct.unpack(">H", buffer[2:4])[0], 4
    elif length == 127:
        if len(buffer) < 10:
            return None
        length, at = struct.unpack(">Q", buffer[2:10])[0], 10
    key = b""
    if masked:
        if len(buffer) < at + 4:
            return None
        key, at = bytes(buffer[at:at + 4]), at + 4
    return fin, opcode, length, key, at


def parse_frame(buffer):
    """(fin, opcode, payload, bytes used) of the frame at the start of `buffer`, unmasked; None if the
    buffer does not hold a whole frame yet."""
    head = parse_head(buffer)
    if head is None:
        return None
    fin, opcode, length, key, at = head
    if length > MAX_MESSAGE_BYTES:
        raise WebSocketError(f"a websocket frame of {length} bytes: the stream is broken")
    if len(buffer) < at + length:
        return None
    payload = bytes(buffer[at:at + length])
    return fin, opcode, _masked(payload, key) if key else payload, at + length


class WebSocket:
    """A client connection: receive() gives whole messages and answers pings; close() says goodbye.

    The bytes received wait in a bytearray: new ones are appended and a frame's are deleted from the
    front once it is whole, both amortised constant time per byte, and a frame header is read where
    it lies, so a large message costs time in proportion to its size (bytes += bytes copied the whole
    buffer on every read: a 32 MiB message took 4.3 s)."""

    def __init__(self, sock: socket.socket, buffer: bytes = b""):
        self.sock = sock
        self.buffer = bytearray(buffer)
        self.fragments: list[bytes] = []
        self.fragment_bytes = 0  # the fragmented message's size so far: MAX_MESSAGE_BYTES caps it whole
        self.fragment_opcode = 0

    @classmethod
    def connect(cls, url: str, timeout: float = 10.0, headers: dict | None = None) -> "WebSocket":
        """Open `url` (ws:// or wss://) and do the opening handshake, all within `timeout` seconds (a server
        that answers a byte now and then cannot hold it longer). WebSocketError says why it failed;
        OSError if the host cannot be reached."""
        deadline = time.monotonic() + timeout
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("ws", "wss"):
            raise WebSocketError(f"{url}: a websocket URL starts with ws:// or wss://")
        port = parts.port or (443 if parts.scheme == "wss" else 80)
        sock = socket.create_connection((parts.hostname, port), timeout=timeout)
        try:
            if parts.scheme == "wss":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
            key = base64.b64encode(os.urandom(16)).decode()
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            lines = [f"GET {target} HTTP/1.1", f"Host: {parts.netloc}", "Upgrade: websocket", "Connection: Upgrade",
                     f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
            lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            status, answer, rest = _read_http_head(sock, deadline, timeout)
            if status.split()[1:2] != ["101"]:
                raise WebSocketError(f"{url}: the server answered {_SHORT.repr(status)} instead of switching to a "
                                     "websocket")
            if answer.get("sec-websocket-accept") != accept_key(key):
                raise WebSocketError(f"{url}: the server's Sec-WebSocket-Accept does not match the key sent")
        except BaseException:
            sock.close()
            raise
        return cls(sock, rest)

    def receive(self, timeout: float | None = None):
        """The next message: str for text, bytes for binary; None if none arrived within `timeout`
        seconds. Pings are answered on the way; a close raises WebSocketClosed; a stream that breaks
        the protocol (a frame or message over MAX_MESSAGE_BYTES, text that is not UTF-8, ...) raises
        WebSocketError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frame = self._take_frame()
            if frame is None:
                if not self._fill(deadline):
                    return None
                continue
            message = self._message(*frame)
            if message is not None:
                return message

    def _take_frame(self):
        """(fin, opcode, payload) of the frame at the start of the buffer, taken off it; None until all
        of it has arrived. Its header is checked as soon as it is in, before its payload is waited for."""
        head = parse_head(self.buffer)
        if head is None:
            return None
        fin, opcode, length, key, at = head
        self._check_frame(fin, opcode, length)
        end = at + length
        if len(self.buffer) < end:
            return None
        payload = bytes(self.buffer[at:end])
        del self.buffer[:end]
        return fin, opcode, _masked(payload, key) if key else payload

    def _check_frame(self, fin: bool, opcode: int, length: int) -> None:
        """WebSocketError for a frame this client must not take: an unknown opcode, a control frame that
        is fragmented or over 125 bytes (RFC 6455 section 5.5), a message that would pass MAX_MESSAGE_BYTES
        with this frame (its fragments counted together)."""
        if opcode in (CLOSE, PING, PONG):
            if length > 125 or not fin:
                raise WebSocketError(f"a websocket control frame (opcode {opcode:#x}) of {length} bytes"
                                     f"{'' if fin else ', fragmented'}: the stream is broken")
        elif opcode in (TEXT, BINARY, CONTINUATION):
            total = length + (self.fragment_bytes if opcode == CONTINUATION else 0)
            if total > MAX_MESSAGE_BYTES:
                raise WebSocketError(f"a websocket message of {total} bytes or more (the most kiln takes is "
                                     f"{MAX_MESSAGE_BYTES}): the stream is broken")
        else:
            raise WebSocketError(f"unexpected websocket frame (opcode {opcode:#x})")

    def _message(self, fin: bool, opcode: int, payload: bytes):
        if opcode == PING:
            self._send(encode_frame(PONG, payload, mask=True))
            return None
        if opcode == PONG:
            return None
        if opcode == CLOSE:
            code = struct.unpack(">H", payload[:2])[0] if len(payload) >= 2 else 1005
            reason = _printable(payload[2:].decode(errors="replace"))
            try:
                self.sock.sendall(encode_frame(CLOSE, payload[:2], mask=True))
            except OSError:
                pass  # the server may already have gone; the connection is closed either way
            self.sock.close()
            raise WebSocketClosed(f"the server closed the websocket (code {code}{': ' + reason if reason else ''})")
        if opcode in (TEXT, BINARY):
            if self.fragments:
                raise WebSocketError("a new websocket message began inside a fragmented one")
            self.fragment_opcode = opcode
        elif not self.fragments:
            raise WebSocketError("a websocket continuation frame with no message begun")
        self.fragments.append(payload)
        self.fragment_bytes += len(payload)
        if not fin:
            return None
        data, kind = b"".join(self.fragments), self.fragment_opcode
        self.fragments, self.fragment_bytes, self.fragment_opcode = [], 0, 0
        if kind == BINARY:
            return data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WebSocketError(f"the server sent a websocket text message that is not UTF-8 ({exc.reason} at "
                                 f"byte {exc.start} of {len(data)})") from None

    def _fill(self, deadline) -> bool:
        """Read more bytes into the buffer; False if the deadline passed first."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536)
        except (socket.timeout, TimeoutError):
            return False
        except OSError as exc:
            raise WebSocketError(f"the websocket connection broke ({exc})") from None
        if not data:
            raise WebSocketError("the server dropped the websocket connection")
        self.buffer += data
        return True

    def _send(self, frame: bytes) -> None:
        try:
            self.sock.sendall(frame)
        except OSError as exc:
            raise WebSocketError(f"the websocket connection broke ({exc})") from None

    def close(self, code: int = 1000) -> None:
        """Send a close frame and shut the socket (without waiting for the server's reply)."""
        try:
            self.sock.sendall(encode_frame(CLOSE, struct.pack(">H", code), mask=True))
        except OSError:
            pass  # already broken: closing is all that is left
        self.sock.close()


def _printable(text: str) -> str:
    """The server's text on one line, its control characters as spaces."""
    return "".join(c if c.isprintable() else " " for c in text).strip()


def _read_http_head(sock: socket.socket, deadline: float, timeout: float) -> tuple[str, dict, bytes]:
    """The status line and headers (lower-case names) of an HTTP answer, and any bytes after them;
    WebSocketError if they have not all come by `deadline` (time.monotonic(); `timeout` seconds after
    the connection began)."""
    too_slow = WebSocketError(f"the server was too slow: its websocket handshake answer did not come whole within "
                              f"{timeout:g}s")
    data = b""
    while b"\r\n\r\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise too_slow
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(4096)
        except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
            raise too_slow from None
        if not chunk:
            raise WebSocketError("the server closed the connection during the websocket handshake")
        data += chunk
        if len(data) > 65536:
            raise WebSocketError("the websocket handshake answer is too long")
    head, rest = data.split(b"\r\n\r\n", 1)
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, rest
