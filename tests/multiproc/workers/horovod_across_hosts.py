"""One rank of a horovodrun job across namespace hosts (tests/examples/test_cluster.py).

``--plain``: first plain Horovod (``horovod.torch``: init, one all-reduce),
the case Horovod 0.28.1's unpatched Gloo process sets break where the host
name resolves to loopback. Then dp_plugin: ``DP_PLUGIN_ENGINE=horovod``
(printed as an error line if it is refused), then ``auto``; each line says
the engine and an all-reduce's result, so the test sees every rank's choice.
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> int:
    if "--plain" in sys.argv:
        import horovod.torch as horovod

        horovod.init()
        total = horovod.allreduce(torch.tensor([horovod.rank() + 1.0]), op=horovod.Sum)
        print(f"plain horovod rank {horovod.rank()} sum {total.item():g}", flush=True)
    import dp_plugin.torch as hvd
    from dp_plugin.errors import EngineUnavailableError
    from dp_plugin.launch import runtime

    for requested in ("horovod", "auto"):
        os.environ["DP_PLUGIN_ENGINE"] = requested
        try:
            hvd.init()
        except EngineUnavailableError as exc:
            print(f"refused {requested}: {exc}", flush=True)
            continue
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
        print(f"dp_plugin {requested} rank {hvd.rank()} engine {runtime.engine().name} "
              f"sum {total.item():g}", flush=True)
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
