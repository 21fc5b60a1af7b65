"""BM25 product search (bm25s), standing in for the original's pyserini/Lucene index.

One document per product: lowercase ``title + description + first bullet + option text`` (the original's
``convert_product_file_format.py``). BM25 with Lucene's formula, k1 = 0.9 and b = 0.4 (pyserini's defaults).
Analysis approximates Lucene's English analyzer: word tokens, possessive "'s" dropped, Lucene's 33 English stop
words, and an S-stemmer (plural folding) instead of Porter stemming. Returns up to the top 50 hits with a positive
score, ties broken by catalog order (Lucene: by doc id).
"""

from __future__ import annotations

import re

import numpy as np

from empo2.envs.webshop.catalog import Product

TOP_N = 50
PAGE_SIZE = 10
LUCENE_STOPWORDS = frozenset(
    ["a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was", "will", "with"])
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def s_stem(word: str) -> str:
    """Lucene's EnglishMinimalStemmer: fold plurals (``ies``→``y``, ``es``→``e``, ``s``→``)."""
    if len(word) < 3 or word[-1] != "s" or word[-2] in "us":
        return word
    if word[-2] == "e":
        if len(word) > 3 and word[-3] == "i" and word[-4] not in "ae":
            return word[:-3] + "y"
        if word[-3] in "iaoe":
            return word
    return word[:-1]


def analyze(text: str) -> list[str]:
    """Lowercase, tokenize, drop possessives and stop words, fold plurals."""
    out = []
    for tok in _TOKEN.findall(text.lower()):
        tok = tok[:-2] if tok.endswith("'s") else tok.replace("'", "")
        if tok and tok not in LUCENE_STOPWORDS:
            out.append(s_stem(tok))
    return out


def document_text(p: Product) -> str:
    """The indexed text of a product (as the original's Lucene documents)."""
    option_text = ", and ".join(f"{name}: {', and '.join(values)}" for name, values in p.options.items())
    return " ".join([p.title, p.description, p.bullets[0] if p.bullets else "", option_text]).lower()


class SearchEngine:
    """``search(query)`` → ASINs of the top hits, best first."""

    def __init__(self, products: list[Product], k1: float = 0.9, b: float = 0.4, top_n: int = TOP_N):
        self.asins = [p.asin for p in products]
        self.top_n = top_n
        # Imported here, not with the module: every config imports its environments' modules, and bm25s brings in
        # numba where it is installed, whose wrapped C functions break vLLM's scan of the loaded modules.
        import bm25s

        self.bm25 = bm25s.BM25(k1=k1, b=b, method="lucene")
        self.bm25.index([analyze(document_text(p)) or ["__empty__"] for p in products], show_progress=False)
        self.vocab = set(self.bm25.vocab_dict)

    def search(self, query: str) -> list[str]:
        tokens = [t for t in analyze(query) if t in self.vocab]
        if not tokens:
            return []
        scores = np.asarray(self.bm25.get_scores(tokens))
        order = np.argsort(-scores, kind="stable")[: self.top_n]
        return [self.asins[i] for i in order if scores[i] > 0]
