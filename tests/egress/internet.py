"""The egress tests' "internet": run inside a network namespace the test created.

Serves, on every address of the namespace:
  * DNS on UDP 53: A records from NAME=ADDR arguments, a TXT record for any name; every query
    it receives is logged ("query NAME TYPE") so a test can tell what reached it;
  * HTTP on 8080: a package index (PEP 503 `/simple/`) holding one pure-Python wheel,
    `egresshello` 1.0, built here at start; "hello from the test internet" for any other GET;
  * raw TCP echo servers on 7000 and 7001;
  * with --tls=CERT,KEY: HTTPS on 8443, the same pages behind that certificate (the test makes
    a CA and a certificate for pypi.test and evil.test).
Prints "ready" once all of them listen. Standard library only.
"""
import base64
import hashlib
import http.server
import io
import socket
import socketserver
import ssl
import struct
import sys
import threading
import zipfile

RECORDS = {}
TLS = None
for arg in sys.argv[1:]:
    if arg.startswith("--tls="):
        TLS = arg[len("--tls="):].split(",", 1)
        continue
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


def build_wheel():
    """egresshello-1.0-py3-none-any.whl, with a RECORD pip can check."""
    files = {
        "egresshello/__init__.py": b"GREETING = 'installed from the test index'\n",
        "egresshello-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: egresshello\nVersion: 1.0\n",
        "egresshello-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: internet.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    record += "egresshello-1.0.dist-info/RECORD,,\n"
    files["egresshello-1.0.dist-info/RECORD"] = record.encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return out.getvalue()


WHEEL_NAME = "egresshello-1.0-py3-none-any.whl"
WHEEL = build_wheel()
PAGES = {
    "/simple/": b'<html><body><a href="/simple/egresshello/">egresshello</a></body></html>\n',
    "/simple/egresshello/": (
        f'<html><body><a href="/packages/{WHEEL_NAME}#sha256={hashlib.sha256(WHEEL).hexdigest()}">'
        f"{WHEEL_NAME}</a></body></html>\n"
    ).encode(),
    f"/packages/{WHEEL_NAME}": WHEEL,
}


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        path = self.path.split("?")[0]
        body = PAGES.get(path, b"hello from the test internet\n")
        self.send_response(200)
        if path.startswith("/simple/"):
            self.send_header("Content-Type", "text/html")
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


class ThreadedTls(Threaded):
    """HTTPS: the handshake runs in the connection's own thread, so a client that stalls in it
    (a proxy that cut the connection after the ClientHello) never holds up the accept loop."""

    def __init__(self, address, handler, context):
        super().__init__(address, handler)
        self.context = context

    def finish_request(self, request, client_address):
        request.settimeout(20)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as e:
            log(f"tls handshake failed {e!r}")
            return
        self.RequestHandlerClass(tls, client_address, self)


ready = threading.Semaphore(0)
threading.Thread(target=dns_server, daemon=True).start()
ready.acquire()
web = Threaded(("0.0.0.0", 8080), Hello)
echo = Threaded(("0.0.0.0", 7000), Echo)
echo2 = Threaded(("0.0.0.0", 7001), Echo)
threading.Thread(target=web.serve_forever, daemon=True).start()
threading.Thread(target=echo.serve_forever, daemon=True).start()
threading.Thread(target=echo2.serve_forever, daemon=True).start()
if TLS:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(TLS[0], TLS[1])
    secure = ThreadedTls(("0.0.0.0", 8443), Hello, context)
    threading.Thread(target=secure.serve_forever, daemon=True).start()
log("ready")
threading.Event().wait()
