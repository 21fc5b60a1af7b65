"""Build the WebShop *fixture* catalog (``fixture/``): a small, synthetic, deterministic catalog in the official schema.

It is NOT WebShop data. It exists so tests and the offline demo run without the official download, and it is always
reported as ``webshop-fixture``. Regenerate with ``python -m empo2.envs.webshop.make_fixture`` (output is byte-stable).

Files (same schema as the official small set):

- ``items_shuffle.json``: list of products (``asin``, ``name``, ``full_description``, ``small_description``,
  ``pricing`` (``"$x"``, ``"$x - $y"`` or ``""``), ``customization_options``, ``category``, ``query``,
  ``product_category``, ``images``);
- ``items_ins_v2.json``: ``{asin: {"attributes": [...], "instruction"?: str, "instruction_attributes"?: [...]}}``;
- ``items_human_ins.json``: ``{asin: [{"asin", "instruction", "instruction_attributes", "instruction_options"}]}``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

FIXTURE_DIR = Path(__file__).parent / "fixture"
PRODUCTS_FILE, ATTRIBUTES_FILE, HUMAN_FILE = "items_shuffle.json", "items_ins_v2.json", "items_human_ins.json"

# One entry per category: query, Amazon-style category path, product noun, attribute pool, option groups, brands.
CATEGORIES = [
    dict(category="beauty", query="body lotion", noun="Body Lotion",
         path="Beauty & Personal Care › Skin Care › Body › Lotions",
         attrs=["paraben free", "dry skin", "natural ingredients", "long lasting", "fragrance free", "sensitive skin"],
         options={"Scent": ["Lavender", "Coconut", "Unscented"], "Size": ["8 Fl Oz", "16 Fl Oz (Pack of 2)"]},
         brands=["Aveeno", "Cerave", "Nivea", "Eucerin", "Lubriderm", "Jergens", "Vaseline", "Curel", "Gold Bond",
                 "Palmers", "Burts Bees"], price=(6, 30)),
    dict(category="fashion", query="men's running shoes", noun="Running Shoes",
         path="Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
         attrs=["rubber sole", "lace up", "non slip", "breathable mesh", "arch support", "lightweight"],
         options={"Color": ["Black/White", "Navy Blue", "Grey"], "Size": ["8", "9", "10.5"]},
         brands=["Asics", "Brooks", "Saucony", "Hoka", "Mizuno", "Skechers", "Reebok", "Puma", "Altra", "Salomon",
                 "Merrell"], price=(45, 160)),
    dict(category="electronics", query="wireless headphones", noun="Headphones",
         path="Electronics › Headphones, Earbuds & Accessories › Headphones › Over-Ear",
         attrs=["noise cancelling", "bluetooth 5.0", "long battery life", "hands free", "easy carry", "high fidelity"],
         options={"Color": ["Black", "Silver", "Rose Gold"]},
         brands=["Sony", "Bose", "Jabra", "Anker", "Sennheiser", "Philips", "Jbl", "Akg", "Skullcandy", "Beyerdynamic",
                 "Audio Technica"], price=(25, 350)),
    dict(category="grocery", query="gluten free snacks", noun="Tortilla Chips",
         path="Grocery & Gourmet Food › Snacks & Sweets › Chips & Crisps › Tortilla",
         attrs=["gluten free", "non gmo", "low sugar", "keto friendly", "individually wrapped", "plant based"],
         options={"Flavor Name": ["Sea Salt", "Chili Lime", "Sour Cream & Onion"], "Size": ["6 Count", "12 Count"]},
         brands=["Siete", "Late July", "Tostitos", "Garden Of Eatin", "Xochitl", "Mission", "Santitas", "Boulder",
                 "Kettle", "Food Should Taste Good", "Calidad"], price=(3, 40)),
    dict(category="garden", query="storage ottoman", noun="Storage Ottoman",
         path="Home & Kitchen › Furniture › Living Room Furniture › Ottomans",
         attrs=["easy assemble", "faux leather", "living room", "solid wood", "storage space", "high density foam"],
         options={"Color": ["Brown", "Beige", "Dark Grey"]},
         brands=["Songmics", "Homepop", "Seville", "Christopher Knight", "Zinus", "Ikea", "Amazon Basics", "Sorbus",
                 "Homcom", "Yaheetech", "Costway"], price=(20, 240)),
    dict(category="fashion", query="women's summer dress", noun="Sundress",
         path="Clothing, Shoes & Jewelry › Women › Clothing › Dresses › Casual",
         attrs=["machine wash", "short sleeve", "polyester spandex", "button closure", "relaxed fit", "v neck"],
         options={"Color": ["Floral Blue", "White", "Red"], "Size": ["Small", "Medium", "Large", "X-Large"]},
         brands=["Prettygarden", "Zesica", "Grecerelle", "Blencot", "Angashion", "Dokotoo", "Btfbm", "Merokeety",
                 "Exlura", "Anrabess", "Kirundo"], price=(15, 60)),
]

ADJECTIVES = ["Classic", "Premium", "Everyday", "Ultra", "Advanced", "Original", "Deluxe", "Essential", "Pro", "Daily",
              "Signature"]


def _price_text(rng: random.Random, lo: int, hi: int, i: int) -> str:
    """Every 4th product has a price range, one in eleven has no price (the loader then uses $100), else one price."""
    if i % 11 == 10:
        return ""
    a = round(rng.uniform(lo, hi), 2)
    if i % 4 == 1:
        return f"${a:.2f} - ${a + round(rng.uniform(2, 15), 2):.2f}"
    return f"${a:.2f}"


def build() -> tuple[list[dict], dict, dict]:
    """Return ``(products, attributes, human_instructions)``; deterministic."""
    rng = random.Random(20240611)
    products, attributes, human = [], {}, {}
    for c_idx, cat in enumerate(CATEGORIES):
        for i, brand in enumerate(cat["brands"]):
            asin = f"B0FX{c_idx:02d}{i:04d}"
            attrs = rng.sample(cat["attrs"], 3)
            title = f"{brand} {ADJECTIVES[i]} {cat['noun']}, {attrs[0].title()}"
            groups = {} if i % 5 == 4 else {k: list(v) for k, v in cat["options"].items()}
            options = {k: [{"value": v, "image": None} for v in vs] for k, vs in groups.items()}
            bullets = [f"{a.capitalize()}: designed for {cat['query']} shoppers." for a in attrs[1:]]
            bullets.append(f"Made by {brand}; ships in a recyclable box.")
            products.append(dict(
                asin=asin, name=title,
                full_description=f"The {brand} {cat['noun'].lower()} is a {ADJECTIVES[i].lower()} pick. "
                                 f"It is {attrs[0]} and {attrs[1]}.",
                small_description=bullets,
                pricing=_price_text(rng, *cat["price"], i),
                customization_options=options or None,
                category=cat["category"], query=cat["query"], product_category=cat["path"],
                images=[f"https://example.invalid/fixture/{asin}.jpg"],
            ))
            if i % 6 == 5:          # no entry at all: the loader uses the placeholder attribute
                continue
            entry: dict = {"attributes": attrs}
            if i % 3 != 2:          # two in three products carry an instruction (synthetic goals)
                ins_attrs = sorted(rng.sample(attrs, 2))
                entry["instruction"] = f"Find me {cat['query']} with {', '.join(ins_attrs)}"
                entry["instruction_attributes"] = ins_attrs
            attributes[asin] = entry
            if i % 3 == 0:          # a third also get a human-style instruction
                opts = [rng.choice(vs).lower() for vs in groups.values()]
                ins = f"i'm looking for a {attrs[0]} {cat['noun'].lower()}"
                if opts:
                    ins += " in " + " and ".join(opts)
                human[asin] = [dict(asin=asin, instruction=ins, instruction_attributes=[attrs[0]],
                                    instruction_options=opts)]
    return products, attributes, human


def main() -> None:
    products, attributes, human = build()
    FIXTURE_DIR.mkdir(exist_ok=True)
    for name, data in ((PRODUCTS_FILE, products), (ATTRIBUTES_FILE, attributes), (HUMAN_FILE, human)):
        (FIXTURE_DIR / name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(products)} products, {len(attributes)} attribute entries, {len(human)} human instructions "
          f"to {FIXTURE_DIR}")


if __name__ == "__main__":
    main()
