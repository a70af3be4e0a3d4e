"""``Topology``: where a process sits in the job, read from launcher variables.

The launcher classes of ``dp_plugin.launch.launchers`` say *which* variables describe
the job; this module reads them (``VariableReader``: every bad value is a
``LaunchError`` naming the variable, the value and the fix), checks that
they agree with each other and builds the ``Topology``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from dp_plugin.errors import LaunchError
from dp_plugin.validate import check_choice, check_int, env_int

if TYPE_CHECKING:
    from dp_plugin.launch.launchers import Launcher

LAUNCHER_NAMES: tuple[str, ...] = (
    "horovodrun", "torchrun", "openmpi", "mpich", "intelmpi", "slurm", "kubeflow",
    "process_group", "single",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Where this process sits in the job.

    Invariants (checked on construction, ``LaunchError`` otherwise):
    ``0 <= rank < size``, ``0 <= local_rank < local_size <= size``,
    ``local_rank <= rank`` (the processes before this one on its host have
    lower ranks), ``0 <= cross_rank < cross_size <= size``.
    """

    launcher: str
    """'horovodrun', 'torchrun', 'openmpi', 'mpich', 'intelmpi', 'slurm',
    'process_group' (a torch.distributed group the program made) or 'single'."""
    rank: int
    """Global rank, 0 .. size-1."""
    size: int
    """Number of processes in the job."""
    local_rank: int
    """Index of this process among the processes on its host."""
    local_size: int
    """Number of processes on this host."""
    cross_rank: int
    """Index of this host (Horovod: rank among processes with this local_rank)."""
    cross_size: int
    """Number of hosts (Horovod: processes with this local_rank)."""
    rendezvous_addr: str | None = None
    """horovodrun: the rendezvous server; torchrun/slurm: MASTER_ADDR."""
    rendezvous_port: int | None = None
    hostname: str | None = None

    def __post_init__(self) -> None:
        check_choice("Topology launcher", self.launcher, LAUNCHER_NAMES, kind="launchers",
                     error=LaunchError)
        names = ("size", "rank", "local_size", "local_rank", "cross_size", "cross_rank")
        for name in names:
            check_int(f"Topology {name}", getattr(self, name), minimum=0, error=LaunchError)
        _check_consistent(
            *(Sourced(name, getattr(self, name)) for name in names),
            fix="build the Topology from consistent values "
                "(or use dp_plugin.launch.launchers.detect())",
        )
        if self.rendezvous_port is not None:
            _check_port(Sourced("rendezvous_port", self.rendezvous_port), "pass a port in 1..65535")

    @property
    def is_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mpich", "intelmpi")

    @property
    def is_homogeneous(self) -> bool:
        """True when every host runs the same number of processes."""
        return self.local_size * self.cross_size == self.size

    @classmethod
    def single(cls) -> Topology:
        """The topology of a process that no launcher started."""
        return cls(
            launcher="single", rank=0, size=1, local_rank=0, local_size=1,
            cross_rank=0, cross_size=1,
        )


# -- reading a launcher's variables (dp_plugin.launch.launchers) -------------------------

class Sourced(NamedTuple):
    """A value and where it came from, for messages."""

    name: str
    value: int
    raw: str | None = None
    """The variable's text; None for values that were computed."""
    note: str = ""

    @property
    def label(self) -> str:
        text = f"{self.name}={self.raw!r}" if self.raw is not None else f"{self.name}={self.value}"
        return f"{text} ({self.note})" if self.note else text


class VariableReader:
    """Reads one launcher's variables; every error names variable, value and fix."""

    def __init__(self, env: Mapping[str, str], launcher: type[Launcher]) -> None:
        self.env = env
        self.launcher = launcher
        present = [m for m in launcher.markers if m in env]
        self.why = (
            f"{present[0]}={env[present[0]]!r} says {launcher.name} started this process"
            if present else f"this looks like a {launcher.name} launch"
        )

    def error(self, message: str) -> LaunchError:
        return LaunchError(f"{message}; {self.launcher.fix}")

    def required(self, name: str, minimum: int = 0) -> Sourced:
        if name not in self.env:
            raise self.error(f"{name} is not set, but {self.why}")
        value = env_int(self.env, name, minimum=minimum, fix=self.launcher.fix, error=LaunchError)
        return Sourced(name, value, self.env[name])

    def _both(self, first: str, second: str) -> bool:
        """Whether both variables are set; a lone one is an inconsistency (``LaunchError``)."""
        has_first, has_second = first in self.env, second in self.env
        if has_first != has_second:
            there, missing = (first, second) if has_first else (second, first)
            raise self.error(
                f"{there}={self.env[there]!r} is set but {missing} is not; set both or neither"
            )
        return has_first

    def pair(self, rank_name: str, size_name: str) -> tuple[Sourced, Sourced] | None:
        if not self._both(rank_name, size_name):
            return None
        return self.required(rank_name), self.required(size_name, minimum=1)

    def address(self, addr_name: str, port_name: str) -> tuple[str | None, int | None]:
        if not self._both(addr_name, port_name):
            return None, None
        addr = self.env[addr_name]
        if not addr.strip():
            raise self.error(f"{addr_name}={addr!r} is empty; it must name a host or an address")
        value = self.required(port_name)
        _check_port(value, self.launcher.fix)
        return addr.strip(), value.value

    def text(self, name: str) -> str | None:
        value = self.env.get(name, "").strip()
        return value or None


def _check_port(port: Sourced, fix: str) -> None:
    if not 1 <= port.value <= 65535:
        raise LaunchError(f"{port.label} is not a TCP port; expected 1..65535; {fix}")


def _check_consistent(
    size: Sourced, rank: Sourced, local_size: Sourced, local_rank: Sourced,
    cross_size: Sourced, cross_rank: Sourced, *, fix: str,
) -> None:
    """The invariants of ``Topology``, phrased with the variables' names; the
    first one broken raises."""
    room = size.value - rank.value - 1  # processes the ranks after this one can hold
    after = local_size.value - local_rank.value - 1
    broken = (
        (size.value < 1, f"{size.label} must be at least 1"),
        (rank.value >= size.value,
         f"{rank.label} must be less than {size.label} (ranks are 0..size-1)"),
        (local_size.value < 1, f"{local_size.label} must be at least 1"),
        (local_rank.value >= local_size.value,
         f"{local_rank.label} must be less than {local_size.label}"),
        (local_size.value > size.value, f"{local_size.label} must not exceed {size.label}"),
        # The local_rank processes before this one on its host all have lower
        # ranks, and the ones after it higher ranks: both must fit.
        (local_rank.value > rank.value,
         f"{local_rank.label} must not exceed {rank.label}: the processes before this one "
         "on its host have lower global ranks"),
        (after > room,
         f"{local_size.label} and {local_rank.label} put {after} more process(es) on this "
         f"host after {rank.label}, but {size.label} leaves room for only {room}"),
        (cross_size.value < 1, f"{cross_size.label} must be at least 1"),
        (cross_rank.value >= cross_size.value,
         f"{cross_rank.label} must be less than {cross_size.label}"),
        (cross_size.value > size.value, f"{cross_size.label} must not exceed {size.label}"),
    )
    message = next((message for bad, message in broken if bad), None)
    if message is not None:
        raise LaunchError(f"{message}; {fix}")


def build_topology(
    launcher: type[Launcher], *, size: Sourced, rank: Sourced, local_size: Sourced,
    local_rank: Sourced, cross: tuple[Sourced, Sourced] | None, addr: str | None,
    port: int | None, hostname: str | None,
) -> Topology:
    """The ``Topology`` of ``launcher``'s values (cross rank and size derived
    when ``cross`` is None); ``LaunchError`` naming the variables if they disagree."""
    if cross is None:
        cross = _derive_cross(size, rank, local_size, local_rank)
    cross_rank, cross_size = cross
    _check_consistent(
        size, rank, local_size, local_rank, cross_size, cross_rank, fix=launcher.fix
    )
    return Topology(
        launcher=launcher.name, rank=rank.value, size=size.value,
        local_rank=local_rank.value, local_size=local_size.value,
        cross_rank=cross_rank.value, cross_size=cross_size.value,
        rendezvous_addr=addr, rendezvous_port=port, hostname=hostname,
    )


def _derive_cross(size: Sourced, rank: Sourced, local_size: Sourced,
                  local_rank: Sourced) -> tuple[Sourced, Sourced]:
    """Host index and count under block placement on equal hosts (module docstring)."""
    if local_size.value < 1 or local_rank.value > rank.value:
        # Inconsistent input: keep placeholders and let _check_consistent name it.
        return Sourced("cross rank (derived)", 0), Sourced("cross size (derived)", 1)
    cross_rank = (rank.value - local_rank.value) // local_size.value
    cross_size = max(-(-size.value // local_size.value), cross_rank + 1)
    return Sourced("cross rank (derived)", cross_rank), Sourced("cross size (derived)", cross_size)
