"""Address decisions of the rendezvous store: who hosts, what each node advertises."""

from __future__ import annotations

import socket

import pytest

from nvrx.launcher.agent.config import RdzvSettings
from nvrx.launcher.agent.store import advertised_address
from nvrx.common.net import bind_listen, local_addresses, local_bind_address, resolve


def settings(host: str, local_addr: str | None = None) -> RdzvSettings:
    return RdzvSettings(
        host=host,
        port=29400,
        run_id="job",
        min_nodes=1,
        max_nodes=2,
        nproc_per_node=1,
        node_rank=None,
        local_addr=local_addr,
    )


def test_loopback_endpoints_are_hosted_here() -> None:
    assert local_bind_address("127.0.0.1") == "127.0.0.1"
    assert local_bind_address("localhost") == "127.0.0.1"  # IPv4 preferred over ::1


def test_remote_or_unresolvable_endpoints_are_not_local() -> None:
    assert local_bind_address("192.0.2.1") is None  # TEST-NET-1, never configured
    assert local_bind_address("nvrx-no-such-host.invalid") is None


def test_own_hostname_is_local_when_it_resolves() -> None:
    name = socket.gethostname()
    if not resolve(name):
        pytest.skip("this machine's hostname does not resolve")
    addr = local_bind_address(name)
    assert addr is not None and (addr in local_addresses() or addr.startswith("127."))


def test_advertised_address_prefers_local_addr() -> None:
    assert advertised_address(settings("192.0.2.1", local_addr="10.1.2.3"), "192.0.2.1", 29400) == "10.1.2.3"


def test_advertised_address_for_loopback_endpoint() -> None:
    assert advertised_address(settings("127.0.0.1"), "127.0.0.1", 29400) == "127.0.0.1"
    assert advertised_address(settings("localhost"), "localhost", 29400) == "127.0.0.1"


@pytest.mark.integration  # starts a process / opens a socket
def test_advertised_address_is_the_route_to_a_remote_endpoint() -> None:
    addr = advertised_address(settings("192.0.2.1"), "192.0.2.1", 29400)
    assert addr in local_addresses() or addr == socket.gethostname()


@pytest.mark.integration  # starts a process / opens a socket
def test_bind_listen_uses_exactly_the_given_address() -> None:
    with bind_listen("127.0.0.1", 0) as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
