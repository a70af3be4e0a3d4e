"""Worker: a grouped all-reduce large enough to be chunked (dp_plugin.collective
``PIPELINE_CHUNK``, ``DIRECT_BYTES``) against a local reference.

Tensors of 1-3 MiB (reduced alone, in place) among many small ones (fused
into 8 MiB chunks), float32 and float64, ~26 MiB in all; in place and
not, Sum of integer-valued inputs (exact) and Average (within 1e-5, relative), and the
results bitwise equal on every rank (sha256 all-gathered). Prints
``rank R OK``.

    python grouped_pipeline.py --engine gloo --case chunked
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
from _fail_fast import run_cases

import dp_plugin.torch as hvd
from dp_plugin import collective


def shapes() -> list[tuple[tuple[int, ...], torch.dtype]]:
    rng = torch.Generator().manual_seed(7)
    out = []
    for i in range(120):
        if i % 15 == 3:  # 1-3 MiB: alone
            n = int(torch.randint(262_144, 786_432, (1,), generator=rng))
        else:
            n = int(torch.randint(1, 40_000, (1,), generator=rng))
        out.append(((n,), torch.float64 if i % 7 == 5 else torch.float32))
    return out


def inputs(rank: int) -> list[torch.Tensor]:
    rng = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(-50, 50, shape, generator=rng).to(dtype) for shape, dtype in shapes()]


def case_chunked(args: argparse.Namespace) -> None:
    os.environ["DP_PLUGIN_ENGINE"] = args.engine
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = sum(t.numel() * t.element_size() for t in inputs(rank))
    assert total > 3 * collective.PIPELINE_CHUNK, total
    summed = [sum(ts) for ts in zip(*(inputs(r) for r in range(size)), strict=True)]

    out = hvd.grouped_allreduce(inputs(rank), op=hvd.Sum, name="chunked.sum")
    for i, (o, e) in enumerate(zip(out, summed, strict=True)):
        assert torch.equal(o, e), f"tensor {i}: Sum differs from the reference"
    mine = inputs(rank)
    hvd.grouped_allreduce_(mine, op=hvd.Average, name="chunked.avg")
    digest = hashlib.sha256()
    for i, (o, e) in enumerate(zip(mine, summed, strict=True)):
        diff = float((o - e / size).abs().max())
        assert diff <= 1e-5 * float(e.abs().max() / size + 1), f"tensor {i}: Average off by {diff}"
        digest.update(o.numpy().tobytes())
    digests = hvd.allgather_object(digest.hexdigest(), name="digests")
    assert len(set(digests)) == 1, f"ranks differ: {digests}"
    hvd.shutdown()


CASES = {"chunked": case_chunked}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True)
    run_cases(CASES, parser=parser)
