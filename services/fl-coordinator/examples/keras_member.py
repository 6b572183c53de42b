"""A federation member that trains a small Keras classifier on its own shard of scikit-learn's
digits: ``OPML_FL_CLIENT_TOKEN=... python keras_member.py 127.0.0.1:50057 plants 0 4``
(the token from ``opml fl register plants plant-0``; OPML_TOKEN too when platform auth is on)."""

import os
import sys

import keras

from opml_fl_coordinator.simulator import partition_digits
from opml_fl_coordinator_contract.client import run_client
from opml_fl_coordinator_contract.keras_client import KerasClient

target, federation, index, shards = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
x, y = partition_digits(shards, alpha=0.5).clients[index]  # this plant's data; it never leaves
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
run = run_client(target, federation, os.environ["OPML_FL_CLIENT_TOKEN"], KerasClient(model, x, y),
                 token=os.environ.get("OPML_TOKEN"))
print(f"done: {run.tasks} tasks, {run.accepted} accepted, {len(run.rejected)} rejected")
