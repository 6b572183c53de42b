"""A tf.compat.v1 graph-mode training loop driven by Session.run, as TensorFlow 1 programs were written."""

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
tf1.disable_eager_execution()

x = tf1.placeholder(tf.float32, [None, 4], name="x")
y = tf1.placeholder(tf.float32, [None, 1], name="y")
w = tf1.get_variable("w", [4, 1])
loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y), name="loss")
train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")

rng = np.random.default_rng(2)
with tf1.Session() as session:
    session.run(tf1.global_variables_initializer())
    for _ in range(5):
        batch = rng.random((8, 4), dtype=np.float32)
        session.run([loss, train_op], feed_dict={x: batch, y: batch.sum(axis=1, keepdims=True)})
with tf1.train.MonitoredSession() as session:
    for _ in range(3):
        batch = rng.random((8, 4), dtype=np.float32)
        session.run(train_op, feed_dict={x: batch, y: batch.sum(axis=1, keepdims=True)})
print("done")
