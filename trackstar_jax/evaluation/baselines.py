"""Model-agnostic retrieval baselines for the fact-tracing table (§4.4, Table 1).

BM25 (Robertson & Zaragoza, 2009) in the "Lucene accurate" form the paper uses, through
`bm25s` (`method="lucene"`): for query terms t and passage d,

    score(q, d) = sum_t idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl)),
    idf(t) = log(1 + (N - df(t) + 0.5) / (df(t) + 0.5)),

with Lucene's defaults k1 = 1.2, b = 0.75, lowercased word tokens of >= 2 characters and the
Lucene English stopword list. The query text is the prompt followed by the target
("Allan Peiper was born in Alexandra"), as the authors' released retrievals query with
`inputs_plaintext + targets_plaintext`. Ranking is exact over every passage, with the same
tie rule as gradient retrieval (higher score first, then lower example id).

The dense-embedding row stands in for the paper's Gecko (a Cloud embedding API): cosine
similarity of all-MiniLM-L6-v2 sentence embeddings (`embedding.py`), the same query text,
and exact top-k over every passage through `retrieval.topk` (same tie rule).

The other rows of Table 1 (TRAK, gradient dot product / cosine, Experiments 1-5, TrackStar)
are gradient methods: settings of the vector / Hessian / normalisation stages. `METHODS`
names every row and its settings; `experiments/method_*.py` hold one config per row.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from jaxtyping import Float, Int

from trackstar_jax import methods as methods_lib
from trackstar_jax.evaluation import embedding as embedding_lib
from trackstar_jax.retrieval import topk as retrieval_lib

LUCENE_K1 = 1.2
LUCENE_B = 0.75


def _bm25s():
    """bm25s, imported on first use: its import runs a JAX computation (starts the backends)."""
    import bm25s  # noqa: PLC0415

    return bm25s


def _tokenize(texts: Sequence[str], return_ids: bool, stopwords: str | None):
    return _bm25s().tokenize(list(texts), lower=True, stopwords=stopwords, return_ids=return_ids, show_progress=False)


class BM25:
    """A BM25 index over a fixed passage list (row i = example id i).

    Args:
      texts: passages in example-id order.
      k1, b: BM25 parameters (Lucene defaults).
      method: bm25s variant ("lucene" = the paper's "Lucene accurate").
      stopwords: bm25s stopword list name ("en" = Lucene's English list) or None.

    Raises:
      ValueError: empty corpus.
    """

    def __init__(
        self,
        texts: Sequence[str],
        *,
        k1: float = LUCENE_K1,
        b: float = LUCENE_B,
        method: str = "lucene",
        stopwords: str | None = "en",
    ):
        if not texts:
            raise ValueError("BM25 needs at least one passage, got an empty corpus")
        self.num_rows = len(texts)
        self._stopwords = stopwords
        self._retriever = _bm25s().BM25(k1=k1, b=b, method=method)
        self._retriever.index(_tokenize(texts, True, stopwords), show_progress=False)

    def scores(self, query: str) -> Float[np.ndarray, " n"]:
        """BM25 score of `query` against every passage (0 where no query term occurs)."""
        terms = _tokenize([query], False, self._stopwords)[0]
        terms = [t for t in terms if t in self._retriever.vocab_dict]
        if not terms:
            return np.zeros((self.num_rows,), np.float32)
        return np.asarray(self._retriever.get_scores(terms), np.float32)

    def topk(self, queries: Sequence[str], k: int) -> tuple[Float[np.ndarray, "q k"], Int[np.ndarray, "q k"]]:
        """Exact top-k passages per query: (scores, ids), ties broken by lower id."""
        k = min(int(k), self.num_rows)
        top_s = np.zeros((len(queries), k), np.float32)
        top_i = np.zeros((len(queries), k), np.int32)
        for j, q in enumerate(queries):
            s = self.scores(q)
            top_i[j] = stable_topk(s, k)
            top_s[j] = s[top_i[j]]
        return top_s, top_i


class DenseEmbedding:
    """Cosine retrieval over unit-norm passage embeddings (Table 1's Gecko row, stand-in model).

    Args:
      texts: passages in example-id order.
      encoder: an `embedding.Encoder` (default: `embedding.make_encoder()`, all-MiniLM-L6-v2).
      embeddings: precomputed `[n, h]` passage embeddings (e.g. a cache); `texts` are then
        only counted.

    Raises:
      ValueError: empty corpus, or `embeddings` whose row count differs from `texts`.
      embedding.MissingModelError: no encoder given and the model package is not installed.
    """

    def __init__(
        self,
        texts: Sequence[str],
        encoder: embedding_lib.Encoder | None = None,
        *,
        embeddings: Float[np.ndarray, "n h"] | None = None,
    ):
        if not texts:
            raise ValueError("the dense baseline needs at least one passage, got an empty corpus")
        self.encoder = encoder or embedding_lib.make_encoder()
        self.embeddings = self.encoder.encode(texts) if embeddings is None else np.asarray(embeddings, np.float32)
        if self.embeddings.shape != (len(texts), self.encoder.dim):
            raise ValueError(
                f"passage embeddings have shape {self.embeddings.shape}, expected {(len(texts), self.encoder.dim)}"
            )
        self.num_rows = len(texts)

    def scores(self, query: str) -> Float[np.ndarray, " n"]:
        """Cosine similarity of `query` with every passage."""
        return self.embeddings @ self.encoder.encode([query])[0]

    def topk(
        self, queries: Sequence[str], k: int, mesh: Any = None
    ) -> tuple[Float[np.ndarray, "q k"], Int[np.ndarray, "q k"]]:
        """Exact top-k passages per query by cosine: (scores, ids), ties broken by lower id.

        `retrieval.topk` (the project's one exact top-k), rows split over `mesh` if given.
        """
        k = min(int(k), self.num_rows)
        res = retrieval_lib.topk(self.encoder.encode(queries), self.embeddings, k, mesh=mesh)
        return res.top_scores, res.top_ids.astype(np.int32)


def stable_topk(scores: Float[np.ndarray, " n"], k: int) -> Int[np.ndarray, " k"]:
    """Indices of the k largest scores, ordered by (score desc, index asc)."""
    n = scores.shape[0]
    k = min(k, n)
    if k == n:
        cand = np.arange(n)
    else:
        kth = np.partition(scores, n - k)[n - k]  # the k-th largest value
        cand = np.nonzero(scores >= kth)[0]  # every row tied with it stays a candidate
    order = np.lexsort((cand, -scores[cand]))
    return cand[order[:k]].astype(np.int32)


# The rows of Table 1 are configuration (named vector / Hessian settings): trackstar_jax/methods.py.
Method, METHODS, TABLE1_ORDER, method = (
    methods_lib.Method,
    methods_lib.METHODS,
    methods_lib.TABLE1_ORDER,
    methods_lib.method,
)
