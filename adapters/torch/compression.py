"""``horovod.torch.compression``'s names: subclass ``Compressor`` for your own.

``from dp_plugin.torch.compression import Compressor`` replaces
``from horovod.torch.compression import Compressor``. A subclass overrides
the static ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor,
ctx)``; pass the class as ``compression=`` to ``hvd.allreduce`` (per tensor,
as Horovod) or ``hvd.DistributedOptimizer`` (per fusion bucket: it receives
the packed 1-D buffer of several gradients, see ``dp_plugin.reduce.compression``).
"""

from dp_plugin.api.horovod_names import Compression
from dp_plugin.reduce.compression import BF16Compressor, Compressor, FP16Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
