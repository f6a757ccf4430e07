"""The rank side of fit(): the training loop, the step, and the placements of the model.

>>> from sparkring.trainer import TrainConfig, train_rank
"""
from .config import EarlyStopping, Sharding, TrainConfig, is_factory
from .loop import RankResult, non_finite_reason, train_rank

__all__ = ["EarlyStopping", "RankResult", "Sharding", "TrainConfig", "is_factory", "non_finite_reason", "train_rank"]
