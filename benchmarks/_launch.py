"""Starting benchmark workers under a launcher: the package's helpers.

The benchmark scripts import these names from here; the code lives in
``dp_plugin.cli.jobs`` so that ``dp-plugin bench`` (installed without this
folder) uses the same launching.
"""

from __future__ import annotations

from dp_plugin.cli.jobs import (
    BINDIR,
    Job,
    clean_env,
    free_port,
    horovodrun_job,
    mpiexec_job,
    run_jobs,
    torchrun_jobs,
)

__all__ = ["BINDIR", "Job", "clean_env", "free_port", "horovodrun_job", "mpiexec_job",
           "run_jobs", "torchrun_jobs"]
