"""A Keras 3 CNN on one workstation: MirroredStrategy inside each process,
dp_plugin across processes.

Two levels of data parallelism:

- inside a process, ``tf.distribute.MirroredStrategy`` runs one replica per
  local device (its GPUs; here the CPU split into ``--local-devices``
  logical devices) and Keras sums the replicas' gradients;
- across processes (one per socket, or per host), ``dp.DistributedCallback``
  adds one all-reduce per fusion bucket to the compiled train step, over
  dp_plugin's engine (Gloo, MPI or Horovod's ring).

Why not TensorFlow's own tools: ``MultiWorkerMirroredStrategy`` fails in
``model.fit`` with Keras 3 (keras-team/keras#20585), and Horovod's Keras
integration (``horovod.tensorflow.keras``) is written for Keras 2. With
Keras 3, dp_plugin is how this model trains across processes or hosts.

The images are scikit-learn's bundled handwritten digits (8x8, shipped in
the package), upsampled to ``--image-size``; 20% are held out.

    torchrun --nproc_per_node 2 examples/keras_digits.py   # or mpirun -n 2, horovodrun -np 2
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Keras 3 CNN on the digits: MirroredStrategy over local devices, "
                    "dp_plugin across processes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--epochs", type=int, default=8, help="passes over the training images")
    ap.add_argument("--global-batch", type=int, default=128,
                    help="images per step over all processes and replicas")
    ap.add_argument("--lr", type=float, default=0.05,
                    help="SGD learning rate for --global-batch (momentum 0.9)")
    ap.add_argument("--local-devices", type=int, default=2,
                    help="logical CPU devices per process for MirroredStrategy (ignored when "
                         "the process has GPUs: it uses them all); 1: no strategy")
    ap.add_argument("--image-size", type=int, default=16, help="pixels per side")
    ap.add_argument("--seed", type=int, default=0, help="split, init and data order")
    args = ap.parse_args(argv)
    for name in ("epochs", "global_batch", "local_devices", "image_size"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
        from sklearn.datasets import load_digits
    except ImportError as exc:
        requirement = {"tensorflow": "tensorflow-cpu==2.21.0"}.get(exc.name or "",
                                                                   "scikit-learn==1.9.1")
        raise SystemExit(f"{exc.name} is not installed: `pip install '{requirement}'` "
                         "(or `make install`)") from None
    # Before anything starts the TensorFlow runtime: split the CPU into logical devices.
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus and args.local_devices > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.local_devices)
    import keras
    import numpy as np

    import dp_plugin.tensorflow as dp

    dp.init()
    rank, size = dp.rank(), dp.size()
    if args.global_batch % size:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {size} "
                         "processes")
    per_process = args.global_batch // size

    digits = load_digits()
    x = tf.image.resize(digits.images[..., None].astype("float32") / 16.0,
                        (args.image_size, args.image_size)).numpy()
    y = digits.target.astype("int64")
    perm = np.random.default_rng(args.seed).permutation(len(y))
    n_test = len(y) // 5
    x_test, y_test = x[perm[:n_test]], y[perm[:n_test]]
    x_train, y_train = x[perm[n_test:]], y[perm[n_test:]]

    devices = [d.name for d in tf.config.list_logical_devices("GPU" if gpus else "CPU")]
    strategy = (tf.distribute.MirroredStrategy(devices) if len(devices) > 1
                else tf.distribute.get_strategy())
    with strategy.scope():
        keras.utils.set_random_seed(args.seed)
        model = keras.Sequential([
            keras.Input((args.image_size, args.image_size, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(
            optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    train = (dp.shard(tf.data.Dataset.from_tensor_slices((x_train, y_train)))
             .shuffle(2048, seed=args.seed).batch(per_process, drop_remainder=True))
    # The same number of steps on every process (a train step is a collective).
    steps = (len(y_train) // size) // per_process
    if rank == 0:
        print(f"processes {size} x replicas {strategy.num_replicas_in_sync} "
              f"({', '.join(devices)}): global batch {args.global_batch}, {steps} steps/epoch",
              flush=True)
    history = model.fit(
        train.repeat(), epochs=args.epochs, steps_per_epoch=steps, verbose=0, shuffle=False,
        callbacks=[dp.DistributedCallback(), dp.MetricAverageCallback()],
    )
    losses = history.history["loss"]
    # Held-out accuracy: the weights are identical on every process, so each
    # scores the whole (small) held-out set and rank 0 reports it.
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    if rank == 0:
        for epoch, loss in enumerate(losses):
            print(f"epoch {epoch + 1}/{args.epochs} loss {loss:.4f}", flush=True)
        print(f"final: processes {size} held-out accuracy {accuracy:.4f} "
              f"({len(y_test)} images, chance 0.10)", flush=True)
    dp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
