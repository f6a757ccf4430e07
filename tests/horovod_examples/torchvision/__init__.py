"""An offline stand-in for the parts of torchvision Horovod's MNIST example uses (nothing may be
downloaded here): datasets.MNIST gives MNIST-shaped synthetic digits, transforms the two it applies."""
from . import datasets, transforms  # noqa: F401
