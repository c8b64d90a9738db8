"""A fake DNS server on 127.0.0.1 (UDP) for tests of name resolution:

    dns = FakeDNS("silent")       # never answers
    dns = FakeDNS("nxdomain")     # every name: NXDOMAIN (rcode 3)
    dns = FakeDNS("servfail")     # every name: SERVFAIL (rcode 2)
    dns = FakeDNS({"pubsub.test": "127.0.0.1"})   # A records, others NXDOMAIN
    ... resolver 127.0.0.1:<dns.port> ...
    dns.queries    # names asked for
    dns.close()
"""

import socket
import struct
import threading


class FakeDNS:
    def __init__(self, mode):
        self.mode = mode
        self.queries = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.addr = "127.0.0.1:%d" % self.port
        self.stopped = False
        threading.Thread(target=self._loop, daemon=True).start()

    def close(self):
        self.stopped = True
        self.sock.close()

    def _loop(self):
        while not self.stopped:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            if len(data) < 12:
                continue
            name, qend = self._qname(data)
            qtype = struct.unpack("!H", data[qend:qend + 2])[0]
            self.queries.append(name)
            if self.mode == "silent":
                continue
            answer = self._answer(data, name, qtype, qend)
            try:
                self.sock.sendto(answer, peer)
            except OSError:
                return

    @staticmethod
    def _qname(data):
        labels, i = [], 12
        while data[i]:
            n = data[i]
            labels.append(data[i + 1:i + 1 + n].decode())
            i += 1 + n
        return ".".join(labels), i + 1

    def _answer(self, q, name, qtype, qend):
        question = q[12:qend + 4]
        rcode, records = 0, b""
        if self.mode == "nxdomain":
            rcode = 3
        elif self.mode == "servfail":
            rcode = 2
        else:
            ip = self.mode.get(name)
            if ip is None:
                rcode = 3
            elif qtype == 1:
                records = (b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4)
                           + socket.inet_aton(ip))
        flags = 0x8180 | rcode
        head = struct.pack("!HHHHHH", struct.unpack("!H", q[:2])[0], flags,
                           1, 1 if records else 0, 0, 0)
        return head + question + records
