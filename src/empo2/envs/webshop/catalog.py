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
import sys
import warnings
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

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
        raise EnvError(f"WebShop data directory not found: {data_dir} (set env.webshop.data or ${DATA_ENV_VAR})")
    paths = {}
    for name, digest in OFFICIAL_FILES.items():
        path = data_dir / name
        if not path.is_file():
            if name == "items_human_ins.json" and not need_human:
                continue
            raise EnvError(
                f"WebShop data file missing: {path}. It comes from the WebShop project's \"small\" download "
                f"(princeton-nlp/WebShop, setup.sh -d small); put {name} in {data_dir}, or leave env.webshop.data "
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
    raw_products = check_products(read_json(files[0]), files[0])
    attributes = check_attributes(read_json(files[1]), files[1])
    human = check_human(read_json(files[2]), files[2]) if human_goals or files[2].is_file() else {}
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


# ------------------------------------------------------------------------------------------------ the files' shapes
# What the loader reads of each file, checked before it is used: a file of another shape (a list where WebShop has an
# object, a number where it has a string) is one EnvError naming the file and the entry, not a traceback deep inside.
_TEXT_FIELDS = ("asin", "name", "full_description", "category", "query", "product_category", "pricing")


def read_json(path: Path) -> Any:
    """The JSON value of a WebShop data file; one :class:`EnvError` naming the file when it is unreadable, not JSON,
    or nested deeper than the parser takes (WebShop's files nest a few levels)."""
    try:
        return json.loads(path.read_bytes())
    except RecursionError:
        raise EnvError(f"WebShop data file {path} nests its JSON deeper than {sys.getrecursionlimit()} levels; "
                       "WebShop's files nest a few levels: restore the file") from None
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EnvError(f"cannot read WebShop data file {path}: {exc}") from None


def check_products(value: Any, path: Path) -> list[dict]:
    """``items_shuffle*.json``: a list of product objects whose text fields are strings (or null)."""
    _expect(value, list, path, "the file")
    for i, product in enumerate(value):
        _expect(product, dict, path, f"product {i}")
        for name in _TEXT_FIELDS:
            _expect(product.get(name), (str, type(None)), path, f"product {i}'s {name!r}")
        bullets = product.get("small_description")
        _expect(bullets, (str, list, type(None)), path, f"product {i}'s 'small_description'")
        for bullet in bullets if isinstance(bullets, list) else ():
            _expect(bullet, (str, int, float), path, f"an entry of product {i}'s 'small_description'")
        options = product.get("customization_options")
        _expect(options, (dict, type(None)), path, f"product {i}'s 'customization_options'")
        for name, contents in (options or {}).items():
            _expect(contents, (list, type(None)), path, f"product {i}'s option {name!r}")
            for choice in contents or ():
                _expect(choice, dict, path, f"a value of product {i}'s option {name!r}")
                _expect(choice.get("value"), str, path, f"a 'value' of product {i}'s option {name!r}")
    return value


def check_attributes(value: Any, path: Path) -> dict[str, dict]:
    """``items_ins_v2*.json``: an object of asin → object with lists of strings and a string instruction."""
    _expect(value, dict, path, "the file")
    for asin, entry in value.items():
        _expect(entry, dict, path, f"entry {asin!r}")
        for name in ("attributes", "instruction_attributes"):
            _expect_strings(entry.get(name), path, f"entry {asin!r}'s {name!r}")
        _expect(entry.get("instruction"), (str, type(None)), path, f"entry {asin!r}'s 'instruction'")
    return value


def check_human(value: Any, path: Path) -> dict[str, list[dict]]:
    """``items_human_ins.json``: an object of asin → list of instruction objects."""
    _expect(value, dict, path, "the file")
    for asin, entries in value.items():
        _expect(entries, list, path, f"entry {asin!r}")
        for ins in entries:
            _expect(ins, dict, path, f"an instruction of {asin!r}")
            _expect(ins.get("instruction"), (str, type(None)), path, f"an instruction of {asin!r}: 'instruction'")
            _expect_strings(ins.get("instruction_attributes"), path, f"an instruction of {asin!r}: 'instruction_attributes'")
            options = ins.get("instruction_options")
            _expect(options, (list, type(None)), path, f"an instruction of {asin!r}: 'instruction_options'")
            for option in options or ():  # shown as text (``str(option)``)
                _expect(option, (str, int, float), path, f"an option of an instruction of {asin!r}")
    return value


def _expect(value: Any, kinds, path: Path, what: str) -> None:
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in _tuple(kinds):
        wanted = " or ".join(dict.fromkeys(_JSON_NAMES[k] for k in _tuple(kinds)))
        raise EnvError(f"WebShop data file {path}: {what[:120]} is {_JSON_NAMES.get(type(value), 'a value')}, where "
                       f"WebShop's data has {wanted}; restore the file")


def _expect_strings(value: Any, path: Path, what: str) -> None:
    _expect(value, (list, type(None)), path, what)
    for item in value or ():
        _expect(item, str, path, f"an entry of {what}")


def _tuple(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "true or false", type(None): "null"}
