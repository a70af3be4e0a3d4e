"""``dp_plugin.torch``'s process sets are the core registry's: see
``dp_plugin.process_sets`` (one registry for every adapter, as in Horovod)."""

from dp_plugin.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
