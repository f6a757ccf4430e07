"""Models, data and transforms for the model-input tests (importable by Spark's workers)."""
import io

import numpy as np
import torch


def ratings_df(spark, users=60, items=40, rows=1200, seed=0, partitions=2):
    """Planted factors: rating = <u, v> + 0.5 * age; ids as int/long columns, dense doubles."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(users, 3))
    v = rng.normal(size=(items, 3))
    user = rng.integers(0, users, size=rows)
    item = rng.integers(0, items, size=rows)
    age = rng.normal(size=rows)
    income = rng.normal(size=rows)
    rating = (u[user] * v[item]).sum(1) + 0.5 * age
    clicked = (rating > 0).astype(float)
    data = [(int(user[i]), int(item[i]), float(age[i]), float(income[i]), float(rating[i]), float(clicked[i]))
            for i in range(rows)]
    return spark.createDataFrame(data, "user int, item long, age double, income double, rating double, "
                                       "clicked double").repartition(partitions)


class MatrixFactorization(torch.nn.Module):
    """forward(user, item, dense): checks what it gets, as a recommender would rely on."""

    def __init__(self, users=60, items=40, dim=8, sparse=False, heads=1):
        super().__init__()
        torch.manual_seed(0)
        self.user = torch.nn.Embedding(users, dim, sparse=sparse)
        self.item = torch.nn.Embedding(items, dim, sparse=sparse)
        self.dense = torch.nn.Linear(2, 1)
        self.heads = heads
        self.click = torch.nn.Linear(1, 1)

    def forward(self, user, item, dense):
        assert user.dtype == torch.int64 and user.dim() == 1, (user.dtype, user.shape)
        assert item.dtype == torch.int64 and item.dim() == 1, (item.dtype, item.shape)
        assert dense.dtype == torch.float32 and dense.shape[1:] == (2,), (dense.dtype, dense.shape)
        score = (self.user(user) * self.item(item)).sum(1, keepdim=True) + self.dense(dense)
        if self.heads == 1:
            return score
        if self.heads == 3:  # a model that returns fewer heads than labels
            return (score,)
        return score, self.click(score)


class KeywordTower(torch.nn.Module):
    """forward(*, ids, extra): keyword inputs from the dict form of modelInputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(60, 4)
        self.out = torch.nn.Linear(5, 1)

    def forward(self, *, ids, extra):
        return self.out(torch.cat([self.emb(ids), extra], dim=1))


class TinyConv(torch.nn.Module):
    """Expects (n, 1, 4, 4) images."""

    def __init__(self, classes=2):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 16, classes)

    def forward(self, x):
        assert x.shape[1:] == (1, 4, 4), x.shape
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class GridNet(torch.nn.Module):
    """Expects (n, 4, 4) from a nested array column."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 2)

    def forward(self, x):
        assert x.shape[1:] == (4, 4) and x.dtype == torch.float32, (x.shape, x.dtype)
        return self.fc(x.flatten(1))


def images_df(spark, rows=400, seed=0):
    """4x4 images: class 1 is bright in the top half. Flat floats, nested arrays and PNG bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=rows)
    pixels = rng.uniform(0, 0.5, size=(rows, 4, 4))
    pixels[labels == 1, :2, :] += 0.5
    data = []
    for i in range(rows):
        png = io.BytesIO()
        Image.fromarray((pixels[i] * 255).astype(np.uint8), mode="L").save(png, format="PNG")
        data.append((i, pixels[i].reshape(-1).tolist(), pixels[i].tolist(), png.getvalue(), float(labels[i])))
    return spark.createDataFrame(data, "id long, flat array<double>, grid array<array<double>>, png binary, "
                                       "label double").repartition(2)


def decode_png(batch):
    """transformFn: PNG bytes -> float pixels in [0, 1], shape (n, 16)."""
    from PIL import Image

    images = [np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32) / 255.0 for b in batch["png"]]
    return {"png": np.stack(images).reshape(len(images), -1)}


def decode_png_with_pid(batch):
    """decode_png, plus the decoding process's id per row."""
    import os

    out = decode_png(batch)
    out["pid"] = np.full(len(batch["png"]), os.getpid(), dtype=np.int64)
    return out


def broken_transform(batch):
    raise RuntimeError("cannot decode this image")


def not_a_dict_transform(batch):
    return [batch["png"]]


def decode_png_inverted(batch):
    """A different inference-time transform: inverted pixels."""
    out = decode_png(batch)
    return {"png": 1.0 - out["png"]}
