"""The one list of launcher variables, built from ``dp_plugin.launch.launchers``'s classes.

Test harnesses and benchmarks strip these from a child's environment (the
shell that starts them may itself run under a launcher), and check that a
test leaked none of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dp_plugin.launch.launchers import LAUNCHERS

# Set by the launchers beyond what the launcher classes read: they make torch,
# Horovod or an MPI library believe they run inside a job.
_SET_BUT_NOT_READ: frozenset[str] = frozenset({
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",  # torchrun
    "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS",  # horovodrun
})
_SET_PREFIXES: tuple[str, ...] = (
    "TORCHELASTIC_",  # torchrun
    "HOROVOD_GLOO_",  # horovodrun (rendezvous, interface, timeout)
    "OMPI_", "PMIX_",  # Open MPI
    "PMI_", "HYDRA_",  # MPICH / Hydra, Intel MPI, srun --mpi=pmi2
    "SLURM_",  # SLURM
)

LAUNCHER_VARIABLE_NAMES: frozenset[str] = frozenset(
    name for cls in LAUNCHERS for name in cls.reads
) | _SET_BUT_NOT_READ
"""Variables that say "a launcher started this process": everything a
``Launcher`` reads, and what the launchers set beyond that."""

LAUNCHER_VARIABLE_PREFIXES: tuple[str, ...] = tuple(dict.fromkeys(
    (*(p for cls in LAUNCHERS for p in cls.read_prefixes), *_SET_PREFIXES)
))
"""Prefixes of launcher variables (``OMPI_``, ``SLURM_``, ``I_MPI_``, ...)."""


def is_launcher_variable(name: str) -> bool:
    """True if a launcher sets ``name`` or launch detection reads it.

    Tuning variables (``DP_PLUGIN_*``, ``HOROVOD_FUSION_THRESHOLD``, ...) are not.
    """
    return name in LAUNCHER_VARIABLE_NAMES or name.startswith(LAUNCHER_VARIABLE_PREFIXES)


def launcher_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher variables present in ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if is_launcher_variable(k)}
