"""Load a WebShop product catalog: the official "small" set (verified by sha256) or the bundled fixture.

Product processing follows the original ``web_agent_site.engine.engine.load_products``: title/description/bullet
points, a price tag from ``pricing`` (one price, a range, or a missing price → $100), lowercased options with
"/" → " | ", and attributes from ``items_ins_v2`` (``DUMMY_ATTR`` when absent). Unlike the original, the purchase
price of a ranged product is drawn with a seeded RNG, so a seed fixes every price.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from empo2.envs.base import EnvError

OFFICIAL_FILES = {
    "items_shuffle_1000.json": "30a4765c3a327af72d9a9a95a6b2486d516f0fa1d3ecd83681901ce82a21b269",
    "items_ins_v2_1000.json": "f88a36314a397b53b3d9c3fa5878e5f7b26d35019a51ec83fbedeca61a948f6f",
    "items_human_ins.json": "cf78667548a71786e1d9049c24b802e48e1084ad4bb021cae56ce1f6d96954a3",
}
"""The official small set: file name → sha256 (from ``shared/data/webshop/SOURCE.md``)."""
FIXTURE_DIR = Path(__file__).parent / "fixture"
FIXTURE_FILES = ("items_shuffle.json", "items_ins_v2.json", "items_human_ins.json")
DATA_ENV_VAR = "EMPO2_WEBSHOP_DATA"
PLACEHOLDER_ATTR = "DUMMY_ATTR"


@dataclass
class Product:
    """One processed product (the fields the pages, search and reward use)."""

    asin: str
    title: str
    description: str
    bullets: list[str]
    price_tag: str
    """What the pages show: ``$12.99`` or ``$10.0 to $20.0``."""
    pricing: list[float]
    price: float
    """The purchase price (a seeded draw inside a range)."""
    options: dict[str, list[str]]
    attributes: list[str]
    category: str
    query: str
    product_category: str
    rating: str = "N.A."
    reviews: list[str] = field(default_factory=list)
    instruction: str | None = None
    instruction_attributes: list[str] | None = None
    human_instructions: list[dict] = field(default_factory=list)


@dataclass
class Catalog:
    products: list[Product]
    by_asin: dict[str, Product]
    source: str
    """``official`` or ``fixture``."""
    data_dir: Path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """``data_dir`` if given, else ``$EMPO2_WEBSHOP_DATA``, else ``None`` (= the fixture)."""
    chosen = data_dir if data_dir not in (None, "") else os.environ.get(DATA_ENV_VAR) or None
    return Path(chosen).expanduser() if chosen else None


def official_paths(data_dir: Path, need_human: bool) -> dict[str, Path]:
    """Check the official files exist (clear :class:`EnvError` if not) and their hashes (warning on mismatch)."""
    if not data_dir.is_dir():
        raise EnvError(f"WebShop data directory not found: {data_dir} (set env.webshop_data or ${DATA_ENV_VAR})")
    paths = {}
    for name, digest in OFFICIAL_FILES.items():
        path = data_dir / name
        if not path.is_file():
            if name == "items_human_ins.json" and not need_human:
                continue
            raise EnvError(
                f"WebShop data file missing: {path}. It comes from the WebShop project's \"small\" download "
                f"(princeton-nlp/WebShop, setup.sh -d small); put {name} in {data_dir}, or leave env.webshop_data "
                f"and ${DATA_ENV_VAR} unset to use the bundled fixture catalog.")
        actual = sha256_of(path)
        if actual != digest:
            warnings.warn(f"{path}: sha256 {actual} does not match the official {digest}; results may not be "
                          f"comparable with published WebShop numbers", stacklevel=2)
        paths[name] = path
    return paths


def parse_pricing(pricing: str | None) -> tuple[list[float], str]:
    """``"$12.99"`` → ``([12.99], "$12.99")``; ``"$10 - $20"`` → ``([10.0, 20.0], "$10.0 to $20.0")``; empty → $100."""
    if not pricing:
        return [100.0], "$100.0"
    values = [float(Decimal(re.sub(r"[^\d.]", "", p))) for p in pricing.split("$")[1:] if re.sub(r"[^\d.]", "", p)]
    if not values:
        return [100.0], "$100.0"
    if len(values) == 1:
        return values, f"${values[0]}"
    return values[:2], f"${values[0]} to ${values[1]}"


def parse_options(customization: dict | None) -> dict[str, list[str]]:
    """Option names and values lowercased, "/" in values → " | " (as the original)."""
    options: dict[str, list[str]] = {}
    for name, contents in (customization or {}).items():
        if contents is None:
            continue
        options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
    return options


def load_catalog(data_dir: str | os.PathLike | None = None, seed: int = 0, num_products: int | None = None,
                 human_goals: bool = False) -> Catalog:
    """Load the official small set from ``data_dir`` (or ``$EMPO2_WEBSHOP_DATA``), else the bundled fixture."""
    root = resolve_data_dir(data_dir)
    if root is None:
        files = [FIXTURE_DIR / n for n in FIXTURE_FILES]
        source, root = "fixture", FIXTURE_DIR
        if not files[2].is_file() and human_goals:
            raise EnvError(f"fixture human instructions missing: {files[2]}")
    else:
        official_paths(root, need_human=human_goals)
        files = [root / n for n in OFFICIAL_FILES]
        source = "official"
    try:
        raw_products = json.loads(files[0].read_text())
        attributes = json.loads(files[1].read_text())
        human = json.loads(files[2].read_text()) if human_goals or files[2].is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise EnvError(f"cannot read WebShop catalog in {root}: {exc}") from None
    if num_products is not None:
        raw_products = raw_products[:num_products]

    rng = random.Random(seed)
    products, seen = [], set()
    for p in raw_products:
        asin = p.get("asin")
        if not asin or asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        pricing, tag = parse_pricing(p.get("pricing"))
        price = pricing[0] if len(pricing) == 1 else rng.uniform(*pricing[:2])
        bullets = p.get("small_description")
        bullets = bullets if isinstance(bullets, list) else [bullets or ""]
        ins = attributes.get(asin, {})
        products.append(Product(
            asin=asin, title=p.get("name") or "", description=p.get("full_description") or "",
            bullets=[str(b) for b in bullets] or [""], price_tag=tag, pricing=pricing, price=price,
            options=parse_options(p.get("customization_options")),
            attributes=list(ins["attributes"]) if "attributes" in ins else [PLACEHOLDER_ATTR],
            category=p.get("category") or "", query=(p.get("query") or "").lower().strip(),
            product_category=p.get("product_category") or "",
            instruction=ins.get("instruction"), instruction_attributes=ins.get("instruction_attributes"),
            human_instructions=list(human.get(asin, [])),
        ))
    return Catalog(products=products, by_asin={p.asin: p for p in products}, source=source, data_dir=root)
