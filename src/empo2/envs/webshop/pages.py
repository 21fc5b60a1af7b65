"""WebShop pages in the original's text mode: the visible strings of a page joined by " [SEP] ".

Each renderer returns ``(observation, clickables)``; clickables are lowercased button texts, ASINs and option values
(the strings ``click[...]`` accepts). The search page shows the instruction as the original does; the other pages
omit the original's repeated "Instruction: [SEP] …" header (as GiGPO's WebShop wrapper strips it).
"""

from __future__ import annotations

from empo2.envs.webshop.catalog import Product

SEP = " [SEP] "
BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE, BUY_NOW = "Back to Search", "Next >", "< Prev", "Buy Now"
SUB_PAGES = ("Description", "Features", "Reviews")


def search_page(instruction: str) -> tuple[str, list[str]]:
    return SEP.join(["WebShop", "Instruction:", instruction, "Search"]), []


def results_page(hits: list[Product], page: int, total: int, page_size: int) -> tuple[str, list[str]]:
    """Page ``page`` (1-based) of ``total`` results; ``hits`` are this page's products."""
    parts, clickables = [BACK_TO_SEARCH, f"Page {page} (Total results: {total})"], [BACK_TO_SEARCH.lower()]
    if page > 1:
        parts.append(PREV_PAGE)
        clickables.append(PREV_PAGE.lower())
    if page * page_size < total:
        parts.append(NEXT_PAGE)
        clickables.append(NEXT_PAGE.lower())
    for p in hits:
        parts += [p.asin, p.title, p.price_tag]
        clickables.append(p.asin.lower())
    return SEP.join(parts), clickables


def item_page(p: Product) -> tuple[str, list[str]]:
    parts = [BACK_TO_SEARCH, PREV_PAGE]
    values: list[str] = []
    for name, vals in p.options.items():
        parts += [name, *vals]
        values += vals
    parts += [p.title, f"Price: {p.price_tag}", f"Rating: {p.rating}", *SUB_PAGES, BUY_NOW]
    clickables = [BACK_TO_SEARCH.lower(), PREV_PAGE.lower(), *dict.fromkeys(values),
                  *(s.lower() for s in SUB_PAGES), BUY_NOW.lower()]
    return SEP.join(parts), clickables


def sub_page(p: Product, which: str) -> tuple[str, list[str]]:
    """The Description, Features (bullet points) or Reviews page of ``p``."""
    body = {"description": [p.description], "features": list(p.bullets), "reviews": list(p.reviews)}[which]
    return SEP.join([BACK_TO_SEARCH, PREV_PAGE, *body]), [BACK_TO_SEARCH.lower(), PREV_PAGE.lower()]


def done_page(p: Product, chosen: dict[str, str], reward: float) -> str:
    opts = ", ".join(f"{k}: {v}" for k, v in chosen.items()) or "none"
    return SEP.join(["Thank you for shopping with us!", "Purchased", p.asin, p.title, f"Options: {opts}",
                     "Your score (min 0.0, max 1.0)", f"{reward:.4f}"])
