"""ToTensor, Normalize and Compose as torchvision's, for HxW uint8 arrays."""
import torch


class Compose:
    def __init__(self, steps):
        self.steps = steps

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    def __call__(self, image):
        return torch.from_numpy(image).float().div(255).unsqueeze(0)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std
