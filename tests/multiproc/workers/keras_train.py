"""Worker: Keras training on every rank equals one process on the global batch.

Run under any launcher (see tests/multiproc/harness.py)::

    python keras_train.py --case fit     # prints "rank R OK"
    python keras_train.py --list-cases

The process first splits its CPU into two logical devices (so that
MirroredStrategy has two replicas), then runs the requested case. Each rank
starts from a model initialised with its own seed; after training, the final
weights must be bitwise identical on all ranks (a digest is all-gathered)
and, on rank 0, within 1e-5 of a single-process run from rank 0's initial
weights on the concatenated global batches (rank r's batch of step s is rows
``[s*G + r*B, s*G + (r+1)*B)`` of the global data, ``G = B * size``).

``dp.shard`` is checked first (rank r gets elements r, r + size, ...).
Cases, one per launch (``fit_variants`` runs optimizer, features, passes
and mixed below, one after the other; TensorFlow starts slowly):
- fit: ``model.fit`` with ``DistributedCallback``, default strategy; the
  optimizer's momentum starts from rank-dependent values, so the broadcast of
  the optimizer state is checked too.
- mirrored: the same with the model under MirroredStrategy over 2 devices.
- fit_jit: ``fit`` with ``jit_compile=True``: XLA kept (the split step) by
  default, turned off with a warning under MirroredStrategy (2 replicas);
  both equal the single process run without XLA.
- optimizer: ``DistributedOptimizer`` + ``BroadcastGlobalVariablesCallback``.
- features: classification with ``class_weight``, ``validation_data``,
  ``steps_per_epoch`` and three ``fit`` calls (each later one with a new
  callback of the same settings: the traced step is reused), then
  ``evaluate``/``predict`` identical on all ranks.
- passes: ``backward_passes_per_step=2`` with averaged aggregation equals a
  single process with twice the batch.
- mixed: ``mixed_float16`` (LossScaleOptimizer) trains identically on all
  ranks; then a non-finite gradient on the last rank only makes *every* rank
  skip that step (same loss scale, iterations and weights everywhere); the
  same with ``DistributedOptimizer`` wrapped by ``compile()``.
- tape: custom loop with ``DistributedGradientTape`` (two eager steps, then
  ``tf.function`` steps) after a ``broadcast_variables`` inside tf.function.
- tape_mirrored: the custom loop inside ``strategy.run`` on 2 replicas.

Any failure prints a traceback and exits 1 at once (the other ranks then
fail their next collective after DP_PLUGIN_TIMEOUT instead of hanging).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from typing import Any

from _fail_fast import run_cases

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

# Before anything initialises the TensorFlow runtime.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import dp_plugin.tensorflow as dp  # noqa: E402
from dp_plugin.agree import checked  # noqa: E402
from dp_plugin.launch import runtime  # noqa: E402
from dp_plugin.tensorflow.optimizer import hook_of  # noqa: E402
from dp_plugin.tensorflow.xla_split import is_split_for  # noqa: E402

FEATURES, OUTPUTS, HIDDEN = 6, 2, 16
LOCAL_BATCH = 8
STEPS = 4
LR = 0.05
TOL = 1e-5


# -- data and models -----------------------------------------------------------

def global_data(steps: int, seed: int, classes: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = steps * LOCAL_BATCH * dp.size()
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    if classes:
        return x, rng.integers(0, classes, size=(n,)).astype(np.int64)
    return x, rng.normal(size=(n, OUTPUTS)).astype(np.float32)


def local_rows(a: np.ndarray, batch: int = LOCAL_BATCH) -> np.ndarray:
    """This rank's share of every global batch, in step order."""
    g = batch * dp.size()
    r = dp.rank()
    return np.concatenate([a[s : s + g][r * batch : (r + 1) * batch] for s in range(0, len(a), g)])


def make_model(seed: int, outputs: int = OUTPUTS, activation: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="tanh"),
        keras.layers.Dense(outputs, activation=activation),
    ])


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(LR, momentum=0.9)


def mirrored() -> tf.distribute.Strategy:
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


# -- checks ----------------------------------------------------------------------

def digest(arrays: list[np.ndarray]) -> np.ndarray:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8).copy()


def assert_identical_on_all_ranks(arrays: list[np.ndarray], what: str) -> None:
    eng = runtime.engine()
    table = np.asarray(checked.allgather(eng, digest(arrays), f"digest.{what}"))
    table = table.reshape(eng.size, -1)
    differing = [r for r in range(eng.size) if not np.array_equal(table[r], table[0])]
    if differing:
        raise AssertionError(f"{what}: ranks {differing} end with weights different from rank 0")


def assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str,
                 tol: float = TOL) -> None:
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
    if not worst <= tol:
        raise AssertionError(f"{what}: differs from the single-process run by {worst:g} > {tol:g}")
    print(f"rank {dp.rank()} {what}: max |distributed - single process| = {worst:.3g}")


def momentums(optimizer: keras.optimizers.Optimizer) -> list[Any]:
    return [v for v in optimizer.variables if "momentum" in v.name]


# -- cases -------------------------------------------------------------------------

def case_fit(strategy: tf.distribute.Strategy | None = None,
             wrap: str = "callback", jit: bool = False) -> keras.Model:
    x, y = global_data(STEPS, seed=1)
    scope = strategy.scope() if strategy is not None else _null_scope()
    with scope:
        model = make_model(seed=100 + dp.rank())
        opt = sgd()
        if wrap == "optimizer":
            opt = dp.DistributedOptimizer(opt)
        model.compile(optimizer=opt, loss="mse", jit_compile=jit)
        opt.build(model.trainable_variables)
    # Rank-dependent optimizer state: only the root's may survive the broadcast.
    rng = np.random.default_rng(7 + dp.rank())
    for v in momentums(opt):
        v.assign(rng.normal(size=v.shape).astype(np.float32) * 0.01)
    init_w = model.get_weights()
    init_m = [v.numpy() for v in momentums(opt)]
    callback = (dp.DistributedCallback() if wrap == "callback"
                else dp.BroadcastGlobalVariablesCallback(0))
    model.fit(local_rows(x), local_rows(y), batch_size=LOCAL_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[callback])
    final = model.get_weights()
    what = f"fit[{wrap}, {'mirrored' if strategy else 'default'}{', jit' if jit else ''}]"
    if jit:
        _check_jit(model, strategy, what)
    assert_identical_on_all_ranks(final, what)
    calls = hook_of(model.optimizer).bridge.calls  # type: ignore[union-attr]
    if calls != STEPS:  # once per worker and step, also with 2 replicas
        raise AssertionError(f"{what}: the bridge ran {calls} times for {STEPS} steps")
    if dp.rank() == 0:
        ref = make_model(seed=0)
        ref.set_weights(init_w)
        ref_opt = sgd()
        ref.compile(optimizer=ref_opt, loss="mse")
        ref_opt.build(ref.trainable_variables)
        for v, m in zip(momentums(ref_opt), init_m, strict=True):
            v.assign(m)
        ref.fit(x, y, batch_size=LOCAL_BATCH * dp.size(), epochs=1, shuffle=False, verbose=0)
        assert_close(final, ref.get_weights(), what)
    return model


def _check_jit(model: keras.Model, strategy: tf.distribute.Strategy | None, what: str) -> None:
    """One replica: XLA kept (the split step); several: turned off, as warned."""
    split = is_split_for(model, hook_of(model.optimizer))  # type: ignore[arg-type]
    if strategy is None and not (model.jit_compile and split):
        raise AssertionError(f"{what}: jit_compile={model.jit_compile}, split step {split}; "
                             "XLA should have been kept")
    if strategy is not None and (model.jit_compile or split):
        raise AssertionError(f"{what}: XLA kept with {strategy.num_replicas_in_sync} replicas")


def case_fit_jit() -> None:
    """``jit_compile=True``: kept with one replica, turned off (warning) with two;
    both train as one process without XLA."""
    case_fit(jit=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        case_fit(mirrored(), jit=True)
    if not any("turning off jit_compile" in str(w.message) for w in caught):
        raise AssertionError("fit[mirrored, jit]: no warning that XLA was turned off")


def case_features() -> None:
    classes, steps = 3, 4
    x, y = global_data(steps, seed=2, classes=classes)
    vx, vy = global_data(2, seed=3, classes=classes)
    weights = {0: 1.0, 1: 2.0, 2: 0.5}

    def train(model: keras.Model, xs: np.ndarray, ys: np.ndarray, batch: int,
              callbacks: Callable[[], list[Any]]) -> None:
        model.fit(xs, ys, batch_size=batch, epochs=2, steps_per_epoch=2, shuffle=False,
                  class_weight=weights, validation_data=(vx, vy), verbose=0,
                  callbacks=callbacks())
        model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks())
        model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  class_weight=weights, callbacks=callbacks())

    model = make_model(seed=200 + dp.rank(), outputs=classes, activation="softmax")
    model.compile(optimizer=sgd(), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    init_w = model.get_weights()
    callback = dp.DistributedCallback()
    train(model, local_rows(x), local_rows(y), LOCAL_BATCH,
          lambda: [callback if callback.model is None else dp.DistributedCallback()])
    final = model.get_weights()
    assert_identical_on_all_ranks(final, "features")
    evaluated = np.array(model.evaluate(vx, vy, verbose=0), dtype=np.float64)
    predicted = model.predict(vx, verbose=0)
    assert_identical_on_all_ranks([evaluated, predicted], "features evaluate/predict")
    if dp.rank() == 0:
        ref = make_model(seed=0, outputs=classes, activation="softmax")
        ref.set_weights(init_w)
        ref.compile(optimizer=sgd(), loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"])
        train(ref, x, y, LOCAL_BATCH * dp.size(), lambda: [])
        assert_close(final, ref.get_weights(), "features")


def case_passes() -> None:
    x, y = global_data(STEPS, seed=4)
    model = make_model(seed=300 + dp.rank())
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    init_w = model.get_weights()
    model.fit(local_rows(x), local_rows(y), batch_size=LOCAL_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[dp.DistributedCallback(backward_passes_per_step=2,
                                                           average_aggregated_gradients=True)])
    final = model.get_weights()
    assert_identical_on_all_ranks(final, "passes")
    if int(model.optimizer.iterations) != STEPS // 2:
        raise AssertionError(f"passes: {int(model.optimizer.iterations)} optimizer steps, "
                             f"expected {STEPS // 2}")
    if dp.rank() == 0:
        ref = make_model(seed=0)
        ref.set_weights(init_w)
        ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        ref.fit(x, y, batch_size=2 * LOCAL_BATCH * dp.size(), epochs=1, shuffle=False, verbose=0)
        assert_close(final, ref.get_weights(), "passes")


def case_mixed() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = global_data(STEPS, seed=5)
        model = make_model(seed=400 + dp.rank())
        model.compile(optimizer=sgd(), loss="mse")
        if not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            raise AssertionError("mixed: compile() did not wrap a LossScaleOptimizer")
        init_w = model.get_weights()
        model.fit(local_rows(x), local_rows(y), batch_size=LOCAL_BATCH, epochs=1, shuffle=False,
                  verbose=0, callbacks=[dp.DistributedCallback()])
        final = model.get_weights()
        assert_identical_on_all_ranks(final, "mixed")
        if dp.rank() == 0:
            ref = make_model(seed=0)
            ref.set_weights(init_w)
            ref.compile(optimizer=sgd(), loss="mse")
            ref.fit(x, y, batch_size=LOCAL_BATCH * dp.size(), epochs=1, shuffle=False, verbose=0)
            assert_close(final, ref.get_weights(), "mixed", tol=1e-3)

        # A non-finite gradient on the last rank only, in the first of 2 steps.
        lx, ly = local_rows(x)[: 2 * LOCAL_BATCH].copy(), local_rows(y)[: 2 * LOCAL_BATCH]
        if dp.rank() == dp.size() - 1:
            lx[0, 0] = 1e30  # inf in float16
        opt = model.optimizer
        scale, iters = float(opt.dynamic_scale), int(opt.iterations)
        model.fit(lx, ly, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[dp.DistributedCallback()])
        after_scale, after_iters = float(opt.dynamic_scale), int(opt.iterations)
        if (after_scale, after_iters) != (scale / 2, iters + 1):
            raise AssertionError(
                f"mixed: expected one skipped step (loss scale {scale} -> {scale / 2}, "
                f"iterations {iters} -> {iters + 1}), got {after_scale}, {after_iters}")
        state = [*model.get_weights(), np.array([after_scale, after_iters], np.float64)]
        if not all(np.isfinite(w).all() for w in state):
            raise AssertionError("mixed: non-finite weights after the skipped step")
        assert_identical_on_all_ranks(state, "mixed skip decision")

        # DistributedOptimizer: compile() wraps it in a LossScaleOptimizer, and
        # BroadcastGlobalVariablesCallback moves the reduction onto that wrapper.
        model = make_model(seed=450 + dp.rank())
        model.compile(optimizer=dp.DistributedOptimizer(sgd()), loss="mse")
        model.fit(lx, ly, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[dp.BroadcastGlobalVariablesCallback(0)])
        opt = model.optimizer
        if hook_of(opt) is None or hook_of(opt.inner_optimizer) is not None:
            raise AssertionError("mixed: the reduction was not moved onto the LossScaleOptimizer")
        if int(opt.iterations) != 1:
            raise AssertionError(f"mixed: {int(opt.iterations)} steps applied, expected 1 of 2")
        state = [*model.get_weights(), np.array([float(opt.dynamic_scale)], np.float64)]
        assert_identical_on_all_ranks(state, "mixed DistributedOptimizer skip decision")
    finally:
        keras.mixed_precision.set_global_policy("float32")


def case_tape(strategy: tf.distribute.Strategy | None = None) -> None:
    x, y = global_data(STEPS, seed=6)
    scope = strategy.scope() if strategy is not None else _null_scope()
    with scope:
        model = make_model(seed=500 + dp.rank())
        opt = keras.optimizers.SGD(LR, momentum=0.9)
        opt.build(model.trainable_variables)
    init_w = [v.numpy() for v in model.weights] if dp.rank() == 0 else []

    @tf.function
    def broadcast() -> None:
        dp.broadcast_variables(model.weights, root_rank=0)

    broadcast()
    if dp.rank() == 0 and not all(
        np.array_equal(a, v.numpy()) for a, v in zip(init_w, model.weights, strict=True)
    ):
        raise AssertionError("tape: broadcast changed the root's weights")
    mse = keras.losses.MeanSquaredError()

    def step(xb: Any, yb: Any) -> None:
        with tf.GradientTape() as tape:
            # Under a strategy, Keras losses divide by the number of replicas
            # themselves (keras.losses.loss.scale_loss_for_distribution).
            loss = mse(yb, model(xb, training=True))
        tape = dp.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    lx, ly = local_rows(x), local_rows(y)
    if strategy is None:
        graph_step = tf.function(step)
        for s in range(STEPS):
            rows = slice(s * LOCAL_BATCH, (s + 1) * LOCAL_BATCH)
            (step if s < 2 else graph_step)(tf.constant(lx[rows]), tf.constant(ly[rows]))
    else:
        data = tf.data.Dataset.from_tensor_slices((lx, ly)).batch(LOCAL_BATCH)
        run = tf.function(lambda xb, yb: strategy.run(step, args=(xb, yb)))
        for xb, yb in strategy.experimental_distribute_dataset(data):
            run(xb, yb)
    final = [v.numpy() for v in model.weights]
    what = f"tape[{'mirrored' if strategy else 'default'}]"
    assert_identical_on_all_ranks(final, what)
    if dp.rank() == 0:
        ref = make_model(seed=0)
        ref.set_weights(init_w)
        ref_opt = keras.optimizers.SGD(LR, momentum=0.9)
        g = LOCAL_BATCH * dp.size()
        for s in range(STEPS):
            with tf.GradientTape() as tape:
                loss = mse(y[s * g : (s + 1) * g], ref(x[s * g : (s + 1) * g], training=True))
            grads = tape.gradient(loss, ref.trainable_variables)
            ref_opt.apply_gradients(zip(grads, ref.trainable_variables, strict=True))
        assert_close(final, [v.numpy() for v in ref.weights], what)


class _null_scope:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def case_fit_variants() -> None:
    """``model.fit`` beyond the plain callback: the optimizer wrapper, fit's
    features, local accumulation, mixed precision."""
    case_fit(wrap="optimizer")
    case_features()
    case_passes()
    case_mixed()


def case_fit_autotune() -> None:
    """``fit`` under DP_PLUGIN_AUTOTUNE=1 (set by the test, with candidates and
    step counts that end the tuning before the last step): same results, and
    every rank took rank 0's decision."""
    if os.environ.get("DP_PLUGIN_AUTOTUNE") != "1":
        raise AssertionError("the test sets DP_PLUGIN_AUTOTUNE=1 for this case")
    model = case_fit()
    [sched] = hook_of(model.optimizer).bridge.schedulers  # type: ignore[union-attr]
    decision = sched.autotuner.decision if sched.autotuner is not None else None
    if decision is None or len(decision.candidates) < 2:
        raise AssertionError(f"autotune did not decide among several sizes: {decision}")
    plan = repr([b.members for b in sched.plan]).encode()
    shared = [np.array([decision.chosen, *decision.medians], dtype=np.float64),
              np.frombuffer(plan, dtype=np.uint8)]
    assert_identical_on_all_ranks(shared, "autotune decision and plan")
    print(f"rank {dp.rank()} {decision.describe()}", flush=True)


CASES: dict[str, Callable[[object], None]] = {
    "fit": lambda _: case_fit(),
    "fit_autotune": lambda _: case_fit_autotune(),
    "mirrored": lambda _: case_fit(mirrored()),
    "tape": lambda _: case_tape(),
    "tape_mirrored": lambda _: case_tape(mirrored()),
    "fit_variants": lambda _: case_fit_variants(),
    "fit_jit": lambda _: case_fit_jit(),
}


def start(_: object) -> None:
    dp.init()
    print(f"rank {dp.rank()} engine {runtime.engine().name}, {dp.size()} ranks, "
          f"local {dp.local_rank()}/{dp.local_size()}")
    shard = list(dp.shard(tf.data.Dataset.range(7)).as_numpy_iterator())
    if shard != list(range(dp.rank(), 7, dp.size())):
        raise AssertionError(f"shard: rank {dp.rank()} got elements {shard}")


def finish(_: object) -> None:
    runtime.engine().barrier()
    dp.shutdown()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=finish)
