"""A plain Keras CNN training script on synthetic MNIST-sized data (nothing in it knows about tracing).

Usage: python keras_cnn.py [--steps N] [--epochs E] [--wait-file PATH]
With --wait-file, the script keeps training one more epoch at a time until PATH exists.
"""

import argparse
import os

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6, help="batches per epoch")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--wait-file", default=None)
args = parser.parse_args()

rng = np.random.default_rng(0)
x = rng.random((args.steps * args.batch_size, 28, 28, 1), dtype=np.float32)
y = rng.integers(0, 10, size=(args.steps * args.batch_size,))

model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(8, 3, activation="relu"),
    tf.keras.layers.MaxPooling2D(),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(10),
])
model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
while args.wait_file and not os.path.exists(args.wait_file):
    model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
model.evaluate(x[: 2 * args.batch_size], y[: 2 * args.batch_size], batch_size=args.batch_size, verbose=0)
model.predict(x[: args.batch_size], batch_size=args.batch_size, verbose=0)
print("done")
