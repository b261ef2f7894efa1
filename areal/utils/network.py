"""Small network helpers: free ports and this host's IP."""

from __future__ import annotations

import socket


def find_free_ports(
    count: int = 1, host: str = "127.0.0.1", exclude: set[int] | None = None
) -> list[int]:
    """Return ``count`` distinct ports that were free when probed (races are still possible)."""
    exclude = set(exclude or ())
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
    return ports


def find_free_port(host: str = "127.0.0.1") -> int:
    """One port that was free when probed."""
    return find_free_ports(1, host)[0]


def gethostname() -> str:
    return socket.gethostname()


def gethostip(probe_host: str = "10.255.255.255", probe_port: int = 1) -> str:
    """This machine's outward-facing IPv4 address (no packet is sent); 127.0.0.1 as fallback."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((probe_host, probe_port))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()
