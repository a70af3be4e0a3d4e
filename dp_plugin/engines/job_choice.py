"""One engine for the whole job under horovodrun, whatever each host has installed.

Under horovodrun the facts that decide the engine differ per host: whether
Horovod imports, whether CUDA is visible, whether Horovod's Gloo can reach
this host (``horovod_hosts``). A job where some ranks start one engine and
the others another hangs; so does a check that only some ranks run (those
where Horovod imports, say): the others wait for it until the timeout and
then report something misleading. So every rank takes part, whatever it
has installed: each publishes its ``Finding`` in horovodrun's rendezvous
server, rank 0 reads every rank's finding and publishes one verdict
(``decide``), and every rank returns that verdict or raises the same error.

The verdict:

- ``auto``: the engine every rank picked on its own, if they agree; where
  they differ, ``nccl`` if every rank can run it, else ``gloo``. Horovod's
  engine only where every rank picked it and Horovod's Gloo can connect
  the hosts; else ``gloo``.
- ``horovod`` (explicit): Horovod's engine where every rank can run it and
  connect; else ``EngineUnavailableError`` on every rank, naming the ranks,
  the cause and the fix.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from dp_plugin.config import Config
from dp_plugin.engines import horovod_hosts
from dp_plugin.engines.rendezvous import horovod_get, horovod_put
from dp_plugin.errors import EngineUnavailableError
from dp_plugin.launch.topology import Topology

# The n-th choice of this process uses key n on every rank (the same init sequence).
_rounds = itertools.count()

MISSING_FIX = ("install Horovod with its torch extension on every host (`make install`), or "
               "leave DP_PLUGIN_ENGINE unset (auto) to run gloo")
"""What to do when an explicit ``horovod`` meets ranks that cannot run it."""


@dataclass(frozen=True, kw_only=True)
class Finding:
    """What one rank found on its own host."""

    host: str
    """Its host name (horovodrun's ``HOROVOD_HOSTNAME``)."""
    pick: str
    """What ``auto`` picks on this rank alone (``choose_engine``)."""
    nccl: bool = False
    """Whether the nccl engine can run on this rank."""
    horovod: str = ""
    """Why Horovod's engine cannot run on this rank; '' when it can or was not asked."""
    unreachable: str = ""
    """``horovod_hosts.local_finding``: why Horovod's Gloo cannot reach this
    host from the others; '' when it can or was not asked."""

    def to_text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> Finding:
        return cls(**json.loads(text))


def decide(requested: str, findings: Sequence[Finding], reason: str) -> tuple[str, str, str]:
    """The job's ``(engine, reason, error)`` from every rank's finding, in
    rank order; ``error`` is '' unless the job cannot run ``requested``.
    ``reason``: rank 0's own reason for its pick (or for the request)."""
    hosts = [f.host for f in findings]
    unreachable = horovod_hosts.verdict([f.unreachable for f in findings], hosts)
    if requested == "horovod":
        missing = {rank: f.horovod for rank, f in enumerate(findings) if f.horovod}
        if missing:
            return "", "", ("engine 'horovod' cannot run this job: "
                            f"{horovod_hosts.by_reason(missing)}. Fix: {MISSING_FIX}")
        if unreachable:
            return "", "", (f"engine 'horovod' cannot run this job: {unreachable}. "
                            f"Fix: {horovod_hosts.FIX}")
        return "horovod", reason, ""
    picks = {f.pick for f in findings}
    if picks == {"horovod"} and unreachable:
        return ("gloo", f"launched by horovodrun; horovod cannot connect the hosts: {unreachable}",
                "")
    if len(picks) == 1:
        return findings[0].pick, reason, ""
    fallback = "nccl" if all(f.nccl for f in findings) else "gloo"
    differ = horovod_hosts.by_reason({rank: f.pick for rank, f in enumerate(findings)})
    return fallback, (f"launched by horovodrun; the ranks' own picks differ ({differ}): "
                      f"{fallback}, which every rank can run"), ""


def agree(requested: str, topology: Topology, config: Config, mine: Finding,
          reason: str) -> tuple[str, str]:
    """The job's ``(engine, reason)``: ``decide`` on rank 0 over every rank's
    ``mine``, the same answer on every rank, or ``EngineUnavailableError``
    on every rank.

    Collective under horovodrun: every rank must call it, in the same order
    relative to other inits."""
    key = f"engine_choice_{next(_rounds)}"
    horovod_put(topology, config, f"{key}_{topology.rank}", mine.to_text())
    if topology.rank == 0:
        findings = [
            Finding.from_text(horovod_get(
                topology, config, f"{key}_{rank}", f"rank {rank}'s engine finding",
                f"Rank {rank} has probably failed to start; check its log"))
            for rank in range(topology.size)
        ]
        name, reason, error = decide(requested, findings, reason)
        horovod_put(topology, config, f"{key}_verdict",
                    json.dumps({"engine": name, "reason": reason, "error": error}))
    else:
        said = json.loads(horovod_get(topology, config, f"{key}_verdict",
                                      "rank 0's choice of engine",
                                      "Rank 0 has probably failed; check its log"))
        name, reason, error = said["engine"], said["reason"], said["error"]
    if error:
        raise EngineUnavailableError(f"rank {topology.rank}: {error}")
    return name, reason
