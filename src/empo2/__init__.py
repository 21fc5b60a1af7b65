"""EMPO²: Exploratory Memory-Augmented On- and Off-Policy Optimization for LLM agents.

The Python API: ``from empo2 import Config, Trainer`` (see :class:`empo2.train.trainer.Trainer`). Both are imported on
first use, so ``import empo2`` (and the command line's start) does not load torch.
"""
from empo2.version import __version__

__all__ = ["Config", "Trainer", "__version__"]


def __getattr__(name: str):
    if name == "Trainer":
        from empo2.train.trainer import Trainer

        return Trainer
    if name == "Config":
        from empo2.config import Config

        return Config
    raise AttributeError(f"module 'empo2' has no attribute {name!r}")
