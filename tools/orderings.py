"""Why an ordering of a fact-tracing table holds or fails: evidence from a finished evaluation.

Reads an evaluation's files (`<workdir>/eval/retrievals/<row>.jsonl`, `queries.jsonl`, the run's
corpus) and prints one JSON object with:

- **factor contrasts**: Table 1's rows differ by one setting at a time (§5.2), so the paired
  difference of two rows that differ by one setting measures that setting (optimizer correction:
  Exp. 4 − Exp. 2 and Exp. 5 − Exp. 3; R_train: Exp. 3 − Exp. 2 and Exp. 5 − Exp. 4; the mixed R:
  TrackStar − Exp. 5; unit norm: Exp. 2 − Exp. 1), on MRR, recall@10 and tail-patch@10, with the
  evaluation's own paired bootstrap (`evaluation.claims.paired_difference`);
- **what each row retrieves**: over every query's top 10, the share of proponents that name the
  query's answer (any alias of the object, whole words: `evaluation.queries.MentionIndex`), that
  name its subject, that entail the fact; their mean length in words; how many distinct passages
  fill the row's top-10 lists and the share of slots its 10 most retrieved passages hold
  (hubs);
- **where a vector's weight lies**: per gradient index, the mean share of the stored vectors'
  squared norm in each block-side (attention / MLP of each group of layers);
- **what a tail-patched proponent's effect goes with**: over every distinct tail-patched
  (query, proponent) pair, the mean Δp of pairs whose proponent names the answer and of those
  that do not; and per row, over its tail-patched pairs, the share naming the answer and the
  mean Δp of each part.

With `--scores` (loads the run; minutes on a 2-core machine) it also rescores every query
against every candidate for the gradient rows named by `--score_rows` plus ablations that are not
Table 1 rows (TRAK with unit norm, TRAK without R, Exp. 1 with R_train), through the rows'
own retrievers (`evaluation.rows.Retriever.scores`), and reports per row
- MRR and recall@10 (the ablations' only figures);
- the mean over tail-patched queries of the Spearman correlation, over the query's tail-patched
  proponents (the union of the rows' top 10), between the row's score and the measured Δp: how
  well the row's score ranks by influence within the same pool;
- MRR when each query ranks its entailing passages among 300 / 1,000 / 3,000 random others and
  among all (`mrr_by_distractors`; the last key is the whole set; no top-10 cut): how each
  row's MRR falls as the closed set grows (the paper's TRAK: 0.401 with 300 distractors, 0.001
  with 19.6M);
- hubs, as above, from the full ranking;
and the one-sided product (`ONE_SIDED`: the uncorrected query against the unit-norm corrected
candidate) as a row of its own, and the block-side shares of the queries' own vectors,
uncorrected and corrected.

Mixed rows rescored here take R_eval from the queries (as LDS does), not from the task prompts
of the evaluation, so they are reported under their own name (`<row>@queries`).

With `--v_samples=0:64,1:64,2:256` (an imported run; minutes) it re-estimates V from other
samples of the corpus and reports how well the Adafactor factors agree with the first's.

    python tools/orderings.py runs/smollm2_table1 [--scores [--cache=F.npz]] [--v_samples=...]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import stats

from trackstar_jax.data import answers
from trackstar_jax.data import corpus as corpus_lib
from trackstar_jax.evaluation import claims, metrics
from trackstar_jax.evaluation import queries as queries_lib

# (name, row with the setting, row without it): each pair differs by exactly one setting (Table 1).
CONTRASTS = (
    ("optimizer correction (Exp. 4 − Exp. 2)", "exp4", "exp2"),
    ("optimizer correction (Exp. 5 − Exp. 3)", "exp5", "exp3"),
    ("R_train (Exp. 3 − Exp. 2)", "exp3", "exp2"),
    ("R_train (Exp. 5 − Exp. 4)", "exp5", "exp4"),
    ("mixed R (TrackStar − Exp. 5)", "trackstar", "exp5"),
    ("unit norm (Exp. 2 − Exp. 1)", "exp2", "exp1"),
)
METRICS = ("mrr", "recall_at_10", "tailpatch_at_10")
K = 10


@dataclasses.dataclass
class Evaluation:
    """A finished evaluation's files: per row, per query id, its record (retrieval file line)."""

    rows: dict[str, dict[str, dict]]
    queries: dict[str, dict]  # query id -> queries.jsonl line
    texts: list[str]

    @classmethod
    def read(cls, workdir: pathlib.Path, rows: Sequence[str] = ()) -> Evaluation:
        ev = workdir / "eval"
        names = list(rows) or sorted(p.stem for p in (ev / "retrievals").glob("*.jsonl"))
        out = {}
        for name in names:
            with (ev / "retrievals" / f"{name}.jsonl").open(encoding="utf-8") as f:
                out[name] = {str(r["example_id"]): r for r in map(json.loads, f) if r}
        with (ev / "queries.jsonl").open(encoding="utf-8") as f:
            qs = {str(q["query_id"]): q for q in map(json.loads, f) if q}
        texts = corpus_lib.load_corpus(workdir / "corpus").texts
        return cls(out, qs, list(texts))


def query_records(e: Evaluation, row: str) -> list[dict]:
    """Per query the row's metrics, as the table computes them (`metrics.query_metrics`,
    `metrics.tailpatch_at_k`), for `claims.paired_values`."""
    recs = []
    for qid, r in e.rows[row].items():
        gold = e.queries[qid]["entailing_ids"]
        rec = {"query_id": qid, "has_evidence": bool(gold)}
        if gold:
            rec.update(metrics.query_metrics(r["proponent_ids"][:K], gold))
        tp = r.get("proponent_tailpatch") or []
        if tp[:K] and all(v is not None for v in tp[:K]):
            rec.update(metrics.tailpatch_at_k(tp[:K], (K,)))
        recs.append(rec)
    return recs


def contrasts(e: Evaluation) -> list[dict]:
    """The one-setting contrasts of `CONTRASTS` whose two rows the evaluation has."""
    out = []
    for name, with_, without in CONTRASTS:
        if with_ not in e.rows or without not in e.rows:
            continue
        a, b = query_records(e, with_), query_records(e, without)
        for m in METRICS:
            xa, xb = claims.paired_values(a, b, m)
            if not xa.size:
                continue
            d = claims.paired_difference(xa, xb)
            out.append(
                {
                    "contrast": name,
                    "metric": m,
                    "with": float(xa.mean()),
                    "without": float(xb.mean()),
                    "difference": d.mean,
                    "ci": [d.lo, d.hi],
                    "n": d.n,
                }
            )
    return out


class Mentions:
    """Which passages name a query's answer / subject (whole words, any alias)."""

    def __init__(self, texts: Sequence[str]):
        self.index = queries_lib.MentionIndex(texts)
        self.num_words = np.asarray([len(answers.words(t)) for t in texts])

    def answer(self, q: Mapping[str, Any]) -> frozenset[int]:
        return self.index.passages_with_any([q["object"], *q.get("aliases", ())])

    def subject(self, q: Mapping[str, Any]) -> frozenset[int]:
        return self.index.passages_with_any([q["subject"], *q.get("subject_aliases", ())])


def composition(e: Evaluation, men: Mentions) -> dict[str, dict]:
    """Per row: what its top-10 lists hold (see the module docstring)."""
    out = {}
    for row, recs in e.rows.items():
        ans = subj = gold = n = 0
        lengths, counts = [], collections.Counter()
        for qid, r in recs.items():
            q = e.queries[qid]
            ids = [int(p) for p in r["proponent_ids"][:K]]
            a, s, g = men.answer(q), men.subject(q), set(q["entailing_ids"])
            ans += sum(p in a for p in ids)
            subj += sum(p in s for p in ids)
            gold += sum(p in g for p in ids)
            n += len(ids)
            lengths.extend(men.num_words[ids].tolist())
            counts.update(ids)
        top = sum(c for _, c in counts.most_common(10))
        out[row] = {
            "names_answer": ans / max(n, 1),
            "names_subject": subj / max(n, 1),
            "entails": gold / max(n, 1),
            "mean_words": float(np.mean(lengths)) if lengths else None,
            "distinct_passages": len(counts),
            "top10_passages_share": top / max(n, 1),
        }
    return out


def tailpatch_split(e: Evaluation, men: Mentions) -> dict:
    """Δp of distinct tail-patched pairs by whether the proponent names the answer; per row, its
    tail-patch@10 (the table's: a mean over queries) and, over its tail-patched (query, proponent)
    pairs, the share that name the answer and the mean Δp of each part."""
    pairs: dict[tuple[str, int], float] = {}
    for recs in e.rows.values():
        for qid, r in recs.items():
            for p, d in zip(r["proponent_ids"][:K], (r.get("proponent_tailpatch") or [])[:K]):
                if d is not None:
                    pairs[(qid, int(p))] = float(d)
    named = {qid: men.answer(q) for qid, q in e.queries.items()}
    yes = [d for (qid, p), d in pairs.items() if p in named[qid]]
    no = [d for (qid, p), d in pairs.items() if p not in named[qid]]
    per_row = {}
    for row, recs in e.rows.items():
        a, b, per_query = [], [], []
        for qid, r in recs.items():
            tp = (r.get("proponent_tailpatch") or [])[:K]
            if not tp or any(v is None for v in tp):
                continue  # not tail-patched (a row's top-k has fewer than k only for gold)
            per_query.append(float(np.mean(tp)))
            for p, d in zip(r["proponent_ids"][:K], tp):
                (a if int(p) in named[qid] else b).append(float(d))
        if per_query:
            per_row[row] = {  # the share and the two means are over pairs
                "tailpatch_at_10": float(np.mean(per_query)),
                "share_naming_answer": len(a) / len(a + b),
                "mean_naming_answer": float(np.mean(a)) if a else None,
                "mean_not_naming": float(np.mean(b)) if b else None,
            }

    def summary(v):
        ci = metrics.mean_ci(v)
        return {"mean": ci.mean, "ci": [ci.lo, ci.hi], "n": ci.n, "share_positive": float(np.mean(np.asarray(v) > 0))}

    return {"names_answer": summary(yes), "does_not": summary(no), "per_row": per_row}


# Settings that are not Table 1 rows, for the rescoring (`--scores`): each changes one setting of a row.
ABLATIONS = (
    ("trak_unit_norm", "TRAK with unit norm", dict(output_fn="trak", hessian="train", unit_norm=True)),
    ("trak_no_r", "TRAK without R", dict(output_fn="trak", hessian="none", unit_norm=False)),
    ("exp1_r_train", "Exp. 1 with R_train", dict(hessian="train", unit_norm=False)),
)
# The first-order effect of tail-patching z_m on the query's log p is ∇q · U(z_m), U the
# optimizer's update; Adafactor's U is ∇m / √V (then clipped), so one factor 1/√V, on the
# proponent side. Table 1's corrected rows apply 1/√V on both sides (∇qᵀ V⁻¹ ∇m). This score,
# the uncorrected query against the unit-norm corrected proponent, is that one-sided product.
ONE_SIDED = "one_sided_correction"
QUERY_VECTORS = "query_vectors:"  # cache keys of the raw query vectors (not score matrices)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (ties share their mean rank); NaN for < 3 points or a constant."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(stats.spearmanr(x, y).statistic)


def mrr_with_distractors(
    scores: np.ndarray, gold: Sequence[Sequence[int]], counts: Sequence[int], draws: int = 5, seed: int = 0
) -> dict[int, float]:
    """MRR when each query ranks only its entailing passages plus `count` random other passages
    (the small closed sets of earlier work: 300 distractors per query), mean over `draws` draws;
    a count of at least N − 1 is the whole candidate set.

    scores: `[Q, N]`; gold: per query its entailing ids (queries without any are left out).
    """
    n = scores.shape[1]
    rng = np.random.default_rng(seed)
    out = {}
    for count in counts:
        rr = []
        for i, g in enumerate(gold):
            if not g:
                continue
            is_gold = np.zeros(n, bool)
            is_gold[list(g)] = True
            others = np.flatnonzero(~is_gold)
            best = scores[i, is_gold].max()
            for _ in range(draws if count < others.size else 1):
                pick = others if count >= others.size else rng.choice(others, count, replace=False)
                rr.append(1.0 / (1 + int((scores[i, pick] > best).sum())))
        out[int(count)] = float(np.mean(rr))
    return out


def rescore(
    workdir: pathlib.Path,
    e: Evaluation,
    rows: Sequence[str],
    sizes: Sequence[int],
    draws: int = 5,
    cache: pathlib.Path | None = None,
) -> dict:
    """Every query against every candidate for `rows`, the ablations and the one-sided product
    (see the module docstring). Loads the run (the evaluation's own settings, `table.json`);
    with `cache`, the score matrices are kept in that .npz and reused."""
    from trackstar_jax.index import store

    if cache is not None and cache.exists():
        with np.load(cache) as z:
            full = {k: z[k] for k in z.files}
    else:
        full = score_matrices(workdir, e, rows)
        if cache is not None:
            np.savez(cache, **full)
    sides = store.open_index(workdir / "index").num_blocks_total
    return summarize_scores(e, full, sizes, draws, sides)


def score_matrices(workdir: pathlib.Path, e: Evaluation, rows: Sequence[str]) -> dict[str, np.ndarray]:
    """`{row: [Q, N] scores}`, queries in query-id order (see `rescore`)."""
    from trackstar_jax import config as config_lib
    from trackstar_jax import methods as methods_lib
    from trackstar_jax.evaluation import rows as rows_lib
    from trackstar_jax.features import vectors as vectors_lib
    from trackstar_jax.retrieval import stage as retrieval_stage
    from trackstar_jax.stages import run as run_lib

    settings = config_lib.load_table_settings(workdir / "eval" / "table.json")
    loaded = run_lib.open_run(settings, workdir)
    ctx = rows_lib.Context(settings, workdir, loaded.run, loaded.mesh)
    qids = sorted(e.queries, key=int)
    qs = rows_lib.TypedQueries.encode(
        ctx.run,
        [retrieval_stage.TextQuery(int(q), e.queries[q]["prompt"], e.queries[q]["target"]) for q in qids],
    )
    methods = [methods_lib.method(r) for r in rows]
    methods += [methods_lib.Method(n, "gradient", label, **kw) for n, label, kw in ABLATIONS]
    full: dict[str, np.ndarray] = {}
    for m in methods:
        name = f"{m.name}@queries" if m.hessian == "mixed" else m.name  # R_eval from the queries here
        full[name] = rows_lib.make_retriever(m, ctx).scores(qs)

    # the one-sided product: uncorrected query vectors (Exp. 2's featurizer) against unit-norm rows
    # of the corrected index (Exp. 4's), both projected with the same matrices
    s_q = rows_lib.method_settings(settings, methods_lib.method("exp2"))
    s_m = rows_lib.method_settings(settings, methods_lib.method("exp4"))
    vec_fn = vectors_lib.make_vector_fn(
        ctx.run.graphdef, ctx.run.model_cfg, s_q.vectors, ctx.run.params, ctx.run.opt_state, mesh=ctx.mesh, role="query"
    )
    q_raw = retrieval_stage.query_vectors(ctx.run, vec_fn, qs.encoded)
    reader = retrieval_stage.open_checked_index(ctx.run, s_m, workdir)
    cand = np.array(reader.read_dequantized(0, reader.num_rows), np.float32)  # a copy: the reader's is read-only
    cand /= np.maximum(np.linalg.norm(cand, axis=1, keepdims=True), 1e-30)
    full[ONE_SIDED] = q_raw.astype(np.float32) @ cand.T
    # the queries' own vectors, uncorrected and corrected (where their weight lies: `block_shares`)
    full[QUERY_VECTORS + "loss_nocorr"] = q_raw.astype(np.float32)
    vec_fn = vectors_lib.make_vector_fn(
        ctx.run.graphdef, ctx.run.model_cfg, s_m.vectors, ctx.run.params, ctx.run.opt_state, mesh=ctx.mesh, role="query"
    )
    full[QUERY_VECTORS + "loss_corr"] = retrieval_stage.query_vectors(ctx.run, vec_fn, qs.encoded).astype(np.float32)
    return full


def block_shares(vectors: np.ndarray, sides: int) -> list[float]:
    """Mean over rows of the share of each row's squared norm in each of `sides` equal blocks."""
    e = np.square(np.asarray(vectors, np.float64).reshape(len(vectors), sides, -1)).sum(-1)
    return (e / np.maximum(e.sum(1, keepdims=True), 1e-300)).mean(0).round(3).tolist()


def summarize_scores(
    e: Evaluation, full: Mapping[str, np.ndarray], sizes: Sequence[int], draws: int, sides: int
) -> dict:
    """Per score matrix: MRR, recall@10, Spearman with the measured Δp, MRR by candidate count,
    hubs; per kept query-vector matrix, its `block_shares` over `sides` block-sides."""
    qids = sorted(e.queries, key=int)
    gold = [list(e.queries[q]["entailing_ids"]) for q in qids]
    tp = tailpatched_pairs(e)
    out = {}
    for name, sc in full.items():
        if name.startswith(QUERY_VECTORS):
            out[name] = {"mean_share_per_side": block_shares(sc, sides)}
            continue
        rr, r10, rho, hubs = [], [], [], collections.Counter()
        for i, q in enumerate(qids):
            order = np.argsort(-sc[i], kind="stable")[:K]
            hubs.update(order.tolist())
            if gold[i]:
                qm = metrics.query_metrics(order.tolist(), gold[i])
                rr.append(qm["mrr"])
                r10.append(qm["recall_at_10"])
            pool = tp.get(q)
            if pool:
                ids = np.asarray(list(pool), np.int64)
                rho.append(spearman(sc[i, ids], np.asarray([pool[p] for p in ids.tolist()])))
        mrr_ci, rho_ci = metrics.mean_ci(rr), metrics.mean_ci(rho)
        out[name] = {
            "mrr": mrr_ci.mean,
            "mrr_ci": [mrr_ci.lo, mrr_ci.hi],
            "recall_at_10": float(np.mean(r10)) if r10 else None,
            "spearman_with_tailpatch": rho_ci.mean,
            "spearman_ci": [rho_ci.lo, rho_ci.hi],
            "spearman_n": rho_ci.n,
            "mrr_by_distractors": mrr_with_distractors(sc, gold, sizes, draws),
            "distinct_passages": len(hubs),
            "top10_passages_share": sum(c for _, c in hubs.most_common(10)) / (K * len(qids)),
        }
    return out


def v_stability(workdir: pathlib.Path, seeds: Sequence[int], sizes: Sequence[int]) -> dict:
    """How much an import's estimated V depends on its sample: V re-estimated from other seeded
    samples of the run's corpus (`training.second_moment`, as the import does), and per factored
    kernel the correlation over its rows / columns of log Adafactor factors (the mean of V along
    each axis, what `features.preconditioner` divides by) against the first sample's; medians and
    minima over kernels."""
    from trackstar_jax import config as config_lib
    from trackstar_jax.models import layers as layers_lib
    from trackstar_jax.stages import run as run_lib
    from trackstar_jax.training import second_moment as sm_lib

    settings = config_lib.load_table_settings(workdir / "eval" / "table.json")
    run = run_lib.open_run(settings, workdir).run
    min_dim = settings.train.optimizer.min_dim_size_to_factor

    def estimate(seed: int, size: int) -> dict[str, np.ndarray]:
        ids = sm_lib.sample_ids(len(run.corpus.examples), size, seed)
        batches = sm_lib.example_batches(run.corpus, run.tokenizer, ids, 8, run.model_cfg.max_len)
        mean_sq, _ = sm_lib.mean_squared_grads(run.graphdef, run.params, batches)
        return {k: np.asarray(v, np.float64) for k, v in layers_lib.flat_params(mean_sq).items()}

    def log_factors(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.log(v.mean(1) + sm_lib.EPSILON), np.log(v.mean(0) + sm_lib.EPSILON)

    ref = estimate(seeds[0], sizes[0])
    out = {}
    for seed, size in zip(seeds[1:], sizes[1:]):
        other = estimate(seed, size)
        corr = []
        for k, v in ref.items():
            if v.ndim == 2 and min(v.shape) >= min_dim:
                a, b = log_factors(v), log_factors(other[k])
                corr.append([float(np.corrcoef(a[i], b[i])[0, 1]) for i in (0, 1)])
        c = np.asarray(corr)
        out[f"seed {seed}, {size} examples"] = {
            "kernels": len(corr),
            "median_corr_rows_cols": np.median(c, 0).round(3).tolist(),
            "min_corr_rows_cols": c.min(0).round(3).tolist(),
        }
    return {"reference": f"seed {seeds[0]}, {sizes[0]} examples", "against": out}


def tailpatched_pairs(e: Evaluation) -> dict[str, dict[int, float]]:
    """Per query id, every tail-patched proponent (any row) and its measured Δp."""
    out: dict[str, dict[int, float]] = collections.defaultdict(dict)
    for recs in e.rows.values():
        for qid, r in recs.items():
            for p, d in zip(r["proponent_ids"], r.get("proponent_tailpatch") or []):
                if d is not None:
                    out[qid][int(p)] = float(d)
    return dict(out)


def block_energy(workdir: pathlib.Path) -> dict[str, dict]:
    """Per gradient index of the run (`index*` folders): the mean share of a stored vector's
    squared norm in each block-side (`[2 * num_blocks]`: attention / MLP of each group of
    layers, in `features.projection` order), and the spread of the vectors' norms."""
    from trackstar_jax.index import store

    out = {}
    for manifest in sorted(workdir.glob("index*/manifest.json")):
        reader = store.open_index(manifest.parent)
        x = np.asarray(reader.read_dequantized(0, reader.num_rows))
        norms = np.linalg.norm(x.astype(np.float64), axis=1)
        out[manifest.parent.name] = {
            "mean_share_per_side": block_shares(x, reader.num_blocks_total),
            "norm_p99_over_median": float(np.quantile(norms, 0.99) / np.median(norms)),
        }
    return out


def report(
    workdir: pathlib.Path,
    rows: Sequence[str] = (),
    *,
    scores: bool = False,
    cache: pathlib.Path | None = None,
    score_rows: Sequence[str] = ("trak", "exp1", "exp2", "exp3", "exp4", "exp5", "trackstar"),
    sizes: Sequence[int] = (300, 1000, 3000, 10**9),
    v_samples: Sequence[tuple[int, int]] = (),
) -> dict:
    e = Evaluation.read(workdir, rows)
    men = Mentions(e.texts)
    out = {
        "workdir": str(workdir),
        "num_queries": len(e.queries),
        "contrasts": contrasts(e),
        "composition": composition(e, men),
        "tailpatch_by_answer": tailpatch_split(e, men),
        "block_energy": block_energy(workdir),
    }
    if scores:
        out["rescored"] = rescore(workdir, e, score_rows, sizes, cache=cache)
    if v_samples:
        seeds, counts = zip(*v_samples)
        out["v_stability"] = v_stability(workdir, seeds, counts)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", type=pathlib.Path)
    ap.add_argument("--rows", default="", help="comma-separated rows (default: every retrieval file)")
    ap.add_argument("--scores", action="store_true", help="also rescore every pair (loads the run)")
    ap.add_argument("--cache", type=pathlib.Path, default=None, help="keep / reuse the score matrices (.npz)")
    ap.add_argument("--score_rows", default="trak,exp1,exp2,exp3,exp4,exp5,trackstar")
    ap.add_argument("--distractors", default="300,1000,3000", help="distractors per query of the MRR curve")
    ap.add_argument(
        "--v_samples",
        default="",
        help="seed:examples,... re-estimate V (an import) from these samples, the first the reference "
        "(e.g. 0:64,1:64,2:256 with the import's own 0:64 first)",
    )
    args = ap.parse_args(argv)
    out = report(
        args.workdir,
        [r for r in args.rows.split(",") if r],
        scores=args.scores,
        cache=args.cache,
        score_rows=[r for r in args.score_rows.split(",") if r],
        sizes=[*(int(x) for x in args.distractors.split(",") if x), 10**9],
        v_samples=[tuple(int(y) for y in x.split(":")) for x in args.v_samples.split(",") if x],
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
