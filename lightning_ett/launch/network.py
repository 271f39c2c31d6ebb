"""Which address a node advertises, which interface gloo uses, and whether a worker can reach its store.

In a multi-node job torch's rendezvous advertises node 0's *hostname* as the workers' store
address (``RendezvousStoreInfo.build``: ``local_addr or socket.getfqdn()``), and gloo binds to
the address its hostname resolves to. Where ``/etc/hosts`` maps the hostname to 127.0.0.1 (these
machines, many containers) both are loopback: the other nodes' workers then wait in
``init_process_group`` for the 30-minute process-group timeout, with nothing reported. So:

* :func:`advertised_address`: the address on the route to ``--main-address`` (what torchrun's
  ``--local-addr`` would be set to), used when the hostname resolves to loopback;
* :func:`interface_with`: the interface holding that address, for ``GLOO_SOCKET_IFNAME``;
* :func:`check_store_reachable`: run in each worker before the script; a store address that is
  loopback on another node fails at once, one with no route or no answer within
  :data:`UNREACHABLE_TIMEOUT_S`, each with the address and the fix named.

Standard library only (``socket``, ``fcntl``): the launcher runs this before importing torch, and
the worker before the script.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct
import sys
import time

#: A worker whose store address has no route, or does not answer, fails after this long (not the
#: 30-minute process-group timeout). A refused connection is not a failure: the host answers, and
#: rank 0 may not have opened its store yet.
UNREACHABLE_TIMEOUT_S = 30.0
#: Set by the launcher when --main-address is a loopback IP: every node runs on this machine.
ENV_ONE_MACHINE = "LIGHTNING_ETT_NODES_ON_ONE_MACHINE"
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address
_UNREACHABLE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT, errno.EADDRNOTAVAIL}


def is_loopback(host: str) -> bool:
    """Does ``host`` resolve to a loopback address here (or not resolve at all)?"""
    try:
        return _all_loopback(host)
    except OSError:
        return True  # an unresolvable name is as unreachable for the peers as loopback


def _all_loopback(host: str) -> bool:
    """Like :func:`is_loopback`, but a name that does not resolve raises (``socket.gaierror``)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def is_loopback_ip(host: str) -> bool:
    """Is ``host`` a loopback IP address (not a name)? Every node meeting there runs on this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_source(peer: str) -> str | None:
    """The local address the kernel uses to reach ``peer`` (a UDP ``connect`` sends nothing), or None without a route."""
    try:
        family = socket.getaddrinfo(peer, None, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _first_outward_address() -> str | None:
    """An address of this host that is not loopback: the default route's source, else the first interface's."""
    for probe in ("192.0.2.1", "2001:db8::1"):  # documentation addresses: only the route is looked up
        source = route_source(probe)
        if source is not None and not ipaddress.ip_address(source.split("%")[0]).is_loopback:
            return source
    for _, name in socket.if_nameindex():
        address = _interface_address(name)
        if address is not None and not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def advertised_address(main_address: str) -> tuple[str | None, str | None]:
    """What this node should advertise to its peers, and a line saying why, when it is not the hostname.

    ``(None, None)``: the hostname resolves to an address the peers can use, as torch assumes, or every
    node meets on loopback (``--main-address`` a loopback IP: one machine). Otherwise the source address
    of the route to ``main_address`` (what ``--local-addr`` sets); when ``main_address`` is this host's own
    name that resolves to loopback here (Debian's ``127.0.1.1 <hostname>``), its outward address.
    """
    hostname = socket.getfqdn()
    if not is_loopback(hostname) or is_loopback_ip(main_address):
        return None, None
    source = route_source(main_address)
    how = f"the address on the route to --main-address {main_address}"
    if source is None or ipaddress.ip_address(source.split("%")[0]).is_loopback:
        source, how = _first_outward_address(), "this host's outward address"
    if source is None:
        return None, None
    return source, (f"this host's name {socket.gethostname()!r} resolves to loopback, which the other nodes cannot reach; "
                    f"advertising {source} ({how}). Pass --local-addr to choose another.")


def interface_with(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address``, or None (IPv6, or not on this host)."""
    for _, name in socket.if_nameindex():
        if _interface_address(name) == address:
            return name
    return None


def _interface_address(name: str) -> str | None:
    """Interface ``name``'s IPv4 address, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # no IPv4 address on it
    return socket.inet_ntoa(answer[20:24])


def store_answers(host: str, port: int, timeout_s: float = 5.0) -> str:
    """``"answers"`` (something listens), ``"refused"`` (the host answers, nothing listens) or ``"unreachable"``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return "answers"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unreachable"


class StoreUnreachableError(RuntimeError):
    """A worker cannot reach the store its rank 0 hosts (``MASTER_ADDR:MASTER_PORT``)."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable  # a loopback address fails the same way on every attempt; a network down may not


def check_store_reachable(env: dict[str, str] | None = None, timeout_s: float = UNREACHABLE_TIMEOUT_S) -> None:
    """Raise :class:`StoreUnreachableError` if this worker cannot reach its store; return once the host answers.

    Only in a multi-node job (``GROUP_WORLD_SIZE`` > 1) and on nodes that do not host rank 0
    (``GROUP_RANK`` > 0): there the store is on another machine.
    """
    env = dict(os.environ) if env is None else env
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if not host or not port.isdigit() or int(env.get("GROUP_WORLD_SIZE", "1")) < 2 \
            or int(env.get("GROUP_RANK", "0")) == 0 or env.get(ENV_ONE_MACHINE):
        return  # (every node on one machine, meeting on loopback: loopback is right)
    fix = ("the node that hosts rank 0 advertised it to the rendezvous: pass each node's `lightning run` a --local-addr "
           "the other nodes can reach (its address on the network between the nodes), or make its hostname resolve to "
           "that address")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            loopback = _all_loopback(host)
            break
        except OSError as err:  # (a name server that does not answer now may on the next try)
            if time.monotonic() >= deadline:
                raise StoreUnreachableError(f"cannot resolve the store address MASTER_ADDR={host!r} from this host "
                                            f"for {timeout_s:.0f} s ({err}): {fix}.", retryable=True) from None
            time.sleep(1.0)
    if loopback:
        raise StoreUnreachableError(f"the store address MASTER_ADDR={host!r} is loopback on this host, so the store of "
                                    f"rank 0, on another node, cannot be reached: {fix}.", retryable=False)
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except ConnectionRefusedError:
            return  # the host answers; rank 0 opens its store when it gets there
        except OSError as err:
            if not isinstance(err, TimeoutError) and err.errno not in _UNREACHABLE:
                raise StoreUnreachableError(f"cannot reach the store at {host}:{port} (MASTER_ADDR:MASTER_PORT) from "
                                            f"this host: {err}. Check the address: {fix}.", retryable=False) from None
            if time.monotonic() >= deadline:
                raise StoreUnreachableError(
                    f"no route to or no answer from the store at {host}:{port} (MASTER_ADDR:MASTER_PORT) for "
                    f"{timeout_s:.0f} s from this host ({err}): the network between the nodes is down, or {host} is "
                    f"not the address of rank 0's node on it ({fix}).", retryable=True) from None
        time.sleep(1.0)


def exit_if_store_unreachable(not_retryable_code: int) -> None:
    """:func:`check_store_reachable` for a worker: the reason on stderr (the launcher reads its last line), then exit.

    An address that cannot work exits with ``not_retryable_code``, so the launcher does not retry it."""
    try:
        check_store_reachable()
    except StoreUnreachableError as err:
        print(f"StoreUnreachableError: {err}", file=sys.stderr, flush=True)
        os._exit(1 if err.retryable else not_retryable_code)
