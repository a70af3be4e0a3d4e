"""Horovod's Keras example (tensorflow2_keras_mnist.py), unchanged except for its ``hvd`` import.

Usage: ``python horovod_keras_script.py CHECKPOINT_DIR`` under horovodrun (or
any launcher). Shaped like Horovod 0.28.1's example, with synthetic data in
place of the MNIST download: scale the learning rate by ``hvd.size()``, wrap
the optimizer, ``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``,
``hvd.callbacks.MetricAverageCallback()``,
``hvd.callbacks.LearningRateWarmupCallback(...)``, checkpoint on rank 0 only.
The one Keras 3 change: ``compile()`` no longer takes
``experimental_run_tf_function=False`` (see docs/keras.md). Apart from the
import, nothing here names the plugin. At the end every rank prints a digest
of its weights (the test checks they are equal) and ``rank R OK``.
"""

import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import dp_plugin.keras as hvd

# Horovod: initialize Horovod.
hvd.init()

rng = np.random.default_rng(hvd.rank())
images = rng.random((256, 28, 28)).astype(np.float32)
labels = (images.mean(axis=(1, 2)) * 10 % 10).astype(np.int64)
dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(images[..., tf.newaxis], tf.float32), tf.cast(labels, tf.int64)))
dataset = dataset.repeat().shuffle(256, seed=1).batch(32)

tf.keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast fixes them
mnist_model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(32, activation="relu"),
    tf.keras.layers.Dense(10, activation="softmax"),
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = tf.keras.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients. (Keras 3: removed.)
mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                    metrics=["accuracy"])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first three epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1, verbose=1),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(
        os.path.join(sys.argv[1], "checkpoint-{epoch}.keras")))

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
history = mnist_model.fit(dataset, steps_per_epoch=8 // hvd.size(), callbacks=callbacks,
                          epochs=2, verbose=verbose)

digest = hashlib.sha256(b"".join(w.tobytes() for w in mnist_model.get_weights())).hexdigest()
print(f"rank {hvd.rank()} weights {digest} loss {history.history['loss'][-1]!r}", flush=True)
print(f"rank {hvd.rank()} OK", flush=True)
