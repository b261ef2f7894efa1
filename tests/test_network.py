"""areal.utils.network: free ports are not handed out twice by one process."""

from __future__ import annotations

import socket

from areal.utils.network import find_free_ports


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound():
    first = find_free_ports(1)[0]
    later = find_free_ports(64)
    assert first not in later and len(set(later)) == 64
    # each was free: it can be bound now
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", first))
