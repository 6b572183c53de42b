"""Synthetic defect-inspection data of the main job's story: four production lines, shared by its
training program, its client and the spans it commits.

A patch is a textured surface (each line its own texture and lighting) that is either ``ok`` or
carries one defect: a ``scratch`` (a thin bright straight line at any angle), a ``spot`` (a dark
round blot) or a ``crack`` (a dark jagged path). Lines differ the way real lines do: the material's
grain, its period and orientation, and the lamps (brightness and a gradient across the patch), so a
model trained on one line is not as good on another. A lighting change (``lighting`` below 1, with a
side light) is the drift of the story: defects lose contrast against a darker, uneven surface.

Spans are what a line delivers per day: CSV with ``line``, ``day``, ``label`` and the patch
downsampled to 16x16 grey levels (``p000`` .. ``p255``), the input of the story's MLP.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

SIZE, CLASSES = 32, 4
CLASS_NAMES = ("ok", "scratch", "spot", "crack")
SPAN_SIZE = 16
"""Span patches are SIZE/2 on a side (2x2 means): 256 features."""


@dataclass(frozen=True)
class Line:
    """A production line's surface and lamps."""

    number: int
    period: float  # texture period, pixels
    angle: float  # texture orientation, radians
    ripple: float  # texture amplitude
    grain: float  # per-pixel noise std
    brightness: float  # mean grey level of the lit surface
    gradient: float  # lamp fall-off across the patch (share of brightness)


LINES = {
    1: Line(1, period=6.0, angle=0.0, ripple=0.05, grain=0.05, brightness=0.45, gradient=0.05),
    2: Line(2, period=3.5, angle=0.8, ripple=0.07, grain=0.04, brightness=0.50, gradient=0.10),
    3: Line(3, period=9.0, angle=1.6, ripple=0.04, grain=0.06, brightness=0.40, gradient=0.08),
    4: Line(4, period=4.5, angle=2.4, ripple=0.06, grain=0.07, brightness=0.55, gradient=0.12),
}


def _surface(line: Line, lighting: float, rng: np.random.Generator) -> np.ndarray:
    ys, xs = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi)
    along = xs * np.cos(line.angle) + ys * np.sin(line.angle)
    texture = line.ripple * np.sin(2 * np.pi * along / line.period + phase)
    side = 1.0 - (1.0 - lighting) * 1.5 * xs / SIZE  # a dimmed lamp lights one side less than the other
    lamp = line.brightness * lighting * side * (1 + line.gradient * (ys / SIZE - 0.5))
    return lamp + texture + rng.normal(0, line.grain, (SIZE, SIZE))


def _scratch(image: np.ndarray, contrast: float, rng: np.random.Generator) -> None:
    angle, offset = rng.uniform(0, np.pi), rng.uniform(-6, 6)
    ys, xs = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) - SIZE / 2
    distance = np.abs(xs * np.sin(angle) - ys * np.cos(angle) - offset)
    length = np.abs(xs * np.cos(angle) + ys * np.sin(angle))
    image += contrast * 1.2 * ((distance < 0.8) & (length < rng.uniform(8, 14)))


def _spot(image: np.ndarray, contrast: float, rng: np.random.Generator) -> None:
    cy, cx = rng.uniform(8, SIZE - 8, 2)
    radius = rng.uniform(2.0, 4.0)
    ys, xs = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    image -= contrast * 0.9 * np.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / (2 * radius ** 2))


def _crack(image: np.ndarray, contrast: float, rng: np.random.Generator) -> None:
    y, x = rng.uniform(6, SIZE - 6, 2)
    heading = rng.uniform(0, 2 * np.pi)
    for _ in range(int(rng.integers(14, 24))):
        heading += rng.normal(0, 0.7)
        y, x = np.clip(y + np.sin(heading), 0, SIZE - 1), np.clip(x + np.cos(heading), 0, SIZE - 1)
        image[int(y), int(x)] -= contrast * 1.1


_DEFECTS = {1: _scratch, 2: _spot, 3: _crack}


def inspection_patches(count: int, seed: int, *, line: int = 1, lighting: float = 1.0
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``count`` grey ``SIZE`` x ``SIZE`` patches of ``line`` under ``lighting`` (1: its lamps as
    installed) with balanced random classes: images ``[count, SIZE, SIZE, 1]`` in [0, 1], labels."""
    settings = LINES[line]
    rng = np.random.default_rng([seed, line, int(lighting * 1000)])
    labels = rng.integers(0, CLASSES, count)
    images = np.empty((count, SIZE, SIZE, 1), np.float32)
    for index, label in enumerate(labels):
        image = _surface(settings, lighting, rng)
        if label:
            _DEFECTS[int(label)](image, settings.brightness * lighting, rng)
        images[index, :, :, 0] = image
    return np.clip(images, 0, 1), labels


def span_features(images: np.ndarray) -> np.ndarray:
    """Patches as span rows: 2x2 means, ``SPAN_SIZE`` squared grey levels per row."""
    count = len(images)
    return images.reshape(count, SPAN_SIZE, 2, SPAN_SIZE, 2).mean(axis=(2, 4)).reshape(count, -1)


FEATURES = tuple(f"p{i:03d}" for i in range(SPAN_SIZE * SPAN_SIZE))


def span_csv(line: int, day: int, count: int, *, lighting: float = 1.0) -> bytes:
    """One line's span of one day: ``count`` labelled rows, the same for the same arguments."""
    images, labels = inspection_patches(count, seed=day, line=line, lighting=lighting)
    rows = span_features(images)
    out = io.StringIO()
    out.write(",".join(("line", "day", "label", *FEATURES)) + "\n")
    for label, row in zip(labels, rows):
        out.write(f"{line},{day},{label}," + ",".join(f"{v:.3f}" for v in row) + "\n")
    return out.getvalue().encode()
