"""A training loop that survives preemptions and crashes: it resumes from its last checkpoint.

Each step trains a small regression model on a batch drawn from the step number (so a resumed
run sees the data it would have seen), appends ``{"attempt", "step", "loss"}`` to
``metrics.jsonl`` in the checkpoint directory, and every ``--checkpoint-every`` steps saves a
checkpoint (model, optimizer and step, with tf.train.CheckpointManager) and reports it. On
SIGTERM (a preemption) it saves at the end of the current step and exits 0; a resumed run
(``OPML_JOB_ATTEMPT`` > 0) restores the latest checkpoint and goes on from its step.

``--crash-at-step N`` makes the first attempt die (exit code 3) right after the checkpoint of step
N: the injected crash that the retry test recovers from.
"""

import argparse
import json
import os
import sys
import time

import jobenv
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--checkpoint-every", type=int, default=10)
parser.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step, to stand for real work")
parser.add_argument("--crash-at-step", type=int, default=None)
args = parser.parse_args()

preemption = jobenv.Preemption()
directory = jobenv.checkpoint_dir()
attempt = jobenv.attempt()

model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
optimizer = tf.keras.optimizers.SGD(0.05)
step = tf.Variable(0, dtype=tf.int64)
checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
manager = tf.train.CheckpointManager(checkpoint, str(directory / "ckpt"), max_to_keep=2)
if manager.latest_checkpoint:
    checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
print(f"attempt {attempt} starts at step {int(step)} of {args.steps}", flush=True)

true_w = tf.constant([[1.0], [-2.0], [0.5], [3.0]])


@tf.function
def train_step(seed: tf.Tensor) -> tf.Tensor:
    x = tf.random.stateless_normal((32, 4), seed=tf.stack([seed, tf.constant(0, tf.int64)]))
    y = x @ true_w
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss


def save(why: str) -> None:
    if manager.latest_checkpoint and manager.latest_checkpoint.endswith(f"-{int(step)}"):
        return  # saved at this step already
    manager.save(checkpoint_number=int(step))
    jobenv.report_checkpoint(int(step))
    print(f"saved step {int(step)} ({why})", flush=True)


with open(directory / "metrics.jsonl", "a") as metrics:
    while int(step) < args.steps:
        loss = float(train_step(step))
        step.assign_add(1)
        metrics.write(json.dumps({"attempt": attempt, "step": int(step), "loss": loss}) + "\n")
        metrics.flush()
        time.sleep(args.step_seconds)
        if preemption.requested:
            save("preempted")
            sys.exit(0)
        if int(step) % args.checkpoint_every == 0:
            save("periodic")
            if attempt == 0 and args.crash_at_step is not None and int(step) >= args.crash_at_step:
                print("injected crash", flush=True)
                os._exit(3)
save("done")
print(f"finished at step {int(step)} with loss {loss:.4f}", flush=True)
