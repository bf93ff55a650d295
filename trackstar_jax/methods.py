"""The rows of the fact-tracing table (Table 1, §5.1-5.2): each a named preset of settings.

A gradient row is a choice of output function, optimizer correction, Hessian mode and unit
norm; `Method.overrides` turns it into config overrides (and the index folder it reads).
This is configuration, not code that runs a row: `config.py` resolves `eval.row` with it,
and `evaluation.rows` builds one retriever per row from the row's registered kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Method:
    """One row of the fact-tracing table.

    Attributes:
      name: key used in `config.eval.methods` and in table.json.
      kind: a registered row kind (`evaluation.rows.ROW_KINDS`; its retriever serves the row):
        "gold" (the fact's own evidence passages, tail-patch only), "bm25", "dense"
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
    mix_lambda: float | None = None  # a fixed λ for the mixed R (None: config.hessian.mix_lambda)
    rerank_k: int = 0  # two-stage retrieval: rescore the index's top rerank_k exactly (`retrieval.rerank`)

    def overrides(self, index_dir: str = "index") -> dict[str, Any]:
        """Config overrides (dotted keys) that select this row's index and scoring.

        Rows that share (output_fn, correction) share an index: the Hessian and the unit norm
        apply at scoring time. TrackStar's setting (loss, corrected) uses `index_dir` (the
        index `launch.build_index` builds by default); every other setting gets
        `<index_dir>_<output_fn>_<corr|nocorr>`, whichever row asks for it.
        """
        if self.kind != "gradient":
            return {}
        out = {
            "vectors.output_fn": self.output_fn,
            "vectors.correction": self.correction,
            "hessian.mode": self.hessian,
            "hessian.unit_norm": self.unit_norm,
        }
        if self.mix_lambda is not None:
            out["hessian.mix_lambda"] = self.mix_lambda
        if self.rerank_k:
            out["retrieval.rerank_k"] = self.rerank_k
        if (self.output_fn, self.correction) != ("loss", True):
            out["index.dir"] = f"{index_dir}_{self.output_fn}_{'corr' if self.correction else 'nocorr'}"
        return out


# Table 1 of the paper. Exp. 1 is the gradient dot product (TracIn-style, Pruthi et al. 2020)
# and Exp. 2 the gradient cosine (Han et al. 2022/2023); TRAK as the paper ran it: margin
# output function with TRAK's example-level Q on candidates, R_train, no optimizer
# correction, no unit norm (§4.4, §A.1.1). "dense" is the Gecko row with an offline model
# (all-MiniLM-L6-v2, `embedding.py`); it needs the model package (`embedding.is_available()`).
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
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
        # The paper's fixed λ = 0.90 for T-REx (§A.1.3), beside the automatic λ of "trackstar", and
        # the other values the paper tried ({0.50, 0.90, 0.99, 0.999}): the λ sweep.
        *(
            Method(
                f"trackstar_l{round(lam * 100):03d}",
                "gradient",
                f"TrackStar (λ = {lam:.2f})",
                correction=True,
                hessian="mixed",
                unit_norm=True,
                mix_lambda=lam,
            )
            for lam in (0.5, 0.9, 0.99)
        ),
        # Beyond the paper (issue 39): TrackStar's top 100, reranked by the exact unprojected
        # corrected-gradient cosine (no R: `retrieval.rerank`); shares TrackStar's index.
        Method(
            "trackstar_rerank",
            "gradient",
            "TrackStar + exact rerank of top 100",
            correction=True,
            hessian="mixed",
            unit_norm=True,
            rerank_k=100,
        ),
    )
}
TABLE1_ORDER = tuple(METHODS)


def method(name: str) -> Method:
    """`METHODS[name]`, or a ValueError listing the known rows."""
    if name not in METHODS:
        raise ValueError(f"unknown evaluation method {name!r} in config.eval.methods (known: {', '.join(METHODS)})")
    return METHODS[name]
