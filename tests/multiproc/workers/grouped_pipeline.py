"""Worker: a grouped all-reduce large enough to be chunked (dp_plugin.reduce.collective
``PIPELINE_CHUNK``, ``DIRECT_BYTES``) against a local reference.

Tensors of 1-3 MiB (reduced alone, in place) among many small ones (fused
into 8 MiB chunks), float32 and float64, ~26 MiB in all; in place and
not, Sum of integer-valued inputs (exact) and Average (within 1e-5, relative), and the
results bitwise equal on every rank (sha256 all-gather). Prints
``rank R OK``.

``out_of_place``: one group of every dtype the API reduces, each with a
tensor that travels alone (copied straight into its new output as its
bucket starts) and small, 0-dim, empty and non-contiguous ones (packed
from the inputs); Sum, Min, Max and Average with scale factors. The new
tensors must equal the in-place results bitwise and a local reference
(exact for Sum, Min and Max of integer values; Average within the dtype's
rounding); they must not share memory with the inputs or each other, and
the inputs must be unchanged. Again on a process set of some ranks, and
through ``grouped_allreduce_async``.

    python grouped_pipeline.py --engine gloo --case chunked
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
from _fail_fast import run_cases

import dp_plugin.torch as hvd
from dp_plugin.launch import runtime
from dp_plugin.reduce import collective

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64]
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-6, torch.float64: 1e-12}


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


def mixed_group(rank: int, tag: str) -> list[torch.Tensor]:
    """Rank ``rank``'s group: per dtype (interleaved), one tensor of
    ``DIRECT_BYTES`` and more, a small one, a 0-dim one, an empty one and a
    non-contiguous one; small integer values, exact in every dtype."""
    rng = torch.Generator().manual_seed(int.from_bytes(f"{tag}/{rank}".encode()[-6:], "little"))
    out = []
    for k, dtype in enumerate(DTYPES):
        lo = 0 if dtype is torch.uint8 else -3

        def make(shape: tuple[int, ...], dtype: torch.dtype = dtype, lo: int = lo) -> torch.Tensor:
            return torch.randint(lo, 4, shape, generator=rng).to(dtype)

        alone = collective.DIRECT_BYTES // torch.empty((), dtype=dtype).element_size() + 3 + k
        out += [make((alone,)), make((5, 7)), make(()), make((0, 2)), make((6, 4)).t()]
    return out


def reference(xs: list[torch.Tensor], op: object, pre: float, post: float) -> torch.Tensor:
    """Horovod's result: each input prescaled (integers truncated), reduced,
    postscaled (Average: divided by the number of inputs)."""
    dtype = xs[0].dtype
    stack = torch.stack([x.double() * pre for x in xs])
    if not dtype.is_floating_point:
        stack = stack.trunc()
    if op is hvd.Min:
        reduced = stack.min(0).values
    elif op is hvd.Max:
        reduced = stack.max(0).values
    else:
        reduced = stack.sum(0) * (post / len(xs) if op is hvd.Average else post)
    return (reduced if dtype.is_floating_point else reduced.trunc()).to(dtype)


def check_out_of_place(ranks: list[int], me: int, tag: str, process_set: object) -> str:
    """The ``out_of_place`` checks over ``ranks`` (``me``: this rank's place
    among them); returns a digest of every result, for comparing ranks."""
    mine = mixed_group(ranks[me], tag)
    kept = [t.clone() for t in mine]
    everyone = [mixed_group(r, tag) for r in ranks]
    digest = hashlib.sha256()
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Min, 1.0, 1.0), (hvd.Max, 1.0, 1.0),
                          (hvd.Average, 0.5, 2.0)):
        what = f"{tag} {op}"
        outs = hvd.grouped_allreduce(mine, op=op, prescale_factor=pre, postscale_factor=post,
                                     name=f"{tag}.{op}", process_set=process_set)
        inplace = [t.clone() for t in mine]
        hvd.grouped_allreduce_(inplace, op=op, prescale_factor=pre, postscale_factor=post,
                               name=f"{tag}.{op}_", process_set=process_set)
        assert len(outs) == len(mine), what
        for i, (out, x, same) in enumerate(zip(outs, mine, inplace, strict=True)):
            assert out.dtype == x.dtype and out.shape == x.shape and out.device == x.device, \
                f"{what}, tensor {i}: {out.dtype} {tuple(out.shape)} for {x.dtype} {tuple(x.shape)}"
            assert out.is_contiguous(), f"{what}, tensor {i}: the new tensor is not contiguous"
            assert torch.equal(out, same), f"{what}, tensor {i} ({x.dtype}): differs from in place"
            want = reference([g[i] for g in everyone], op, pre, post)
            tol = TOL.get(x.dtype, 0.0) if op is hvd.Average else 0.0
            ok = (torch.equal(out, want) if not tol else
                  torch.allclose(out.double(), want.double(), rtol=tol, atol=tol))
            assert ok, f"{what}, tensor {i} ({x.dtype}): {out.flatten()[:6].tolist()} " \
                       f"vs reference {want.flatten()[:6].tolist()}"
            digest.update(out.reshape(-1).view(torch.uint8).numpy().tobytes())
        storages = [o.untyped_storage().data_ptr() for o in outs if o.numel()]
        inputs_at = {x.untyped_storage().data_ptr() for x in mine}
        assert len(set(storages)) == len(storages), f"{what}: new tensors share memory"
        assert not inputs_at & set(storages), f"{what}: a new tensor aliases an input"
        for i, (x, k) in enumerate(zip(mine, kept, strict=True)):
            assert torch.equal(x, k), f"{what}: input {i} was modified"
    outs = hvd.synchronize(hvd.grouped_allreduce_async(mine, op=hvd.Sum, name=f"{tag}.async",
                                                       process_set=process_set))
    for i, out in enumerate(outs):
        want = reference([g[i] for g in everyone], hvd.Sum, 1.0, 1.0)
        assert torch.equal(out, want), f"{tag} async, tensor {i}: differs from the reference"
    return digest.hexdigest()


def case_out_of_place(args: argparse.Namespace) -> None:
    os.environ["DP_PLUGIN_ENGINE"] = args.engine
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if os.environ.get("DP_PLUGIN_HIERARCHICAL_ALLREDUCE") == "1":
        assert runtime.engine().hierarchical, "the engine took the flat path"
    digest = check_out_of_place(list(range(size)), rank, "all", hvd.global_process_set)
    digests = hvd.allgather_object(digest, name="digests")
    assert len(set(digests)) == 1, f"ranks differ: {digests}"
    members = [1] if size == 2 else [0, size - 1]  # a set of some ranks
    subset = hvd.add_process_set(members)
    if rank in members:
        check_out_of_place(members, members.index(rank), "set", subset)
    hvd.barrier()
    hvd.remove_process_set(subset)
    hvd.shutdown()


CASES = {"chunked": case_chunked, "out_of_place": case_out_of_place}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True)
    run_cases(CASES, parser=parser)
