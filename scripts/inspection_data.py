"""Synthetic inspection patches of the main job's story, shared by its training program and its client."""

from __future__ import annotations

import numpy as np

SIZE, CLASSES = 32, 4
CLASS_NAMES = ("ok", "scratch-left", "scratch-right", "scratch-centre")


def inspection_patches(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy grey 32x32 patches; classes 1-3 carry a bright vertical scratch in one third of the patch."""
    rng = np.random.default_rng(seed)
    images = rng.normal(0.3, 0.08, (count, SIZE, SIZE, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, count)
    for image, label in zip(images, labels):
        if label:
            column = int(rng.integers(2, 9)) + (label - 1) * 11
            image[4:28, column:column + 2, 0] += 0.6
    return np.clip(images, 0, 1), labels
