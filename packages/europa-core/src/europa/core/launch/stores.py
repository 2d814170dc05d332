"""A run listens on the addresses it was given alone: loopback on one machine, across
nodes the rendezvous endpoint's host and each node's address toward it.

torch's ``TCPStore`` server binds every interface, whatever host it is given; handed a
socket already bound (``master_listen_fd``), it listens there instead. A run's stores
are made here: the lone process's, the background writers', and the two torch's elastic
agent starts (the c10d rendezvous's store, on the endpoint's host, and the store its
workers share, on the address of the node that hosts it), which ``bound_rendezvous``
builds in torch's place.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORT = 29400  # torch's c10d rendezvous's, for an endpoint without one


def is_loopback(host: str) -> bool:
    return host in LOOPBACK


def endpoint_address(endpoint: str) -> tuple[str, int]:
    """A rendezvous endpoint's (host, port), as torch parses ``host:port``."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a rendezvous endpoint is on loopback."""
    return is_loopback(endpoint_address(endpoint)[0])


def store_server(host: str, port: int = 0, **options) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host`` alone (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=4096)
    bound = listener.getsockname()[1]
    return dist.TCPStore(host, bound, is_master=True, master_listen_fd=listener.detach(),
                         **options)  # fmt: skip


def rank_store(host: str, port: int, rank: int, world_size: int, **options) -> dist.TCPStore:
    """A process group's store at ``host:port``: rank 0 hosts it on ``host`` alone (the
    address the others reach it at, one of its machine's), the others join it."""
    if rank == 0:
        return store_server(host, port, world_size=world_size, **options)
    return dist.TCPStore(host, port, world_size, is_master=False, **options)


def host_or_join(host: str, port: int, **options) -> dist.TCPStore:
    """The store at ``host:port``: hosted here on ``host`` alone, or joined when another
    process of the machine hosts it already or ``host`` is another machine's (as torch's
    own rendezvous does)."""
    try:
        return store_server(host, port, **options)
    except OSError as err:
        if err.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
    return dist.TCPStore(host, port, is_master=False, **options)


def address_toward(host: str, port: int) -> str:
    """This machine's address on the interface that reaches ``host`` (that host itself on
    the machine that holds it); no packet is sent."""
    family, kind, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(where)
        return probe.getsockname()[0]


def bound_rendezvous(params):
    """torch's c10d rendezvous handler, its stores bound to one address each: the
    rendezvous's at the endpoint (hosted by the launcher on the endpoint's machine), the
    workers' (hosted by the agent of rank 0) on that agent's own address."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, port = endpoint_address(params.endpoint)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = host_or_join(host, port, multi_tenant=True, timeout=timeout)
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    handler._create_tcp_store_server = lambda addr, port: store_server(  # torch's, bound
        addr, port, multi_tenant=True
    )
    return handler
