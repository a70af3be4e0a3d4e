"""Can Horovod's engine connect this job's hosts? One verdict for the whole job.

Horovod 0.28.1 gives every process set, the global one included, a Gloo
context of its own (``GlooContext::InitializeForProcessSet``). As released,
that context's device is made from the process set's interface name, which
is never assigned: Gloo then binds to the first address that the machine's
host name (``gethostname()``) resolves to, and ``HOROVOD_GLOO_IFACE`` (what
horovodrun's ``--network-interfaces`` sets) is ignored on that path. Where
the host name resolves to loopback (``127.0.0.1 myhost`` in ``/etc/hosts``
is common), the other hosts dial ``127.0.0.1`` and the job aborts in C++
(``gloo::IoException ... Connection refused``). ``dp-plugin build-horovod``
patches it (patch set ``p2``, docs/horovod-build.md): the process set takes
the global context's interface.

So Horovod's engine cannot work when, on some rank, the build lacks that
fix *and* the host name binds to a loopback address, in a job that spans
hosts (on one host loopback reaches everyone). Each rank's
``local_finding`` goes into the job's one choice of engine (``job_choice``):
``auto`` then runs ``gloo`` on every rank; an explicit ``horovod`` raises
the same error, naming the ranks (``verdict``), on every rank.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

FIXED_PATCH_SETS = ("p2",)
"""``horovod.dp_plugin_patches.PATCH_SET`` values whose build has the fix."""


def has_process_set_iface_fix() -> bool:
    """Whether the installed Horovod was built by ``build-horovod`` with the fix."""
    try:
        from horovod.dp_plugin_patches import PATCH_SET
    except ImportError:
        return False
    return PATCH_SET in FIXED_PATCH_SETS


def hostname_binds_to(hostname: str) -> str | None:
    """The address Gloo binds for ``hostname`` when given no interface: the
    first that ``getaddrinfo`` returns and that this host can bind (Gloo's
    ``lookupAddrForHostname``); None when none resolves or binds."""
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError:
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0, *address[2:]))
        except OSError:
            continue
        return str(address[0])
    return None


def local_finding(fixed: bool, hostname: str, bound: str | None) -> str:
    """This rank's part of the verdict: empty when Horovod's Gloo can reach
    it from other hosts, else why not (``bound``: ``hostname_binds_to``)."""
    if fixed:
        return ""
    if bound is None:
        return f"its host name {hostname!r} resolves to no address it can bind"
    if ipaddress.ip_address(bound.split("%")[0]).is_loopback:
        return f"its host name {hostname!r} resolves to {bound}"
    return ""


def by_reason(why: dict[int, str], hosts: Sequence[str] = ()) -> str:
    """'rank(s) 1, 3: why; rank(s) 2: other why', ranks grouped by reason;
    with ``hosts`` (by rank), each group also names its ranks' hosts."""
    groups: dict[str, list[int]] = {}
    for rank, reason in sorted(why.items()):
        groups.setdefault(reason, []).append(rank)
    parts = []
    for reason, ranks in groups.items():
        where = sorted({hosts[r] for r in ranks if hosts[r]}) if hosts else []
        on = f" on host(s) {', '.join(where)}" if where else ""
        parts.append(f"rank(s) {', '.join(map(str, ranks))}{on}: {reason}")
    return "; ".join(parts)


def verdict(findings: list[str], hosts: list[str]) -> str:
    """One message from every rank's finding (empty when Horovod can run):
    which ranks, on which hosts, and why."""
    bad = {rank: finding for rank, finding in enumerate(findings) if finding}
    if not bad:
        return ""
    return (
        "Horovod here lacks dp_plugin's Gloo process-set fix (Horovod 0.28.1 binds each "
        "process set to the address of the host name, ignoring HOROVOD_GLOO_IFACE), the job "
        f"spans hosts, and {by_reason(bad, hosts)}; the other hosts could not connect there "
        "(Gloo would abort with 'Connection refused')"
    )


FIX = ("rebuild Horovod with the fix (`dp-plugin build-horovod --force`, or `make install`), "
       "or make each host's name resolve to an address the other hosts reach (its line in "
       "/etc/hosts), or set DP_PLUGIN_ENGINE=gloo (auto picks it in this case)")
"""What to do, for the error of an explicit ``horovod``."""


def this_host() -> str:
    """``local_finding`` for this process's host (imports no Horovod extension)."""
    hostname = socket.gethostname()
    return local_finding(has_process_set_iface_fix(), hostname, hostname_binds_to(hostname))
