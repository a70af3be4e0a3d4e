"""Worker: ``DistributedOptimizer`` with ``PowerSGDHook`` (dp_plugin.torch.powersgd).

Run under any launcher (see tests/multiproc/harness.py); the engine comes
from DP_PLUGIN_ENGINE. One launch runs one case (``--case NAME``) and prints
``rank R OK`` when it passed.

Every training case checks, after every step, that the ranks' parameters
are bitwise equal and that they equal a single-process reference of the
same algorithm (``Reference``, written here from the paper's steps: every
rank's gradient computed in this process, error feedback, warm-started
``Q``, plain averages for the first ``start_iter`` steps), within 1e-5:
the products' last bits depend on where their operands lie in memory (the
fusion buffer's layout; seen: 7e-9 apart with the default buckets, equal
with 512-byte ones), and at more than two ranks on the engine's summation
order. A missing error feedback or a wrong ``Q`` is off by 1e-3 or more.

- ``reference``: SGD, 8 steps, start_iter=3, rank 2; the elements the hook
  sent equal the wire formula (``dp_plugin.reduce.powersgd.wire_numel``),
  and so do the bytes ``comm_stats()`` reports for a compressed step.
- ``accumulation``: backward_passes_per_step=2.
- ``join``: the last rank trains 3 steps fewer, then ``hvd.join()``; its
  zero gradients (plus its own error) go through the same two all-reduces,
  and the reference says what the others end with.
- ``sharded``: Adam under ``shard_optimizer_state=True`` beside the same
  model unsharded, each with its own hook: the hook all-reduces every
  bucket (its approximation is whole on every rank), each rank steps its
  own pieces of it, so the parameters are bitwise the unsharded run's
  after every step, and each rank keeps the state of about 1/size of them.
- ``refused``: bad rank/start_iter/min_compression_rate, ranks with
  different settings, a reduction that is not a sum, one hook on two
  optimizers.
- ``elastic_killed`` / ``elastic_reference``: under torchrun a rank dies
  and every rank resumes from the last commit with a new hook (the hook's
  state is not in the commit: it restarts); the reference makes the new
  hook at the commit's step in one uninterrupted run. The test compares the
  final weights bitwise.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import zlib
from pathlib import Path
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn
from torch_sharded import same, state_numel

import dp_plugin.torch as hvd
from dp_plugin.errors import LayoutMismatchError
from dp_plugin.reduce.powersgd import PowerSGDSettings, wire_numel
from dp_plugin.torch.powersgd import PowerSGDHook

PER_RANK = 4
RANK = 2
START = 3
SEED = 5
# DP_TEST_DEVICE=cuda: the distributed model on the GPU (the reference stays
# on the CPU; tests/torch/test_cuda_paths.py runs it on the gloo engine).
DEVICE = torch.device(os.environ.get("DP_TEST_DEVICE", "cpu"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 40x12 and 24x40 are compressed at rank 2; 3x24 and the biases are not.
        self.body = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh())
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


COMPRESSED = {"body.0.weight", "body.2.weight"}


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(PER_RANK, 12, generator=g), torch.randn(PER_RANK, 3, generator=g)


def local_grads(model: nn.Module, step: int, rank: int, passes: int) -> None:
    """This rank's backward passes of ``step`` (gradients accumulate in ``.grad``)."""
    for micro in range(passes):
        x, y = batch(step, micro, rank)
        device = next(model.parameters()).device
        (nn.functional.mse_loss(model(x.to(device)), y.to(device)) / passes).backward()


# -- the single-process reference --------------------------------------------------------


def orthogonalize(a: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns (a new tensor)."""
    cols: list[torch.Tensor] = []
    a = a.clone()
    for i in range(a.shape[1]):
        col = a[:, i:i + 1] / (torch.linalg.vector_norm(a[:, i:i + 1]) + eps)
        a[:, i:i + 1] = col
        if i + 1 < a.shape[1]:
            a[:, i + 1:] = a[:, i + 1:] - col @ (col.mT @ a[:, i + 1:])
        cols.append(col)
    return a


class Reference:
    """PowerSGD over ``size`` simulated ranks in one process."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], size: int) -> None:
        self.size = size
        self.step = 0
        self.q: dict[str, torch.Tensor] = {}
        self.error: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
        for name, p in named:
            n, m = p.shape[0], p[0].numel() if p.dim() > 1 else 1
            r = min(n, m, RANK)
            if p.dim() >= 2 and (n + m) * r * 2 < n * m:
                gen = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
                self.q[name] = torch.randn(m, r, generator=gen).mT.contiguous()  # Q^T
                for e in self.error:
                    e[name] = torch.zeros(n, m)
        if set(self.q) != COMPRESSED:
            raise AssertionError(f"the reference compresses {sorted(self.q)}")

    def average(self, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Each rank's gradients -> what every rank ends the step with."""
        self.step += 1
        out = {}
        for name in grads[0]:
            total = grads[0][name].clone()
            for g in grads[1:]:
                total = total + g[name]
            if self.step <= START or name not in self.q:
                out[name] = total * (1.0 / self.size)
                continue
            shape = grads[0][name].shape
            ms = [g[name].reshape(shape[0], -1) + e[name] for g, e in zip(grads, self.error,
                                                                           strict=True)]
            # Q is kept transposed (r x m), and Q^T = P^T M, as the hook does:
            # the same products in the same layouts give the same bits.
            qt = orthogonalize(self.q[name].mT).mT.contiguous()
            p = ms[0] @ qt.mT
            for m in ms[1:]:
                p = p + m @ qt.mT
            p = orthogonalize(p)
            qt = p.mT @ ms[0]
            for m in ms[1:]:
                qt = qt + p.mT @ m
            self.q[name] = qt
            approx = p @ qt
            for m, e in zip(ms, self.error, strict=True):
                e[name] = m - approx * (1.0 / self.size)
            out[name] = (approx * (1.0 / self.size)).reshape(shape)
        return out


# -- the distributed run, against the reference ----------------------------------------------


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def check(model: nn.Module, ref_model: nn.Module, what: str, compare_ranks: bool = True
          ) -> None:
    a, b = flat(model), flat(ref_model)
    # On a GPU the products round differently from the CPU reference's.
    rtol, atol = (1e-5, 1e-6) if DEVICE.type == "cpu" else (1e-4, 1e-5)
    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: parameters differ from the single-process reference "
                             f"(max diff {(a - b).abs().max():.3g})")
    if compare_ranks:
        everyone = hvd.allgather_object(a, name=f"powersgd.{what}")
        if not all(torch.equal(t, everyone[0]) for t in everyone):
            raise AssertionError(f"{what}: the ranks' parameters differ")


def reference_step(ref_model: nn.Module, ref: Reference, step: int, passes: int,
                   training: list[int], sgd: torch.optim.Optimizer) -> None:
    size = ref.size
    grads = []
    for rank in range(size):
        ref_model.zero_grad()
        if rank in training:
            local_grads(ref_model, step, rank, passes)
        grads.append({n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                      for n, p in ref_model.named_parameters()})
    averaged = ref.average(grads)
    for n, p in ref_model.named_parameters():
        p.grad = averaged[n]
    sgd.step()  # the same update as the distributed run's


def train(steps: int, passes: int = 1, stop_early: int = 0, **kwargs: Any) -> None:
    """``steps`` steps; the last rank stops ``stop_early`` steps sooner and joins."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(3)
    model = Net()
    ref_model = copy.deepcopy(model)
    model.to(DEVICE)
    ref = Reference(list(ref_model.named_parameters()), size)
    lr = 0.1
    ref_sgd = torch.optim.SGD(ref_model.parameters(), lr=lr)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    hook = PowerSGDHook(rank=RANK, start_iter=START, seed=SEED)
    opt.register_comm_hook(hook)
    mine = steps - (stop_early if rank == size - 1 else 0)
    for step in range(steps):
        training = [r for r in range(size) if step < steps - (stop_early if r == size - 1
                                                              else 0)]
        reference_step(ref_model, ref, step, passes, training, ref_sgd)
        if step < mine:
            opt.zero_grad()
            local_grads(model, step, rank, passes)
            opt.step()
            if len(training) == size:
                check(model, ref_model, f"step {step}")
            else:
                check(model, ref_model, f"step {step}", compare_ranks=False)
    if stop_early:
        hvd.join()  # the last rank from step `mine` on, the others after the last step
        return
    dense = sum(p.numel() for p in model.parameters())
    shapes = [tuple(p.shape) for p in model.parameters()]
    wire = wire_numel(shapes, PowerSGDSettings(rank=RANK, start_iter=START))
    control = opt._dp.reducer.control_numel
    expected = START * (dense + control) + (steps - START) * (wire.total + control)
    if hook.sent_numel != expected:
        raise AssertionError(f"the hook sent {hook.sent_numel} elements, the formula "
                             f"says {expected} ({wire})")
    # comm_stats() counts what crossed: P, Q and the uncompressed members
    # (float32), not the buckets' dense bytes.
    stats = opt.comm_stats()
    if stats.last.bytes_reduced != 4 * (wire.total + control):
        raise AssertionError(f"comm_stats() says a compressed step reduced "
                             f"{stats.last.bytes_reduced} bytes, the formula "
                             f"{4 * (wire.total + control)} (dense: {4 * (dense + control)})")
    print(f"rank {rank}: {wire.dense} elements dense, {wire.total} compressed "
          f"({wire.ratio:.2f}x fewer)", flush=True)


def case_reference(_: object) -> None:
    train(8)


def case_accumulation(_: object) -> None:
    train(7, passes=2)


def case_join(_: object) -> None:
    train(8, stop_early=3)


def case_sharded(_: object) -> None:
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(3)
    plain = Net()
    sharded = copy.deepcopy(plain)
    opts, hooks = [], []
    for model, shard in ((plain, False), (sharded, True)):
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       shard_optimizer_state=shard)
        hooks.append(PowerSGDHook(rank=RANK, start_iter=START, seed=SEED))
        opt.register_comm_hook(hooks[-1])
        opts.append(opt)
    for step in range(START + 3):
        for model, opt in zip((plain, sharded), opts, strict=True):
            opt.zero_grad()
            local_grads(model, step, rank, 1)
            opt.step()
        same(list(zip((plain, sharded), opts, strict=True)), f"step {step}")

    if hooks[1].sent_numel != hooks[0].sent_numel or hooks[1].step != START + 3:
        raise AssertionError(f"the sharded optimizer's hook sent {hooks[1].sent_numel} "
                             f"elements in {hooks[1].step} steps, the unsharded one's "
                             f"{hooks[0].sent_numel} in {hooks[0].step}")
    whole, mine = state_numel(opts[0]), state_numel(opts[1])
    buckets = len(opts[1]._dp.reducer.plan)
    if mine > 2 * (whole // 2 // size + buckets):  # Adam: two moments per element
        raise AssertionError(f"this rank keeps {mine} state elements of {whole}")
    print(f"rank {rank}: Adam state {mine} of {whole} elements, {buckets} buckets", flush=True)


def expect_error(kind: type[BaseException], words: str, fn: Any) -> None:
    try:
        fn()
    except kind as exc:
        if words not in str(exc):
            raise AssertionError(f"expected {words!r} in: {exc}") from exc
        return
    raise AssertionError(f"{words!r}: no {kind.__name__} raised")


def case_refused(_: object) -> None:
    expect_error(ValueError, "rank must be an int >= 1, got 0", lambda: PowerSGDHook(rank=0))
    expect_error(ValueError, "rank must be an int >= 1, got '4'", lambda: PowerSGDHook(rank="4"))
    expect_error(ValueError, "start_iter must be an int >= 0, got -1",
                 lambda: PowerSGDHook(start_iter=-1))
    expect_error(ValueError, "min_compression_rate must be >= 1.0",
                 lambda: PowerSGDHook(min_compression_rate=0.5))

    def make(**kwargs: Any) -> Any:
        model = Net()
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **kwargs)

    # Settings that differ between ranks: every rank raises, naming them.
    opt = make()
    expect_error(LayoutMismatchError, "comm hook",
                 lambda: opt.register_comm_hook(PowerSGDHook(rank=2 + hvd.rank())))
    # One hook, two optimizers.
    hook = PowerSGDHook(rank=2)
    make().register_comm_hook(hook)
    expect_error(ValueError, "one PowerSGDHook(...) per optimizer",
                 lambda: make().register_comm_hook(hook))
    # A reduction that is not a sum.
    expect_error(ValueError, "PowerSGD approximates a sum",
                 lambda: make(op=hvd.Min).register_comm_hook(PowerSGDHook(rank=2)))


# -- elastic restarts: the hook's state starts afresh -------------------------------------

STEPS, COMMIT_EVERY, KILL_AFTER, ELASTIC_START = 12, 5, 7, 2


def elastic_step(model: nn.Module, opt: Any, step: int) -> None:
    opt.zero_grad()
    local_grads(model, step, hvd.rank(), 1)
    opt.step()


def wrapped(model: nn.Module) -> tuple[Any, PowerSGDHook]:
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hook = PowerSGDHook(rank=RANK, start_iter=ELASTIC_START, seed=SEED)
    opt.register_comm_hook(hook)
    return opt, hook


def save_weights(model: nn.Module, out: Path) -> None:
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    everyone = hvd.allgather_object(weights, name="powersgd.weights")
    if any(w != weights for w in everyone):
        raise AssertionError("the ranks' final weights differ")
    if hvd.rank() == 0:
        (out / "weights.bin").write_bytes(weights)


def case_elastic_killed(args: Any) -> None:
    """Under torchrun --max-restarts 1: rank 1 dies after step 7 of the first
    attempt; every rank restarts from the commit of step 5 with a new hook."""
    out = Path(args.out)
    torch.manual_seed(3)
    model = Net()
    opt, hook = wrapped(model)
    state = hvd.elastic.TorchState(model, opt, batch=0, commit_path=out / "commit.pt")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    @hvd.elastic.run
    def train(state: Any) -> None:
        print(f"rank {hvd.rank()} attempt {attempt} starts at step {state.batch} "
              f"(hook at step {hook.step})", flush=True)
        for step in range(state.batch, STEPS):
            elastic_step(model, opt, step)
            state.batch = step + 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
            if attempt == 0 and state.batch == KILL_AFTER and hvd.rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    train(state)
    save_weights(model, out)


def case_elastic_reference(args: Any) -> None:
    """What the killed run must end with: steps 0-4, then (the restart from
    the commit of step 5) a new model, optimizer and hook: plain steps again
    for ``start_iter``, zero errors, the seeded Q."""
    torch.manual_seed(3)
    model = Net()
    opt, _ = wrapped(model)
    for step in range(STEPS):
        if step == COMMIT_EVERY:
            model = copy.deepcopy(model)
            opt, _ = wrapped(model)
        elastic_step(model, opt, step)
    save_weights(model, Path(args.out))


CASES = {
    "reference": case_reference,
    "accumulation": case_accumulation,
    "join": case_join,
    "sharded": case_sharded,
    "refused": case_refused,
    "elastic_killed": case_elastic_killed,
    "elastic_reference": case_elastic_reference,
}


def start(args: object) -> object:
    torch.set_num_threads(1)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    hvd.init()
    return args


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="directory for the commit and the weights (elastic)")
    run_cases(CASES, parser=parser, setup=start, teardown=lambda _: hvd.shutdown())
