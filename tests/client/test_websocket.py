"""client/websocket.py against a tiny in-test socket server: the handshake, text and binary messages of
each length encoding, a fragmented message, ping/pong, close, timeouts (a frame split across reads is
not lost), a refused handshake and a dropped connection."""
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
    ws.send_text("écho")
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
