"""Small network helpers: free ports and this host's IP."""

from __future__ import annotations

import collections
import socket
import threading

#: ports recently handed out by find_free_ports in this process (not handed out again)
_RECENT_MAX = 4096
_RECENT: collections.deque[int] = collections.deque(maxlen=_RECENT_MAX)
_RECENT_LOCK = threading.Lock()


def find_free_ports(
    count: int = 1, host: str = "127.0.0.1", exclude: set[int] | None = None
) -> list[int]:
    """Return ``count`` distinct ports that were free when probed (races are still possible).

    A port handed out by an earlier call of this process is not handed out again for the
    next ``_RECENT_MAX`` ports: the caller may not have bound it yet (a test picks a port,
    then the trainer it configures picks its workers' ports before binding the first)."""
    with _RECENT_LOCK:
        recent = set(_RECENT)
    exclude = set(exclude or ()) | recent
    ports: list[int] = []
    socks = []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in exclude and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    with _RECENT_LOCK:
        _RECENT.extend(ports)
    return ports


def find_free_port(host: str = "127.0.0.1") -> int:
    """One port that was free when probed."""
    return find_free_ports(1, host)[0]


def gethostname() -> str:
    return socket.gethostname()


def gethostip(probe_host: str = "10.255.255.255", probe_port: int = 1) -> str:
    """This machine's outward-facing IPv4 address (no packet is sent).

    The address of the route to ``probe_host``; on a node without a default route (an
    isolated cluster network, a network namespace) the first non-loopback interface
    address instead, so a worker never publishes 127.0.0.1 to other nodes while it has a
    real address. 127.0.0.1 only when the machine has no other IPv4 address.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((probe_host, probe_port))
        ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    finally:
        s.close()
    return next(iter(interface_ips()), "127.0.0.1")


def interface_ips() -> list[str]:
    """IPv4 addresses of this machine's interfaces, loopback excluded (Linux, SIOCGIFADDR)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    ips = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(
                    s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode())
                )
            except OSError:  # no IPv4 address on this interface
                continue
            ip = socket.inet_ntoa(packed[20:24])
            if not ip.startswith("127."):
                ips.append(ip)
    return ips
