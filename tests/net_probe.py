"""Copied into sandboxes by test_network.py: runs socket probes, prints one JSON object.

argv[1]: JSON list of [name, probe, *args]; each result is "ok:<data>" or "err:<ERRNO|TIMEOUT>",
plus "<name>.s", the seconds it took.
"""
import errno, json, socket, sys, time

def _err(e):
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "err:TIMEOUT"
    return "err:" + (errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__)

def tcp(host, port, family="inet"):
    fam = socket.AF_INET6 if family == "inet6" else socket.AF_INET
    try:
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect((host, port))
        data = s.recv(100).decode().strip()
        s.close()
        return "ok:" + data
    except OSError as e:
        return _err(e)

def udp_sendto(host, port, payload):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(2)
        s.sendto(payload.encode(), (host, port))
        return "ok:" + s.recv(100).decode()
    except OSError as e:
        return _err(e)

def udp_connect(host, port, payload):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(2)
        s.connect((host, port))
        s.send(payload.encode())
        return "ok:" + s.recv(100).decode()
    except OSError as e:
        return _err(e)

def fastopen(host, port):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2)
        s.sendto(b"x", socket.MSG_FASTOPEN, (host, port))
        return "ok:" + s.recv(100).decode().strip()
    except OSError as e:
        return _err(e)

def sock(kind):
    args = {"raw": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
            "ping": (socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP),
            "packet": (socket.AF_PACKET, socket.SOCK_RAW, 0),
            "sctp": (socket.AF_INET, socket.SOCK_STREAM, 132),
            "udplite": (socket.AF_INET, socket.SOCK_DGRAM, 136)}[kind]
    try:
        socket.socket(*args).close()
        return "ok:"
    except OSError as e:
        return _err(e)

def loopback():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname(), timeout=2)
    a, _ = srv.accept()
    a.sendall(b"lo")
    return "ok:" + c.recv(10).decode()

out = {}
for name, fn, *args in json.loads(sys.argv[1]):
    t = time.monotonic()
    out[name] = globals()[fn](*args)
    out[name + ".s"] = round(time.monotonic() - t, 3)
print(json.dumps(out))
