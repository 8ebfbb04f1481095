"""egress_bench's client: the same program runs directly on the host and inside a sandbox, so the
two differ only in the path their packets take. Standard library only (the `debian` image's
python3). Prints one JSON line:

  {"clock_resolution_s": R, "echo_ms": [...], "bulk_bytes": B, "bulk_seconds": [...], "dns_ms": [...]}

  echo_ms       per round: connect to HOST:PORT, send 1 byte, read it back (TCP_NODELAY); the
                close is not timed. HOST is resolved once before the rounds (a name through the
                system resolver, so an ALLOWLIST sandbox gets its address the allowed way).
  bulk_*        per run (--bulk-runs), one connection: BULK bytes sent from a thread while the
                main thread reads the echo; seconds from before the connect to the last byte back.
  dns_ms        per round: a raw A query for NAME to SERVER:53 ("resolv" = the nameserver of
                /etc/resolv.conf), until a NOERROR answer with a record comes back.
"""
import argparse
import json
import socket
import struct
import sys
import threading
import time

TIMEOUT = 30


def echo_rounds(addr, port, n):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        s = socket.create_connection((addr, port), timeout=TIMEOUT)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"x")
        if s.recv(1) != b"x":
            raise RuntimeError("the echo server did not echo the byte")
        out.append(round((time.perf_counter() - t) * 1000, 4))
        s.close()
    return out


def bulk(addr, port, total):
    # 64 KiB of every byte value, the same each run. Not random: under an allow list the proxy
    # reads a first byte 0x16 as a TLS handshake and refuses one that is no ClientHello.
    chunk = bytes(range(256)) * 256
    t = time.perf_counter()
    s = socket.create_connection((addr, port), timeout=TIMEOUT)
    errors = []

    def send():
        try:
            left = total
            while left > 0:
                n = min(left, len(chunk))
                s.sendall(chunk[:n])
                left -= n
            s.shutdown(socket.SHUT_WR)
        except OSError as e:
            errors.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    got = 0
    while True:
        data = s.recv(1 << 20)
        if not data:
            break
        got += len(data)
    seconds = time.perf_counter() - t
    sender.join()
    s.close()
    if errors:
        raise RuntimeError(f"sending: {errors[0]}")
    if got != total:
        raise RuntimeError(f"echoed {got} of {total} bytes")
    return seconds


def nameserver():
    for line in open("/etc/resolv.conf"):
        parts = line.split()
        if parts and parts[0] == "nameserver":
            return parts[1]
    raise RuntimeError("no nameserver in /etc/resolv.conf")


def dns_rounds(server, name, n):
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack("!HH", 1, 1)
    out = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(5)
    for i in range(n):
        qid = (i * 7919 + 1) & 0xFFFF
        t = time.perf_counter()
        sock.sendto(struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question, (server, 53))
        while True:
            msg = sock.recv(4096)
            rid, flags, _, answers = struct.unpack("!HHHH", msg[:8])
            if rid == qid:
                break
        if flags & 0xF or answers < 1:
            raise RuntimeError(f"{name}: rcode {flags & 0xF}, {answers} answers")
        out.append(round((time.perf_counter() - t) * 1000, 4))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--bulk", type=int, default=64 << 20)
    p.add_argument("--bulk-runs", type=int, default=3)
    p.add_argument("--dns-server", help='an address, or "resolv"')
    p.add_argument("--dns-name")
    p.add_argument("--dns-rounds", type=int, default=100)
    a = p.parse_args()
    addr = socket.gethostbyname(a.host)
    # Warm-up: the first connection pays for ARP, the proxy's first accept and Python's imports.
    echo_rounds(addr, a.port, 3)
    # A guest kernel on a jiffies clock (a microVM whose TSC it marked unstable) reads time in
    # 4 ms steps: the bench refuses such a clock rather than report its steps as latencies.
    result = {"clock_resolution_s": time.get_clock_info("perf_counter").resolution}
    result["echo_ms"] = echo_rounds(addr, a.port, a.rounds)
    result["bulk_bytes"] = a.bulk
    result["bulk_seconds"] = [bulk(addr, a.port, a.bulk) for _ in range(a.bulk_runs)]
    if a.dns_server and a.dns_name:
        server = nameserver() if a.dns_server == "resolv" else a.dns_server
        result["dns_ms"] = dns_rounds(server, a.dns_name, a.dns_rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001 - one line on stderr, exit 1: the bench names the path
        print(f"bench_client: {e!r}", file=sys.stderr)
        sys.exit(1)
