"""The part of Horovod's API that both adapters export unchanged from the core.

The reduce ops and ``Compression`` (``horovod_names``), process sets
(``process_sets``) and the engine/build queries (``capabilities``):
``dp_plugin.torch`` and ``dp_plugin.tensorflow`` star-import this module and
add its ``__all__`` to theirs, so the list is written once.
"""

from dp_plugin.capabilities import (
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
)
from dp_plugin.horovod_names import Adasum, Average, Compression, Max, Min, Product, Sum
from dp_plugin.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "ccl_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "mpi_built",
    "mpi_enabled",
    "remove_process_set",
]
