"""What a program in a sandbox tries, one attempt per argument group; prints one line per
attempt: "OK <detail>" or "FAIL <why>". Standard library only (the `debian` image's python3).

  resolve NAME            the system resolver (the sandbox's /etc/resolv.conf)
  http HOST PORT          GET / and the status line and body
  echo HOST PORT          send "ping", expect it back
  tls HOST PORT SNI       send a real ClientHello for SNI, expect it echoed back whole
  https HOST PORT SNI     a real TLS handshake naming SNI, checked against /ca.pem, then GET /
  many N HOST PORT        N connections to an echo server held open together, "ping" on each
                          in turn: how many were echoed
  dns TYPE NAME           a raw query of TYPE (number) for NAME to the resolv.conf nameserver
  flows N NAME            N A queries for NAME, each from a new socket, not waiting for answers:
                          "OK ... from ADDR" (the sandbox's address)
  connect HOST PORT       connect and send nothing: OK if the connection is still open 2 s
                          later. For addresses outside the test's namespaces (the metadata
                          address), so that even a broken filter never sends them a request.
"""
import socket
import ssl
import struct
import sys
import threading
import time

TIMEOUT = 20


def nameserver():
    for line in open("/etc/resolv.conf"):
        parts = line.split()
        if parts and parts[0] == "nameserver":
            return parts[1]
    raise RuntimeError("no nameserver in /etc/resolv.conf")


def get(s, host):
    """GET / over connected socket `s`, naming `host`: the status line and the body."""
    s.sendall(f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    if not data:
        raise RuntimeError("connection closed without a reply")
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode() + " " + body.decode().strip()


def query(qtype, name):
    """A DNS query of `qtype` (number) for `name`, recursion desired."""
    q = struct.pack("!HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\0" + struct.pack("!HH", qtype, 1)


def attempt(kind, args):
    if kind == "resolve":
        return socket.gethostbyname(args[0])
    if kind == "http":
        host, port = args[0], int(args[1])
        with socket.create_connection((host, port), timeout=TIMEOUT) as s:
            return get(s, host)
    if kind == "https":
        host, port, sni = args[0], int(args[1]), args[2]
        context = ssl.create_default_context(cafile="/ca.pem")
        with socket.create_connection((host, port), timeout=TIMEOUT) as raw:
            with context.wrap_socket(raw, server_hostname=sni) as s:
                return get(s, sni)
    if kind == "many":
        n, host, port = int(args[0]), args[1], int(args[2])
        held, echoed = [], 0
        try:
            for _ in range(n):
                s = socket.create_connection((host, port), timeout=TIMEOUT)
                held.append(s)
                try:
                    s.sendall(b"ping")
                    if s.recv(4) == b"ping":
                        echoed += 1
                except OSError:
                    pass
        finally:
            for s in held:
                s.close()
        return f"{echoed} of {n} echoed"
    if kind == "httphost":
        # A plain HTTP request to host:port that names another host in its Host header.
        host, port, named = args[0], int(args[1]), args[2]
        with socket.create_connection((host, port), timeout=TIMEOUT) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {named}\r\nConnection: close\r\n\r\n".encode())
            data = s.recv(65536)
        if not data:
            raise RuntimeError("connection closed without a reply")
        return data.split(b"\r\n")[0].decode()
    if kind == "idle":
        # Connects and sends nothing: how long until the other end closes.
        started = time.monotonic()
        with socket.create_connection((args[0], int(args[1])), timeout=TIMEOUT) as s:
            data = s.recv(1)
        if data:
            raise RuntimeError(f"got {data!r}")
        return f"closed after {time.monotonic() - started:.1f} s"
    if kind == "bulk":
        # Sends n bytes to an echo server and reads them back: the seconds it took.
        host, port, n = args[0], int(args[1]), int(args[2])
        started = time.monotonic()
        with socket.create_connection((host, port), timeout=TIMEOUT) as s:
            # Written from a thread while this one reads, so neither end's buffers can fill up
            # with the other waiting.
            sender = threading.Thread(target=s.sendall, args=(b"x" * n,), daemon=True)
            sender.start()
            got = 0
            while got < n:
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise RuntimeError(f"closed after {got} bytes")
                got += len(chunk)
            sender.join()
        return f"{n} bytes in {time.monotonic() - started:.2f} s"
    if kind == "echo":
        with socket.create_connection((args[0], int(args[1])), timeout=TIMEOUT) as s:
            s.sendall(b"ping")
            data = s.recv(100)
        if data != b"ping":
            raise RuntimeError(f"got {data!r}")
        return "ping"
    if kind == "tls":
        host, port, sni = args[0], int(args[1]), args[2]
        ctx = ssl.create_default_context()
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            pass
        hello = outgoing.read()
        with socket.create_connection((host, port), timeout=TIMEOUT) as s:
            s.sendall(hello)
            data = b""
            while len(data) < len(hello):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        if data != hello:
            raise RuntimeError(f"{len(data)} of {len(hello)} bytes echoed")
        return f"echoed {len(hello)} bytes"
    if kind == "connect":
        with socket.create_connection((args[0], int(args[1])), timeout=TIMEOUT) as s:
            # The daemon's proxy closes a refused connection at once; an open one stays open.
            s.settimeout(2)
            try:
                data = s.recv(1)
            except socket.timeout:
                return "open"
        raise RuntimeError(f"closed ({data!r})")
    if kind == "dns":
        qtype, name = int(args[0]), args[1]
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(TIMEOUT)
        s.sendto(query(qtype, name), (nameserver(), 53))
        data, _ = s.recvfrom(4096)
        rcode, ancount = data[3] & 0xF, struct.unpack("!H", data[6:8])[0]
        if rcode != 0 or ancount == 0:
            raise RuntimeError(f"rcode {rcode} answers {ancount}")
        return f"answers {ancount}"
    if kind == "flows":
        # N A queries for NAME, each from a socket of its own (a connection-tracking flow each),
        # sent without waiting for answers; says the sandbox's own address.
        n, q, ns = int(args[0]), query(1, args[1]), nameserver()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
            c.connect((ns, 53))
            me = c.getsockname()[0]
        for _ in range(n):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(q, (ns, 53))
        return f"from {me}"
    raise RuntimeError(f"unknown attempt {kind}")


ARITY = {"resolve": 1, "http": 2, "httphost": 3, "idle": 2, "bulk": 3, "echo": 2, "tls": 3, "https": 3, "many": 3, "dns": 2, "flows": 2, "connect": 2}
argv = sys.argv[1:]
while argv:
    kind, args = argv[0], argv[1:1 + ARITY.get(argv[0], 0)]
    argv = argv[1 + len(args):]
    try:
        print("OK", kind, *args, "->", attempt(kind, args), flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is an answer here
        print("FAIL", kind, *args, "->", type(e).__name__, e, flush=True)
