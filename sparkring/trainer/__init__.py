"""The rank side of fit(): the training loop, the step, and the placements of the model.

>>> from sparkring.trainer import TrainConfig, train_rank
"""
from .config import EarlyStopping, Sharding, TrainConfig, is_factory
from .loop import RankResult, train_rank

__all__ = ["EarlyStopping", "RankResult", "Sharding", "TrainConfig", "is_factory", "train_rank"]
