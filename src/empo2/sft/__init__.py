"""The warm start (``empo2 sft``): supervised fine-tuning on gold demonstrations, so that RL starts from an agent
that acts. :mod:`empo2.sft.demos` plays the gold paths through the rollout code; :mod:`empo2.sft.sft_trainer` is the
loop; :mod:`empo2.rundir.warm_start` is the folder it writes and how ``policy.warm_start`` starts a run from it."""

from empo2.sft.sft_trainer import SFTTrainer

__all__ = ["SFTTrainer"]
