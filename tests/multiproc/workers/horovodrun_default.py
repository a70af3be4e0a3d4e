"""Worker: what a Horovod script gets under horovodrun by default.

``default``: ``hvd.init()`` with ``DP_PLUGIN_ENGINE`` as the launch sets it.
With ``auto`` (unset) the engine is ``gloo`` and Horovod's library is never
loaded, so it cannot have started its background thread; with ``horovod``
(the control) it is loaded and initialised. Either way the Horovod calls a
script makes answer as under Horovod: ``local_rank``, ``cross_rank`` and
their sizes match horovodrun's variables, a process set all-reduces, and
``join`` returns the same rank everywhere.

``hidden``: rank 1 cannot import Horovod (a host without it). An explicit
``horovod`` is refused on every rank, naming rank 1, at once (the run's
``DP_PLUGIN_TIMEOUT`` is longer than the harness's timeout, so waiting it
out fails the test); then ``auto`` runs gloo on every rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fail_fast import run_cases


def _horovod_library_loaded() -> bool:
    """Whether Horovod's torch extension is mapped into this process."""
    return "horovod/torch/mpi_lib" in Path("/proc/self/maps").read_text()


def _check_horovod_calls(hvd: Any) -> None:
    import torch

    env = os.environ
    assert (hvd.rank(), hvd.size()) == (int(env["HOROVOD_RANK"]), int(env["HOROVOD_SIZE"]))
    assert hvd.local_rank() == int(env["HOROVOD_LOCAL_RANK"])
    assert hvd.local_size() == int(env["HOROVOD_LOCAL_SIZE"])
    assert hvd.cross_rank() == int(env["HOROVOD_CROSS_RANK"])
    assert hvd.cross_size() == int(env["HOROVOD_CROSS_SIZE"])
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
    assert total.item() == hvd.size() * (hvd.size() + 1) / 2, total
    pair = hvd.add_process_set([0, 1])
    if hvd.rank() in (0, 1):
        got = hvd.allreduce(torch.tensor([10.0 * (hvd.rank() + 1)]), op=hvd.Sum,
                            process_set=pair)
        assert got.item() == 30.0, got
    last = hvd.join()
    assert last in range(hvd.size()), last
    everyone = hvd.allgather_object(last)
    assert len(set(everyone)) == 1, everyone


def default(args: object) -> None:
    import dp_plugin.torch as hvd
    from dp_plugin.launch import runtime

    hvd.init(process_sets="dynamic")
    engine = runtime.engine().name
    wanted = os.environ.get("DP_PLUGIN_ENGINE", "auto")
    if wanted == "horovod":
        import horovod.torch

        assert engine == "horovod", engine
        assert _horovod_library_loaded() and horovod.torch.is_initialized()
    else:
        assert engine == "gloo", engine
        assert not _horovod_library_loaded(), "Horovod's library was loaded under auto"
        assert "horovod.torch" not in sys.modules
    _check_horovod_calls(hvd)
    assert not (wanted != "horovod" and _horovod_library_loaded())
    print(f"rank {hvd.rank()} engine {engine} horovod loaded {_horovod_library_loaded()}",
          flush=True)
    hvd.shutdown()


def hidden(args: object) -> None:
    if os.environ["HOROVOD_RANK"] == "1":
        sys.modules["horovod"] = None  # type: ignore[assignment]  # as on a host without it
    import torch

    import dp_plugin.torch as hvd
    from dp_plugin.errors import EngineUnavailableError
    from dp_plugin.launch import runtime

    os.environ["DP_PLUGIN_ENGINE"] = "horovod"
    try:
        hvd.init()
    except EngineUnavailableError as exc:
        text = str(exc)
        assert "engine 'horovod' cannot run this job: rank(s) 1: Horovod is not installed" in text
        print(f"refused horovod: {text}", flush=True)
    else:
        raise AssertionError("an explicit horovod ran with a rank lacking Horovod")
    os.environ["DP_PLUGIN_ENGINE"] = "auto"
    hvd.init()
    assert runtime.engine().name == "gloo", runtime.engine().name
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
    assert total.item() == hvd.size() * (hvd.size() + 1) / 2, total
    hvd.shutdown()


CASES = {"default": default, "hidden": hidden}

if __name__ == "__main__":
    run_cases(CASES)
