"""An edge's service port (issue 28.4, first part): kept in its home, so an edge restarted on
its node serves where it did; `--edge-port` fixes it (a taken one is an error naming it)."""

from __future__ import annotations

import socket

import pytest

from dsec.cluster.actors import PORT_FILE, edge_socket
from dsec.types import Unavailable


def test_the_port_is_kept_in_the_home_and_a_fixed_one_is_checked(tmp_path):
    first = edge_socket(tmp_path, "127.0.0.1")
    port = first.getsockname()[1]
    assert (tmp_path / PORT_FILE).read_text().strip() == str(port)
    first.close()
    again = edge_socket(tmp_path, "127.0.0.1")          # a restart: the same port
    assert again.getsockname()[1] == port
    (tmp_path / "other").mkdir()
    with pytest.raises(Unavailable) as e:                # fixed, and taken (by `again`)
        edge_socket(tmp_path / "other", "127.0.0.1", port)
    assert e.value.field == "edge_port" and str(port) in str(e.value)
    # the kept port taken by someone else meanwhile: a free one, kept from now on
    moved = edge_socket(tmp_path, "127.0.0.1")
    assert moved.getsockname()[1] != port
    assert (tmp_path / PORT_FILE).read_text().strip() == str(moved.getsockname()[1])
    for s in (again, moved):
        assert isinstance(s, socket.socket)
        s.close()
