"""The fake Pub/Sub's fast mode: a sink for the benchmark that answers
publish requests as fast as Python can, so that the sink's own CPU (it
shares the machine with nginx and wrk) stays small next to what is
measured.

    sink = FastSink()
    ... nginx publishes to sink.host (plain HTTP, keep-alive) ...
    sink.message_count, sink.request_count, sink.bytes
    sink.close()

One thread, non-blocking sockets and a selector; no HTTP library. Any POST
whose path ends in ":publish" is accepted: the messages are counted without
parsing the JSON (base64 holds no quote, so each data value ends at the
next one, which a memchr finds) and each gets a message ID. Messages
without data are not counted; nothing is validated. Anything else gets a
404. For checks of what was sent, use FakePubSub (fake.py).
"""

import selectors
import socket
import threading

READ_SIZE = 256 * 1024
HEADER_MAX = 64 * 1024


def count_data_fields(body, start, end):
    """The messages with data in body[start:end]."""
    n = 0
    find = body.find
    i = find(b'"data":"', start, end)
    while i >= 0:
        n += 1
        j = find(b'"', i + 8, end)
        if j < 0:
            break
        i = find(b'"data":"', j + 1, end)
    return n


def response(status, body):
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n" \
           b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body)


NOT_FOUND = response(b"404 Not Found", b'{"error":{"code":404}}')


class _Conn:
    __slots__ = ("sock", "buf", "out", "closed")

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()
        self.out = b""
        self.closed = False


class FastSink:
    def __init__(self):
        self.message_count = 0
        self.request_count = 0
        self.bytes = 0
        self.connections = 0
        self.next_id = 1
        self.lock = threading.Lock()
        self._stop = False
        self.sel = selectors.DefaultSelector()
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(1024)
        self.lsock.setblocking(False)
        self.sel.register(self.lsock, selectors.EVENT_READ, None)
        self.port = self.lsock.getsockname()[1]
        self.host = "127.0.0.1:%d" % self.port
        self.url = "http://" + self.host
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self):
        self._stop = True
        self.thread.join()
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()

    # -- the loop -----------------------------------------------------------

    def _serve(self):
        while not self._stop:
            for key, mask in self.sel.select(timeout=0.05):
                if key.data is None:
                    self._accept()
                elif mask & selectors.EVENT_WRITE:
                    self._write(key.data, key.data.out)
                else:
                    self._read(key.data)

    def _accept(self):
        while True:
            try:
                sock, _ = self.lsock.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connections += 1
            self.sel.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _drop(self, c):
        if not c.closed:
            c.closed = True
            self.sel.unregister(c.sock)
            c.sock.close()

    def _read(self, c):
        try:
            data = c.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._drop(c)
        if not data:
            return self._drop(c)
        c.buf += data
        out = []
        while True:
            try:
                n = self._request(c, out)
            except ValueError:          # a length that is not a number
                return self._drop(c)
            if n is None:
                break
            del c.buf[:n]
        if out and not c.closed:
            self._write(c, b"".join(out))

    def _request(self, c, out):
        """Answers the request at the front of c.buf; returns its length,
        or None while it is incomplete."""
        buf = c.buf
        end = buf.find(b"\r\n\r\n", 0, HEADER_MAX)
        if end < 0:
            if len(buf) >= HEADER_MAX:
                return self._drop(c)
            return None
        head = bytes(buf[:end]).lower()
        i = head.find(b"\r\ncontent-length:")
        length = 0
        if i >= 0:
            j = head.find(b"\r\n", i + 2)
            length = int(head[i + 17:j if j >= 0 else len(head)])
            if length < 0:
                raise ValueError("negative length")
        body = end + 4
        if len(buf) < body + length:
            return None
        line = head[:head.find(b"\r\n")].split()
        if len(line) < 2 or line[0] != b"post" \
                or not line[1].endswith(b":publish"):
            out.append(NOT_FOUND)
            return body + length
        n = count_data_fields(buf, body, body + length)
        with self.lock:
            first = self.next_id
            self.next_id += n
            self.message_count += n
            self.request_count += 1
            self.bytes += length
        ids = '","'.join(map(str, range(first, first + n)))
        out.append(response(b"200 OK", (
            '{"messageIds":["%s"]}' % ids if n else
            '{"messageIds":[]}').encode()))
        return body + length

    def _write(self, c, data):
        """Sends what it can of data; the rest waits for the socket to be
        writable, and the connection is not read meanwhile."""
        try:
            sent = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return self._drop(c)
        was_waiting = bool(c.out)
        c.out = data[sent:]
        if bool(c.out) != was_waiting:
            self.sel.modify(c.sock, selectors.EVENT_WRITE if c.out
                            else selectors.EVENT_READ, c)
