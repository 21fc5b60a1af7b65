"""Algorithms: advantage estimators, policy losses, rollout modes, and the registry that names them.

Each method's file registers its own algorithm, estimator and loss; the line below imports them, one name per method,
so that importing any module of this package (which loads this one first) makes every built-in name resolve.
"""

from empo2.algo import elpo, empo2, gigpo, luffy, proxmo, registry  # noqa: F401 - each registers its method
