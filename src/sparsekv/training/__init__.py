"""Spotlight hash training: capture post-RoPE q/k from a frozen model, ranking loss, trainer, CLI.

from sparsekv.training import TrainConfig, train_hash
"""

from sparsekv.training.trainer import TrainConfig, train_hash

__all__ = ["TrainConfig", "train_hash"]
