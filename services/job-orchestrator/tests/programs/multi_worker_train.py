"""A two-worker Keras job with MultiWorkerMirroredStrategy: each worker reads its place from TF_CONFIG.

Run by the job orchestrator with a ``worker`` role of 2 replicas. Every worker checks that
TF_CONFIG names itself as the orchestrator says (OPML_TASK_TYPE / OPML_TASK_INDEX), prints the
cluster, and trains its share of each batch of synthetic data with a custom loop; gradients are
all-reduced between the workers every step, so both end with the same weights.
"""

import os

import jobenv
import numpy as np
import tensorflow as tf

config = jobenv.tf_config()
task = config["task"]
assert task == {"type": os.environ["OPML_TASK_TYPE"], "index": int(os.environ["OPML_TASK_INDEX"])}, config
assert list(config["cluster"]) == ["worker"] and len(config["cluster"]["worker"]) == 2, config
print(f"task {task['type']} {task['index']} of cluster {config['cluster']}", flush=True)

strategy = tf.distribute.MultiWorkerMirroredStrategy()
print(f"replicas in sync: {strategy.num_replicas_in_sync}", flush=True)

rng = np.random.default_rng(0)  # the same data on every worker; the strategy shards it
x = rng.normal(size=(256, 4)).astype("float32")
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")
GLOBAL_BATCH = 32
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat().with_options(options)
batches = iter(strategy.experimental_distribute_dataset(dataset))

with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
    optimizer = tf.keras.optimizers.SGD(0.05)


@tf.function
def train_step(iterator):
    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(x) - y), axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # all-reduced across workers
        return loss

    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=next(iterator)), axis=None)


for step in range(1, 25):
    loss = train_step(batches)
    if step % 8 == 0:
        print(f"step {step} loss {float(loss):.4f}", flush=True)
weights = np.round(model.trainable_variables[0].numpy().ravel(), 4).tolist()
print(f"final weights {weights}", flush=True)  # the same on every worker: they trained one model
