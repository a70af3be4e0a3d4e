"""How the ranks of a torch.distributed process group find each other.

One function per launcher, so that ``gloo`` and ``nccl`` run under every
launcher without asking the user for a port:

- torchrun (or a hand-made ``env://`` launch): ``env://`` on MASTER_ADDR /
  MASTER_PORT. Under torchrun the agent already serves a store there and
  ``env://`` connects to it instead of opening a second one.
- srun: the job script must export MASTER_ADDR and MASTER_PORT; rank 0
  serves a TCPStore there.
- horovodrun: rank 0 opens a TCPStore on a free port (port 0) and publishes
  ``host:port`` in Horovod's rendezvous server, the HTTP key-value store at
  HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT that horovodrun runs for the whole job
  (PUT/GET ``/<scope>/<key>``; GET answers 404 until the key exists, see
  horovod/runner/http/http_server.py). The other ranks poll for it.
  Anyone who can reach that server may write the key: with
  ``DP_PLUGIN_JOB_SECRET`` set (the same value on every rank; horovodrun
  forwards the environment), rank 0 publishes ``address#tag``, ``tag`` an
  HMAC-SHA256 under the secret of the address, the server's address and the
  key (so a value from another job, or another init of this one, does not
  verify), and the other ranks accept only a value whose tag verifies
  (``sign``, ``verify``). Without a secret the address travels bare.
- mpirun/mpiexec: rank 0 opens a TCPStore on port 0 and broadcasts
  ``host:port`` with mpi4py.
- a single process: an in-memory store.

Every wait honours ``config.timeout_s`` and fails with an error naming what
was awaited, never a hang.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import itertools
import os
import socket
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

from dp_plugin.config import Config
from dp_plugin.engines.deadline import poll
from dp_plugin.engines.exit_bounds import finalize_mpi_at_exit
from dp_plugin.errors import CollectiveTimeoutError, EngineUnavailableError
from dp_plugin.launch.topology import Topology

HOROVOD_SCOPE = "dp_plugin"
"""Ad-hoc scope of our keys in Horovod's rendezvous server."""

_ADDRESS_BYTES = 256
"""Fixed size of the MPI broadcast carrying ``host:port``."""

# Counts rendezvous made by this process. Every rank runs the same sequence of
# init/shutdown, so the n-th rendezvous uses the same key everywhere and never
# reads the address left by an earlier one.
_generation = itertools.count()

# The store servers this process serves on a fixed port (MASTER_PORT), kept
# for the life of the process: ranks do not leave shutdown() together, and a
# rank that re-inits first connects to the previous init's server, which must
# not close under it. Every init meets on the same server, under its prefix.
_served: dict[tuple[str, int], Any] = {}


def problem(topology: Topology) -> str | None:
    """Why no rendezvous is possible under ``topology``, or None if one is."""
    launcher = topology.launcher
    if launcher == "single":
        return None if topology.size == 1 else f"launcher 'single' with size {topology.size}"
    if launcher == "process_group":  # the engine joins the program's group: no rendezvous
        import torch.distributed as dist

        if dist.is_initialized():
            return None
        return ("the program's torch.distributed group, which dp_plugin adopted, was "
                "destroyed before the engine started; keep it until hvd.shutdown()")
    if launcher in ("torchrun", "slurm", "horovodrun"):
        if topology.rendezvous_addr is not None and topology.rendezvous_port is not None:
            return None
        if launcher == "horovodrun":
            return (
                "launched by horovodrun without HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT (horovodrun "
                "--mpi mode?); use `horovodrun --gloo`, or mpirun with the mpi engine"
            )
        return (
            f"launched by {launcher} without MASTER_ADDR and MASTER_PORT; export both "
            "(the first host of the job and a free port on it) before starting the workers"
        )
    if topology.is_mpi:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return (
                f"launched by {launcher}, but mpi4py is not installed, so rank 0 cannot tell "
                "the others where its store is; `pip install mpi4py`, or export MASTER_ADDR "
                "and MASTER_PORT and launch with torchrun"
            )
        return None
    return f"launcher {launcher!r} has no rendezvous for torch.distributed"


def rendezvous(topology: Topology, config: Config) -> tuple[Any, str]:
    """Meet the other ranks: the ``torch.distributed.Store`` to pass to
    ``init_process_group``, and how the ranks met (for logs and errors).
    Collective: every rank calls it once per init, once the engine's
    ``availability`` has found no ``problem``."""
    launcher = topology.launcher
    if launcher == "single":
        import torch.distributed as dist

        return dist.HashStore(), "single process, in-memory store"
    generation = next(_generation)
    if launcher in ("torchrun", "slurm"):
        # What env:// does, plus a prefix per init(): the store server is
        # shared within the process (multi-tenant) and outlives a failed init,
        # whose keys a second one would read (gloo then dials addresses that no
        # longer listen). torchrun's agent keeps its store across restarts, whose
        # workers count inits from zero again: the attempt is in the prefix.
        host, port = str(topology.rendezvous_addr), int(topology.rendezvous_port or 0)
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
        store = _tcp_store(host, port, topology, config,
                           is_master=topology.rank == 0 and not agent)
        how = "env:// at" if launcher == "torchrun" else "TCPStore at MASTER_ADDR/PORT"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return _prefixed(store, f"{attempt}.{generation}"), f"{how} {host}:{port}"
    exchange = _exchange_via_horovod if launcher == "horovodrun" else _exchange_via_mpi
    if topology.rank == 0:
        host = _advertised_host(topology)
        store = _tcp_store(host, 0, topology, config, is_master=True)
        address = f"{host}:{store.port}"
        exchange(topology, config, generation, address)
    else:
        address = exchange(topology, config, generation, None)
        host, _, port_text = address.rpartition(":")
        store = _tcp_store(host, int(port_text), topology, config, is_master=False)
    via = "Horovod's rendezvous server" if launcher == "horovodrun" else "an MPI broadcast"
    return _prefixed(store, generation), f"TCPStore at {address}, announced through {via}"


def _tcp_store(host: str, port: int, topology: Topology, config: Config, *,
               is_master: bool) -> Any:
    import torch.distributed as dist

    timeout = timedelta(seconds=config.timeout_s)
    served = _served.get((host, port)) if is_master else None
    if served is not None:
        served.set_timeout(timeout)
        return served
    listen = _listening_socket(host, port) if is_master else None
    # A fixed port: the server is shared within the process (multi-tenant).
    # Port 0 on the master: the OS picks a free port, read back as .port.
    extra: dict[str, Any] = {"multi_tenant": port != 0}
    if listen is not None:
        port, extra["master_listen_fd"] = listen
    store = dist.TCPStore(host, port, topology.size, is_master, timeout=timeout,
                          wait_for_workers=False, **extra)
    if is_master and extra["multi_tenant"]:
        _served[(host, port)] = store
    return store


def _listening_socket(host: str, port: int) -> tuple[int, int] | None:
    """(port, fd) of a socket listening on ``host`` only, for the store
    server: torch's own listens on every interface. ``host`` is the address
    the other ranks are told (127.0.0.1 on one host, rank 0's address
    otherwise). None when ``host`` is a name (another host may resolve it to
    another address than this one does) or not an address of this machine
    (NAT): the store then listens on every interface, as torch's."""
    try:
        ipaddress.ip_address(host)
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
    except (ValueError, socket.gaierror, UnicodeError):
        return None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        return None
    return int(sock.getsockname()[1]), sock.detach()  # the store owns the descriptor now


def _prefixed(store: Any, generation: int | str) -> Any:
    """``store`` seen under a prefix of its own for this ``init()``."""
    import torch.distributed as dist

    return dist.PrefixStore(f"dp_plugin.init{generation}", store)


def _advertised_host(topology: Topology) -> str:
    """The address other ranks use to reach rank 0's store."""
    if topology.local_size == topology.size:
        return "127.0.0.1"  # every rank is on this host
    name = topology.hostname or socket.getfqdn()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise EngineUnavailableError(
            f"rank 0 cannot resolve its host name {name!r} ({exc}); the other hosts need it "
            "to reach rank 0's store. Fix the host's DNS / /etc/hosts entry, or launch with "
            "torchrun and MASTER_ADDR set to a reachable address"
        ) from None


def _exchange_via_horovod(topology: Topology, config: Config, generation: int,
                          address: str | None) -> str:
    """Rank 0 PUTs ``address``; the others GET it, polling until it appears."""
    key = f"torch_store_{generation}"
    if address is not None:
        horovod_put(topology, config, key, address)
        return address
    return horovod_get(topology, config, key, "rank 0's torch.distributed store address",
                       "Rank 0 has probably failed to start; check its log")


def horovod_put(topology: Topology, config: Config, key: str, value: str) -> None:
    """Publish ``value`` under ``key`` in horovodrun's rendezvous server
    (scope ``HOROVOD_SCOPE``), signed with the job secret when there is one."""
    server = f"{topology.rendezvous_addr}:{topology.rendezvous_port}"
    url = f"http://{server}/{HOROVOD_SCOPE}/{key}"
    published = sign(config.job_secret, f"{server}|{key}", value)
    request = urllib.request.Request(url, data=published.encode(), method="PUT")
    with urllib.request.urlopen(request, timeout=config.timeout_s) as response:
        if response.status != 200:
            raise EngineUnavailableError(
                f"rank {topology.rank}: Horovod's rendezvous server at {url} answered HTTP "
                f"{response.status} to publishing {key!r}; is horovodrun still running?"
            )


def horovod_get(topology: Topology, config: Config, key: str, what: str, hint: str) -> str:
    """The value another rank published under ``key`` (``horovod_put``),
    polling until it appears; ``CollectiveTimeoutError`` naming ``what`` and
    ``hint`` after ``config.timeout_s``."""
    server = f"{topology.rendezvous_addr}:{topology.rendezvous_port}"
    url = f"http://{server}/{HOROVOD_SCOPE}/{key}"
    deadline = time.monotonic() + config.timeout_s
    pause = 0.01
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=max(0.1, deadline - time.monotonic())) as r:
                value = r.read().decode(errors="replace")
            trusted, why = verify(config.job_secret, f"{server}|{key}", value)
            if trusted is not None:
                return trusted
            last_error = f"the value there is refused: {why}"  # it may still be overwritten
        except urllib.error.HTTPError as exc:
            if exc.code != 404:  # 404: not published yet
                raise EngineUnavailableError(
                    f"rank {topology.rank}: Horovod's rendezvous server at {url} answered "
                    f"HTTP {exc.code}; is horovodrun still running?"
                ) from None
            last_error = "HTTP 404, not published yet"
        except (urllib.error.URLError, OSError) as exc:
            last_error = str(exc)  # the server may be momentarily busy: retry
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
    raise CollectiveTimeoutError(
        f"rank {topology.rank}: {what} did not appear at {url} within {config.timeout_s:g} s "
        f"(DP_PLUGIN_TIMEOUT; last answer: {last_error}). {hint}"
    )


def _exchange_via_mpi(topology: Topology, config: Config, generation: int,
                      address: str | None) -> str:
    """Broadcast rank 0's ``address`` over MPI_COMM_WORLD, with a deadline."""
    from mpi4py import MPI

    finalize_mpi_at_exit(topology.rank, config.timeout_s)  # mpi4py's own waits unbounded
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (topology.rank, topology.size):
        raise EngineUnavailableError(
            f"MPI_COMM_WORLD says rank {comm.Get_rank()} of {comm.Get_size()}, but the launcher "
            f"variables say rank {topology.rank} of {topology.size}; start the job with a single "
            "mpirun/mpiexec and do not set rank variables by hand"
        )
    buf = bytearray(_ADDRESS_BYTES)
    if address is not None:
        encoded = address.encode()
        if len(encoded) >= _ADDRESS_BYTES:
            raise EngineUnavailableError(
                f"rank 0's store address {address!r} is longer than {_ADDRESS_BYTES - 1} bytes"
            )
        buf[: len(encoded)] = encoded
    # Non-blocking, so that a rank 0 that never arrives is a timeout, not a hang.
    request = comm.Ibcast([buf, MPI.BYTE], root=0)
    if not poll(request.Test, config.timeout_s, step=1e-4, longest=0.05):
        raise CollectiveTimeoutError(
            f"rank {topology.rank}: the MPI broadcast of rank 0's torch.distributed store "
            f"address did not finish within {config.timeout_s:g} s (DP_PLUGIN_TIMEOUT); "
            "a rank has probably failed to start; check the other ranks' logs"
        )
    return bytes(buf).rstrip(b"\0").decode()


def _tag(secret: str, context: str, address: str) -> str:
    message = f"{context}|{address}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str | None, context: str, address: str) -> str:
    """What rank 0 publishes: ``address`` alone, or ``address#tag`` with a secret."""
    return address if secret is None else f"{address}#{_tag(secret, context, address)}"


def verify(secret: str | None, context: str, published: str) -> tuple[str | None, str]:
    """(the address, or None if ``published`` must not be trusted; why not)."""
    address, sep, tag = published.rpartition("#")
    if secret is None:
        if sep:
            return None, ("it is signed (rank 0 has DP_PLUGIN_JOB_SECRET) but this rank has no "
                          "DP_PLUGIN_JOB_SECRET: set the same secret on every rank")
        return published, ""
    if not sep:
        return None, ("it is not signed: rank 0 has no DP_PLUGIN_JOB_SECRET, or someone else "
                      "wrote the key")
    if not hmac.compare_digest(tag, _tag(secret, context, address)):
        return None, ("its signature does not verify: the ranks have different "
                      "DP_PLUGIN_JOB_SECRET values, or someone else wrote the key")
    return address, ""
