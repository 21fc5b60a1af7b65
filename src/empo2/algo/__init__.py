"""Algorithms: advantage estimators, policy losses, rollout modes, and the registry that names them.

Importing any module of this package loads :mod:`empo2.algo.registry`, which registers the built-in algorithms and
estimators (GiGPO's included), so a name in a config resolves however the package was first imported.
"""

from empo2.algo import registry  # noqa: F401 - registers the built-ins
