"""Data heterogeneity on scikit-learn's digits (shipped with the package, never downloaded): a
held-out test set for the server, and the rest split among clients with Dirichlet label skew
(Hsu et al., 2019: smaller ``alpha``, more skew) and unequal sizes (log-normal shares)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


@dataclass(frozen=True)
class Partition:
    clients: list[tuple[np.ndarray, np.ndarray]]
    test: tuple[np.ndarray, np.ndarray]
    classes: int


def partition_digits(num_clients: int, *, alpha: float = 0.5, size_sigma: float = 0.8, seed: int = 0,
                     test_fraction: float = 0.2, min_examples: int = 4) -> Partition:
    """Digits (pixels scaled to [0, 1]) split into ``num_clients`` non-IID shards and a test set.

    Raises:
        ValueError: fewer than 1 client, ``alpha`` <= 0, or more clients than examples allow.
    """
    if num_clients < 1 or not alpha > 0:
        raise ValueError(f"num_clients must be >= 1 and alpha > 0, but got {num_clients}, {alpha}")
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    if num_clients * min_examples > len(y_train):
        raise ValueError(f"{num_clients} clients of at least {min_examples} examples need more than "
                         f"{len(y_train)} training examples")
    rng = np.random.default_rng(seed)
    classes = int(y.max()) + 1
    sizes = rng.lognormal(0.0, size_sigma, num_clients)
    # Each client's label mix from Dirichlet(alpha); each example goes to a client in proportion to
    # the client's size times its appetite for the example's label.
    mixes = rng.dirichlet([alpha] * classes, num_clients)
    owners = np.empty(len(y_train), dtype=int)
    for label in range(classes):
        where = np.flatnonzero(y_train == label)
        appetite = sizes * mixes[:, label]
        owners[where] = rng.choice(num_clients, size=len(where), p=appetite / appetite.sum())
    # Every client gets at least min_examples: top up from the largest shards.
    for client in range(num_clients):
        while np.count_nonzero(owners == client) < min_examples:
            largest = np.bincount(owners, minlength=num_clients).argmax()
            owners[rng.choice(np.flatnonzero(owners == largest))] = client
    shards = [(x_train[owners == c], y_train[owners == c]) for c in range(num_clients)]
    return Partition(shards, (x_test, y_test), classes)
