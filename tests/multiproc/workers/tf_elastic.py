"""Worker: ``dp_plugin.keras.elastic`` under ``torchrun --max-restarts 1``, 2 workers.

A one-layer Keras model trained by SGD with momentum (the optimizer state
matters) through a ``DistributedGradientTape`` for ``STEPS`` steps; the batch
of step ``s`` on rank ``r`` is drawn from a generator seeded with ``(s, r)``.
``state.commit()`` runs every ``COMMIT_EVERY`` steps. On the first attempt
rank 1 SIGKILLs itself right after step ``KILL_AFTER``; torchrun restarts
both workers and ``run`` resumes them from the commit of step 4.

At the end rank 0 trains the same model in-process on both ranks' batches
(the mean loss of the concatenated batch: the average of the ranks'
gradients) without any interruption and checks that the weights match
(the ranks' weights must be equal bitwise). Each attempt prints
``rank R attempt A starts at step S``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

from _fail_fast import run_cases

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import dp_plugin.keras as hvd

STEPS, COMMIT_EVERY, KILL_AFTER = 8, 2, 5


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([step, rank])
    x = rng.normal(size=(4, 3)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True) + 0.5


def build() -> tuple[keras.Model, keras.optimizers.Optimizer]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    return model, keras.optimizers.SGD(0.05, momentum=0.9)


def loss_of(model: keras.Model, x: Any, y: Any) -> Any:
    return tf.reduce_mean(tf.square(model(x) - y))


def check_killed(args: argparse.Namespace) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, opt = build()
    state = hvd.elastic.KerasState(model, opt, batch=0, commit_path=args.commit)

    @hvd.elastic.run
    def train(state: Any) -> None:
        rank = hvd.rank()
        print(f"rank {rank} attempt {attempt} starts at step {state.batch}", flush=True)
        while state.batch < STEPS:
            x, y = batch(state.batch, rank)
            with tf.GradientTape() as tape:
                loss = loss_of(model, x, y)
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            state.batch += 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
            if attempt == 0 and rank == 1 and state.batch == KILL_AFTER:
                os.kill(os.getpid(), signal.SIGKILL)

    train(state)
    weights = [w.numpy() for w in model.weights]
    everyone = hvd.allgather_object(weights)
    for a, b in zip(everyone[0], everyone[1], strict=True):
        np.testing.assert_array_equal(a, b)
    if hvd.rank() == 0:
        ref, ref_opt = build()
        for step in range(STEPS):
            parts = [batch(step, r) for r in range(hvd.size())]
            x, y = (np.concatenate(p) for p in zip(*parts, strict=True))
            with tf.GradientTape() as tape:
                loss = loss_of(ref, x, y)
            grads = tape.gradient(loss, ref.trainable_variables)
            ref_opt.apply_gradients(zip(grads, ref.trainable_variables, strict=True))
        for got, want in zip(weights, [w.numpy() for w in ref.weights], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def check_rank0_fails(args: argparse.Namespace) -> None:
    """A commit rank 0 cannot write, and one it cannot read, raise ``CommitError``
    on every rank at once, and the engine still works. Before, rank 0
    raised its own ``OSError`` while the other ranks waited for it in the commit's
    barrier or the load's broadcast until ``DP_PLUGIN_TIMEOUT``.

    ``--commit`` is a regular file (made by the test): nothing can be written
    under it. Next to it, ``unreadable.pkl`` is a directory: it cannot be read."""
    hvd.init()
    rank, blocked = hvd.rank(), Path(args.commit)
    cases = [("commit", blocked / "elastic.pkl", "rank 0 could not write the commit"),
             ("load", blocked.parent / "unreadable.pkl", "rank 0 could not read the commit")]
    for what, path, message in cases:
        state = hvd.elastic.ObjectState(epoch=rank, commit_path=path)
        started = time.monotonic()
        try:
            state.commit() if what == "commit" else state.load()
        except hvd.elastic.CommitError as exc:
            assert message in str(exc) and str(path) in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {rank}: {what} of {path} did not raise CommitError")
        took = time.monotonic() - started
        assert took < 10, f"rank {rank}: the {what} failure took {took:.1f} s to arrive"
    total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)  # the engine is not broken
    assert np.asarray(total).tolist() == [2.0], total
    print(f"rank {rank}: both failures raised CommitError at once", flush=True)


def check_forged(args: argparse.Namespace) -> None:
    """A forged commit (the test writes it: a dtype whose object field numpy is told
    holds no references, over bytes that would be read as object pointers) is
    refused with ``CommitError`` on every rank, and no rank crashes. Before,
    ``run`` unpickled the dtype, rank 0 broadcast the bytes and every rank
    segfaulted while formatting the commit's mismatch message."""
    hvd.init()
    rank = hvd.rank()
    state = hvd.elastic.ObjectState(epoch=0, commit_path=args.commit)
    try:
        hvd.elastic.run(lambda s: None)(state)
    except hvd.elastic.CommitError as exc:
        assert "cannot be loaded as an elastic commit" in str(exc), str(exc)
        assert "numpy" in str(exc) and "delete it to start afresh" in str(exc), str(exc)
    else:
        raise AssertionError(f"rank {rank}: the forged commit {args.commit} was loaded")
    total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)  # the engine is not broken
    assert np.asarray(total).tolist() == [2.0], total
    print(f"rank {rank}: the forged commit was refused", flush=True)


CASES = {"killed": check_killed, "rank0_fails": check_rank0_fails, "forged": check_forged}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", required=True)
    run_cases(CASES, parser=parser, teardown=lambda _: hvd.shutdown())
