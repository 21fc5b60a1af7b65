"""WebShop (text shopping) re-implemented on the ``TextEnv`` protocol: catalog, BM25 search, pages, goals, reward.

The official small set is read from a directory the user names (``env.webshop.data`` or ``$EMPO2_WEBSHOP_DATA``);
otherwise a bundled fixture catalog is used and the environment is named ``webshop-fixture``.
"""

from empo2.envs.webshop.catalog import OFFICIAL_FILES, Catalog, Product, load_catalog
from empo2.envs.webshop.env import WebShopEnv, parse_action
from empo2.envs.webshop.goals import Goal
from empo2.envs.webshop.reward import get_reward

__all__ = ["WebShopEnv", "Catalog", "Product", "Goal", "load_catalog", "get_reward", "parse_action", "OFFICIAL_FILES"]
