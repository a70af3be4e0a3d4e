"""Launch detection: who started this process, and where it sits.

One class per launcher, each able to detect itself from the environment
(horovodrun, torchrun, mpirun/mpiexec of Open MPI, MPICH/Hydra or Intel MPI,
SLURM srun), and a single-process fallback. ``detect()`` returns a
``Topology``; a malformed or inconsistent variable raises ``LaunchError``
naming the variable and the value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Where this process sits in the job."""

    launcher: str
    """'horovodrun', 'torchrun', 'openmpi', 'mpich', 'intelmpi', 'slurm' or 'single'."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    rendezvous_addr: str | None = None
    """horovodrun: the rendezvous server; torchrun/slurm: MASTER_ADDR."""
    rendezvous_port: int | None = None
    hostname: str | None = None

    @property
    def is_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mpich", "intelmpi")


# Detection is implemented below (see issue 2, "Launch detection").
