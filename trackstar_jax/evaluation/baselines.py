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

import dataclasses
from typing import Any, Sequence

import numpy as np
from jaxtyping import Float, Int

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

    def __init__(self, texts: Sequence[str], *, k1: float = LUCENE_K1, b: float = LUCENE_B,
                 method: str = "lucene", stopwords: str | None = "en"):
        if not texts:
            raise ValueError("BM25 needs at least one passage, got an empty corpus")
        self.num_rows = len(texts)
        self._stopwords = stopwords
        self._retriever = _bm25s().BM25(k1=k1, b=b, method=method)
        self._retriever.index(_tokenize(texts, True, stopwords), show_progress=False)

    def scores(self, query: str) -> Float[np.ndarray, "n"]:
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

    def __init__(self, texts: Sequence[str], encoder: embedding_lib.Encoder | None = None, *,
                 embeddings: Float[np.ndarray, "n h"] | None = None):
        if not texts:
            raise ValueError("the dense baseline needs at least one passage, got an empty corpus")
        self.encoder = encoder or embedding_lib.make_encoder()
        self.embeddings = self.encoder.encode(texts) if embeddings is None else np.asarray(embeddings, np.float32)
        if self.embeddings.shape != (len(texts), self.encoder.dim):
            raise ValueError(f"passage embeddings have shape {self.embeddings.shape}, expected {(len(texts), self.encoder.dim)}")
        self.num_rows = len(texts)

    def scores(self, query: str) -> Float[np.ndarray, "n"]:
        """Cosine similarity of `query` with every passage."""
        return self.embeddings @ self.encoder.encode([query])[0]

    def topk(self, queries: Sequence[str], k: int, mesh: Any = None
             ) -> tuple[Float[np.ndarray, "q k"], Int[np.ndarray, "q k"]]:
        """Exact top-k passages per query by cosine: (scores, ids), ties broken by lower id.

        `retrieval.topk` (the project's one exact top-k), rows split over `mesh` if given.
        """
        k = min(int(k), self.num_rows)
        res = retrieval_lib.topk(self.encoder.encode(queries), self.embeddings, k, mesh=mesh)
        return res.top_scores, res.top_ids.astype(np.int32)


def stable_topk(scores: Float[np.ndarray, "n"], k: int) -> Int[np.ndarray, "k"]:
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


# ---------------------------------------------------------------------------------------
# The rows of Table 1 (§5.1-5.2): what each named method is
# ---------------------------------------------------------------------------------------

METHOD_KINDS = ("gold", "bm25", "dense", "gradient")


@dataclasses.dataclass(frozen=True)
class Method:
    """One row of the fact-tracing table.

    Attributes:
      name: key used in `config.eval.methods` and in table.json.
      kind: "gold" (the fact's own evidence passages, tail-patch only), "bm25", "dense"
        (text-embedding cosine, `DenseEmbedding`), or "gradient" (retrieval from a gradient index).
      label: the row label, as in Table 1.
      output_fn, correction: the index's `vectors` settings (optimizer second-moment
        correction = the "Optim." column).
      hessian: the `hessian.mode` ("none" / "train" = R_train / "mixed" = TrackStar's R).
      unit_norm: the "Unit norm" column.
    """

    name: str
    kind: str
    label: str
    output_fn: str = "loss"
    correction: bool = False
    hessian: str = "none"
    unit_norm: bool = False

    def overrides(self) -> dict[str, Any]:
        """Config overrides (dotted keys) that select this row's index and scoring."""
        if self.kind != "gradient":
            return {}
        return {"vectors.output_fn": self.output_fn, "vectors.correction": self.correction,
                "hessian.mode": self.hessian, "hessian.unit_norm": self.unit_norm}


# Table 1 of the paper. Exp. 1 is the gradient dot product (TracIn-style, Pruthi et al. 2020)
# and Exp. 2 the gradient cosine (Han et al. 2022/2023); TRAK as the paper ran it: margin
# output function with TRAK's example-level Q on candidates, R_train, no optimizer
# correction, no unit norm (§4.4, §A.1.1). "dense" is the Gecko row with an offline model
# (all-MiniLM-L6-v2, `embedding.py`); it needs the model package (`embedding.is_available()`).
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("trex_gold", "gold", "T-REx gold"),
    Method("bm25", "bm25", "BM25"),
    Method("dense", "dense", "MiniLM-L6 embeddings (Gecko stand-in)", unit_norm=True),
    Method("trak", "gradient", "TRAK", output_fn="trak", correction=False, hessian="train", unit_norm=False),
    Method("exp1", "gradient", "Exp. 1 (grad dot)", correction=False, hessian="none", unit_norm=False),
    Method("exp2", "gradient", "Exp. 2 (grad cosine)", correction=False, hessian="none", unit_norm=True),
    Method("exp3", "gradient", "Exp. 3", correction=False, hessian="train", unit_norm=True),
    Method("exp4", "gradient", "Exp. 4", correction=True, hessian="none", unit_norm=True),
    Method("exp5", "gradient", "Exp. 5", correction=True, hessian="train", unit_norm=True),
    Method("trackstar", "gradient", "TrackStar", correction=True, hessian="mixed", unit_norm=True),
)}
TABLE1_ORDER = tuple(METHODS)


def method(name: str) -> Method:
    """`METHODS[name]`, or a ValueError listing the known rows."""
    if name not in METHODS:
        raise ValueError(f"unknown evaluation method {name!r} in config.eval.methods (known: {', '.join(METHODS)})")
    return METHODS[name]
