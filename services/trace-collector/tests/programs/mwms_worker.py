"""One worker of a MultiWorkerMirroredStrategy custom training loop; the cluster comes from TF_CONFIG.

Usage: TF_CONFIG='{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": I}}' python mwms_worker.py
"""

import argparse

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

strategy = tf.distribute.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(3)
features = rng.random((64, 10), dtype=np.float32)
labels = rng.random((64, 1), dtype=np.float32)
dataset = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(16)
distributed = strategy.experimental_distribute_dataset(dataset)
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    optimizer = tf.keras.optimizers.SGD(0.01)


@tf.function
def train_step(x, y):
    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss
    losses = strategy.run(replica_step, args=(x, y))
    return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)


iterator = iter(distributed)
for _ in range(args.steps):
    x, y = next(iterator)
    loss = train_step(x, y)
print("done", strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id, float(loss))
