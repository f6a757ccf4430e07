"""An offline stand-in for the MNIST file Horovod's Spark examples download (libsvm, bz2): each
class a fixed random 28x28 pattern plus noise, as the torchvision stand-in's digits."""
import bz2

import numpy as np


def write_mnist_libsvm(path: str, rows: int = 1200, seed: int = 1) -> None:
    """``rows`` digits in libsvm form (``label index:value ...``, 1-based, 784 features in 0..255; the
    patterns are dim, 0..96, so that the example's unnormalized SGD learns them from any initial weights)."""
    templates = np.random.default_rng(0).uniform(0, 96, size=(10, 784)) * (
        np.random.default_rng(3).uniform(size=(10, 784)) < 0.15)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=rows)
    images = np.clip(templates[labels] + rng.normal(0, 10, size=(rows, 784)) * (templates[labels] > 0), 0, 255)
    lines = []
    for label, image in zip(labels, images.round().astype(int)):
        nonzero = np.flatnonzero(image)
        lines.append(" ".join([str(int(label))] + [f"{i + 1}:{image[i]}" for i in nonzero]))
    with bz2.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
