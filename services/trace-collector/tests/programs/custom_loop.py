"""A plain custom training loop: tf.data pipeline, GradientTape and apply_gradients in a tf.function.

Usage: python custom_loop.py [--steps N] [--eager] [--wait-file PATH] [--exit-code C]
With --wait-file, the loop keeps stepping until PATH exists (at most --max-seconds).
"""

import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--wait-file", default=None)
parser.add_argument("--max-seconds", type=float, default=60)
parser.add_argument("--exit-code", type=int, default=0)
parser.add_argument("--eager", action="store_true", help="run the step eagerly (no tf.function)")
args = parser.parse_args()

rng = np.random.default_rng(1)
features = rng.random((256, 20), dtype=np.float32)
labels = (features.sum(axis=1, keepdims=True) > 10).astype(np.float32)
dataset = tf.data.Dataset.from_tensor_slices((features, labels)).shuffle(256).batch(args.batch_size).repeat()

model = tf.keras.Sequential([tf.keras.Input((20,)), tf.keras.layers.Dense(32, activation="relu"),
                             tf.keras.layers.Dense(1)])
optimizer = tf.keras.optimizers.SGD(0.01)
loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)


def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


if not args.eager:
    train_step = tf.function(train_step)
started = time.monotonic()
for step, (x, y) in enumerate(dataset):
    loss = train_step(x, y)
    done = step + 1 >= args.steps
    if args.wait_file:
        done = done and (os.path.exists(args.wait_file) or time.monotonic() - started > args.max_seconds)
    if done:
        break
print(f"steps={step + 1} loss={float(loss):.4f}")
sys.exit(args.exit_code)
