"""Playing episodes: the rollout loop, reflection, evaluation, the expert and ELPO's tree; shared by ``empo2 train``,
``eval``, ``adapt`` and ``play``."""
