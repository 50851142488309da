"""client/websocket.py against a tiny in-test socket server: the handshake, text and binary messages of
each length encoding, a fragmented message, ping/pong, close, timeouts (a frame split across reads is
not lost), a refused handshake and a dropped connection; and a server that breaks the protocol (a
fragmented message over the cap, text that is not UTF-8, frames a client must refuse, random bytes), a
large message read in linear time."""
import random
import socket
import struct
import threading
import time

import pytest

from kiln.client.websocket import (BINARY, CLOSE, CONTINUATION, PING, PONG, TEXT, WebSocket, WebSocketClosed,
                                   WebSocketError, accept_key, encode_frame, parse_frame)


def serve(script, answer=None):
    """A server for one connection: it answers the handshake (or sends `answer` instead), then runs
    script(connection, read_frame). Its URL, and a list that collects what the script returns."""
    listener = socket.create_server(("127.0.0.1", 0))
    results = []

    def run():
        connection, _ = listener.accept()
        listener.close()
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                head += connection.recv(4096)
            headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if ": " in line)
            connection.sendall((answer or (
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Accept: {accept_key(headers['Sec-WebSocket-Key'])}\r\n\r\n")).encode())
            buffer = [b""]

            def read_frame():
                while (frame := parse_frame(buffer[0])) is None:
                    buffer[0] += connection.recv(65536)
                buffer[0] = buffer[0][frame[3]:]
                return frame[:3]

            if script:
                results.append(script(connection, read_frame))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"ws://127.0.0.1:{listener.getsockname()[1]}/ws?clientId=abc", results


def test_messages_both_ways_ping_and_close():
    def script(connection, read_frame):
        connection.sendall(encode_frame(TEXT, b'{"type": "status"}', mask=False))
        connection.sendall(encode_frame(BINARY, bytes(range(200)), mask=False))        # 16-bit length
        connection.sendall(encode_frame(BINARY, b"k" * 70000, mask=False))            # 64-bit length
        connection.sendall(encode_frame(TEXT, b"frag", mask=False, fin=False))
        connection.sendall(encode_frame(PING, b"are you there", mask=False))          # between fragments
        connection.sendall(encode_frame(CONTINUATION, b"ment", mask=False))
        pong = read_frame()
        echo = read_frame()
        connection.sendall(encode_frame(TEXT, echo[2], mask=False))
        connection.sendall(encode_frame(CLOSE, struct.pack(">H", 1001) + b"going away", mask=False))
        return pong, echo, read_frame()

    url, results = serve(script)
    ws = WebSocket.connect(url, timeout=5)
    assert ws.receive(timeout=5) == '{"type": "status"}'
    assert ws.receive(timeout=5) == bytes(range(200))
    assert ws.receive(timeout=5) == b"k" * 70000
    assert ws.receive(timeout=5) == "fragment"
    ws.sock.sendall(encode_frame(TEXT, "écho".encode(), mask=True))  # a client's frame, masked (Kiln sends none)
    assert ws.receive(timeout=5) == "écho"
    with pytest.raises(WebSocketClosed, match="code 1001: going away"):
        ws.receive(timeout=5)
    time.sleep(0.1)
    pong, echo, close = results[0]
    assert pong == (True, PONG, b"are you there")
    assert echo == (True, TEXT, "écho".encode())   # the client masked it; the server's parse_frame unmasked it
    assert close == (True, CLOSE, struct.pack(">H", 1001))


def test_a_timeout_gives_none_and_keeps_a_half_read_frame():
    frame = encode_frame(TEXT, b"x" * 300, mask=False)

    def script(connection, read_frame):
        connection.sendall(frame[:3])
        time.sleep(0.3)
        connection.sendall(frame[3:])
        read_frame()  # the client's close

    url, _ = serve(script)
    ws = WebSocket.connect(url, timeout=5)
    assert ws.receive(timeout=0.1) is None
    assert ws.receive(timeout=5) == "x" * 300
    ws.close()


def test_a_refused_handshake_says_what_the_server_answered():
    url, _ = serve(None, answer="HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(WebSocketError, match="answered 'HTTP/1.1 404 Not Found' instead of switching"):
        WebSocket.connect(url, timeout=5)


def test_a_wrong_accept_key_is_refused():
    url, _ = serve(None, answer="HTTP/1.1 101 Switching Protocols\r\nSec-WebSocket-Accept: nope\r\n\r\n")
    with pytest.raises(WebSocketError, match="Sec-WebSocket-Accept does not match"):
        WebSocket.connect(url, timeout=5)


def test_a_dropped_connection_is_an_error():
    url, _ = serve(lambda connection, read_frame: None)  # handshake, then the server hangs up
    ws = WebSocket.connect(url, timeout=5)
    with pytest.raises(WebSocketError, match="dropped the websocket connection"):
        ws.receive(timeout=5)


def test_frames_round_trip_and_partial_buffers_wait():
    for size in (0, 125, 126, 65535, 65536):
        payload = bytes(i % 251 for i in range(size))
        for mask in (False, True):
            data = encode_frame(BINARY, payload, mask=mask)
            assert parse_frame(data) == (True, BINARY, payload, len(data))
            assert parse_frame(data[:-1] if size else data[:1]) is None
    assert accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # RFC 6455's own example
    with pytest.raises(WebSocketError, match="ws:// or wss://"):
        WebSocket.connect("http://127.0.0.1:1/ws")


# -- a server that breaks the protocol: only WebSocketError comes out, and memory and time stay bounded

def test_a_fragmented_message_is_capped_as_a_whole(monkeypatch):
    """Each fragment is under the cap, their sum is not: refused at the header of the fragment that passes
    it, without waiting for its payload."""
    from kiln.client import websocket

    monkeypatch.setattr(websocket, "MAX_MESSAGE_BYTES", 1000)
    client, server = socket.socketpair()
    with client, server:
        server.sendall(encode_frame(TEXT, b"a" * 500, mask=False, fin=False)
                       + encode_frame(CONTINUATION, b"b" * 500, mask=False))       # 1000 in all: taken
        ws = WebSocket(client)
        assert ws.receive(timeout=5) == "a" * 500 + "b" * 500
        server.sendall(encode_frame(TEXT, b"a" * 600, mask=False, fin=False)
                       + encode_frame(CONTINUATION, b"b" * 600, mask=False)[:4])  # its header only
        with pytest.raises(WebSocketError, match="a websocket message of 1200 bytes or more \\(the most kiln "
                                                 "takes is 1000\\)"):
            ws.receive(timeout=5)


def test_a_text_message_that_is_not_utf8_is_a_websocket_error():
    client, server = socket.socketpair()
    with client, server:
        server.sendall(encode_frame(TEXT, b'{"type": "\xff\xfe"}', mask=False))
        with pytest.raises(WebSocketError, match="a websocket text message that is not UTF-8 \\(invalid start "
                                                 "byte at byte 10 of 14\\)"):
            WebSocket(client).receive(timeout=5)


@pytest.mark.parametrize("frame, says", [
    (encode_frame(PING, b"p" * 126, mask=False), "control frame \\(opcode 0x9\\) of 126 bytes"),
    (encode_frame(PING, b"p", mask=False, fin=False), "control frame \\(opcode 0x9\\) of 1 bytes, fragmented"),
    (bytes([0x80 | 0x40 | TEXT, 1]) + b"x", "reserved bits set \\(first byte 0xc1\\)"),
    (encode_frame(0x3, b"x" * 200, mask=False)[:4], "unexpected websocket frame \\(opcode 0x3\\)"),
    (bytes([0x80 | BINARY, 127]) + struct.pack(">Q", 2**63), f"a websocket message of {2**63} bytes or more"),
])
def test_frames_a_client_must_not_take_are_refused_at_their_header(frame, says):
    client, server = socket.socketpair()
    with client, server:
        server.sendall(frame)
        with pytest.raises(WebSocketError, match=says):
            WebSocket(client).receive(timeout=5)


def test_a_32_mib_message_in_64_kib_reads_comes_whole_through_one_buffer():
    """The receive buffer is one bytearray, appended to and consumed in place (bytes += bytes made
    a new, whole copy on every read: quadratic, 4.3 s for this message)."""
    payload = bytes(range(256)) * (32 * 2**20 // 256)
    frame = encode_frame(BINARY, payload, mask=False) + encode_frame(TEXT, b"after", mask=False)
    client, server = socket.socketpair()
    with client, server:
        def send():
            for at in range(0, len(frame), 65536):
                server.sendall(frame[at:at + 65536])

        writer = threading.Thread(target=send, daemon=True)
        writer.start()
        ws = WebSocket(client)
        buffer = ws.buffer
        assert isinstance(buffer, bytearray)
        assert ws.receive(timeout=30) == payload
        assert ws.receive(timeout=5) == "after"
        writer.join(5)
        assert ws.buffer is buffer and len(buffer) == 0  # the same buffer throughout, emptied as frames were taken


def _fuzz_case(rng) -> bytes:
    """Random bytes, or real frames (any opcode, fin, mask, length encoding) with some bytes changed or cut."""
    if rng.random() < 0.3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    data = b""
    for _ in range(rng.randrange(1, 4)):
        opcode = rng.choice([TEXT, BINARY, CONTINUATION, CLOSE, PING, PONG, 0x3, 0xB])
        payload = rng.choice([b"", b"{}", "é".encode(), b"\xff\xfe", bytes(rng.randrange(256) for _ in range(130)),
                              b'{"type": "status", "data": {}}'])
        data += encode_frame(opcode, payload, mask=rng.random() < 0.3, fin=rng.random() < 0.7)
    data = bytearray(data)
    for _ in range(rng.randrange(3)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data[:rng.randrange(1, len(data) + 1)] if rng.random() < 0.3 else data)


def test_fuzz_the_frame_reader_only_refuses():
    """Random and mangled frames through a socket: receive() gives messages, or raises WebSocketError
    (WebSocketClosed included), and nothing else, whatever the bytes."""
    rng = random.Random(0)
    outcomes = {"messages": 0, "refused": 0, "closed": 0}
    for _ in range(3000):
        client, server = socket.socketpair()
        with client, server:
            server.sendall(_fuzz_case(rng))
            server.shutdown(socket.SHUT_WR)  # then the end of the stream: a WebSocketError at the latest
            ws = WebSocket(client)
            while True:
                try:
                    message = ws.receive(timeout=5)
                except WebSocketClosed:
                    outcomes["closed"] += 1
                    break
                except WebSocketError:
                    outcomes["refused"] += 1
                    break
                assert isinstance(message, (str, bytes))
                outcomes["messages"] += 1
    assert outcomes["messages"] > 200 and outcomes["closed"] > 50 and outcomes["refused"] > 2000, outcomes


def test_a_handshake_answer_that_trickles_in_is_too_slow_past_the_timeout():
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        connection, _ = listener.accept()
        listener.close()
        with connection:
            try:
                connection.recv(65536)
                connection.sendall(b"HTTP/1.1 101 Switching Protocols\r\nX-Pad: ")
                for _ in range(500):  # a byte every 20 ms, 10 s at most
                    connection.sendall(b" ")
                    time.sleep(0.02)
            except OSError:
                pass  # the client gave up

    threading.Thread(target=serve, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(WebSocketError, match="^the server was too slow: its websocket handshake answer did not come "
                                             "whole within 0.3s$"):
        WebSocket.connect(f"ws://127.0.0.1:{listener.getsockname()[1]}/ws", timeout=0.3)
    assert time.monotonic() - start < 1.5


def test_a_long_refusal_is_shown_short():
    url, _ = serve(None, answer="HTTP/1.1 404 Not Found\x1b[2J" + "x" * 60000 + "\r\n\r\n")
    with pytest.raises(WebSocketError) as caught:
        WebSocket.connect(url, timeout=5)
    assert "answered 'HTTP/1.1 404 Not Found\\x1b[2Jxx" in str(caught.value) and len(str(caught.value)) < 300
