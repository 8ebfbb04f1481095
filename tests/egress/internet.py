"""The egress tests' "internet": run inside a network namespace the test created.

Serves, on every address of the namespace:
  * DNS on UDP 53: A records from NAME=ADDR arguments, a TXT record for any name; every query
    it receives is logged ("query NAME TYPE") so a test can tell what reached it;
  * HTTP on 8080: "hello from the test internet" for any GET;
  * a raw TCP echo server on 7000.
Prints "ready" once all three listen. Standard library only.
"""
import http.server
import socket
import socketserver
import struct
import sys
import threading

RECORDS = {}
for arg in sys.argv[1:]:
    name, addr = arg.split("=", 1)
    RECORDS[name.lower()] = addr


def log(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def dns_server():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 53))
    ready.release()
    while True:
        msg, peer = sock.recvfrom(4096)
        try:
            qid, flags, qd = struct.unpack("!HHH", msg[:6])
            pos, labels = 12, []
            while msg[pos]:
                n = msg[pos]
                labels.append(msg[pos + 1:pos + 1 + n].decode("ascii", "replace"))
                pos += 1 + n
            qtype, qclass = struct.unpack("!HH", msg[pos + 1:pos + 5])
            question = msg[12:pos + 5]
        except Exception as e:  # noqa: BLE001 - a bad query is logged and dropped
            log(f"bad query {e!r}")
            continue
        name = ".".join(labels).lower()
        log(f"query {name} {qtype}")
        answers = b""
        count = 0
        if qtype == 1 and name in RECORDS:
            answers = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 30, 4) + socket.inet_aton(RECORDS[name])
            count = 1
        elif qtype == 16:
            txt = b"tunnelled"
            answers = b"\xc0\x0c" + struct.pack("!HHIH", 16, 1, 30, len(txt) + 1) + bytes([len(txt)]) + txt
            count = 1
        rcode = 0 if count or name in RECORDS else 3
        header = struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, count, 0, 0)
        sock.sendto(header + question + answers, peer)


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = b"hello from the test internet\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while True:
            data = self.request.recv(65536)
            if not data:
                return
            self.request.sendall(data)


class Threaded(socketserver.ThreadingMixIn, socketserver.TCPServer):
    allow_reuse_address = True
    daemon_threads = True


ready = threading.Semaphore(0)
threading.Thread(target=dns_server, daemon=True).start()
ready.acquire()
web = Threaded(("0.0.0.0", 8080), Hello)
echo = Threaded(("0.0.0.0", 7000), Echo)
threading.Thread(target=web.serve_forever, daemon=True).start()
threading.Thread(target=echo.serve_forever, daemon=True).start()
log("ready")
threading.Event().wait()
