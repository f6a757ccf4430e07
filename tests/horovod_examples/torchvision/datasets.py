"""MNIST-shaped synthetic digits: each class a fixed random 28x28 pattern plus noise, as uint8 images."""
import numpy as np


class MNIST:
    """``MNIST(root, train, download, transform)`` as torchvision's, offline: 2048 training and 512 test
    images of 10 classes that a small network learns to tell apart."""

    def __init__(self, root, train=True, download=False, transform=None):
        templates = np.random.default_rng(0).uniform(0, 255, size=(10, 28, 28))
        rng = np.random.default_rng(1 if train else 2)
        n = 2048 if train else 512
        self.targets = rng.integers(0, 10, size=n)
        noise = rng.normal(0, 25, size=(n, 28, 28))
        self.data = np.clip(templates[self.targets] + noise, 0, 255).astype(np.uint8)
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        image = self.data[i] if self.transform is None else self.transform(self.data[i])
        return image, int(self.targets[i])
