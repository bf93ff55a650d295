"""The linear datamodeling score (LDS; TRAK, Park et al. 2023, §2.2): `launch.validate`.

An attribution method gives a score tau(z_q)_m for every training example m and query q.
Its datamodel prediction for a training subset S is the sum of the scores of S's examples,

    g(S, q) = sum_{m in S} tau(z_q)_m,

and the LDS of the method is the Spearman rank correlation, over M random subsets S_1..S_M
(each round(alpha * N) of the N examples), between these predictions and the model's actual
behaviour after retraining on S_j, averaged over queries. The behaviour here is the query's
loss (mean NLL of its target tokens). Sign convention (as TRAK's): a proponent's presence
lowers the loss, so predictions are correlated with the NEGATIVE retrained loss; a perfect
method scores +1, a random one ~0.

A query whose retrained losses (or whose predictions) are the same on every subset has no
rank correlation: it is counted and left out of the mean, never reported as NaN.
Retraining is `evaluation.retrain`; outputs are `<eval dir>/lds.json` and `lds.md`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time
from typing import Sequence

import numpy as np
from absl import logging

from trackstar_jax import files
from trackstar_jax import methods as methods_lib
from trackstar_jax.evaluation import claims as claims_lib
from trackstar_jax.evaluation import metrics as metrics_lib
from trackstar_jax.evaluation import query_set
from trackstar_jax.evaluation import report as report_lib
from trackstar_jax.evaluation import retrain as retrain_lib
from trackstar_jax.evaluation import rows as rows_lib
from trackstar_jax.evaluation import settings as settings_lib
from trackstar_jax.index import manifest as manifest_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import step as step_lib

LDS_JSON, LDS_MD = "lds.json", "lds.md"

# ---------------------------------------------------------------------------------------
# The score itself (pure numpy)
# ---------------------------------------------------------------------------------------


def draw_subset(num_examples: int, fraction: float, seed: int, i: int) -> np.ndarray:
    """Subset `i`: exactly round(fraction * N) examples, uniformly without replacement.

    A function of (N, fraction, seed, i) only, so raising M keeps subsets 0..M-1.

    Returns:
      bool `[num_examples]`.
    """
    size = round(fraction * num_examples)
    if not 0 < size < num_examples:
        raise ValueError(f"validate.fraction={fraction} of {num_examples} examples gives an empty or full subset")
    rng = np.random.default_rng([int(seed), int(i)])
    mask = np.zeros(num_examples, bool)
    mask[rng.choice(num_examples, size=size, replace=False)] = True
    return mask


def subset_sums(scores: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Datamodel predictions g(S_j, q) = sum_{m in S_j} scores[q, m].

    Args:
      scores: float `[Q, N]` attribution scores.
      masks: bool `[M, N]` subset membership.

    Returns:
      float64 `[M, Q]`.
    """
    return np.asarray(masks, np.float64) @ np.asarray(scores, np.float64).T


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (scipy's `rankdata(method="average")`)."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ranks = np.empty(len(x), np.float64)
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0  # mean of ranks s+1 .. e
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman rank correlation (Pearson correlation of average ranks); None if either side is constant."""
    rx, ry = rankdata(x), rankdata(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    if den == 0.0:
        return None
    return float(np.clip((rx * ry).sum() / den, -1.0, 1.0))


@dataclasses.dataclass(frozen=True)
class LDS:
    """One method's score: per-query correlations and their mean with a bootstrap interval."""

    per_query: tuple[float | None, ...]  # None where undefined
    mean: float | None
    ci: tuple[float | None, float | None]
    num_queries: int  # queries in the mean
    num_constant_loss: int  # left out: retrained loss equal on every subset
    num_constant_prediction: int  # left out: the method predicts the same sum for every subset

    def to_dict(self) -> dict:
        return {
            "lds": self.mean,
            "lds_ci": list(self.ci),
            "num_queries": self.num_queries,
            "num_constant_loss": self.num_constant_loss,
            "num_constant_prediction": self.num_constant_prediction,
            "per_query": list(self.per_query),
        }


def lds(scores: np.ndarray, masks: np.ndarray, losses: np.ndarray, *, seed: int = 0) -> LDS:
    """Linear datamodeling score of one method.

    Args:
      scores: float `[Q, N]` attribution scores (higher = more helpful to the query).
      masks: bool `[M, N]` retrained subsets.
      losses: float `[M, Q]` each retrained model's loss on each query.
      seed: bootstrap seed.

    Returns:
      `LDS`: per query spearman(g(S_j, q), -loss_j(q)) over j; the mean over queries where
      both sides vary, with a 95% percentile-bootstrap interval.
    """
    scores, masks, losses = np.asarray(scores), np.asarray(masks, bool), np.asarray(losses, np.float64)
    if (
        masks.ndim != 2
        or scores.ndim != 2
        or losses.shape != (masks.shape[0], scores.shape[0])
        or scores.shape[1] != masks.shape[1]
    ):
        raise ValueError(
            f"lds: scores {scores.shape} [Q, N], masks {masks.shape} [M, N] and losses {losses.shape} [M, Q] disagree"
        )
    pred = subset_sums(scores, masks)
    per_query, const_loss, const_pred = [], 0, 0
    for q in range(scores.shape[0]):
        if np.ptp(losses[:, q]) == 0:
            const_loss += 1
            per_query.append(None)
            continue
        r = spearman(pred[:, q], -losses[:, q])
        const_pred += r is None
        per_query.append(r)
    ci = metrics_lib.mean_ci([r for r in per_query if r is not None], seed=seed)
    return LDS(tuple(per_query), ci.mean, (ci.lo, ci.hi), ci.n, const_loss, const_pred)


def lds_by_m(
    scores: np.ndarray, masks: np.ndarray, losses: np.ndarray, counts: Sequence[int], *, seed: int = 0
) -> list[dict]:
    """The LDS from the first m subsets only, for each m in `counts` (how the interval narrows with M).

    Args:
      scores, masks, losses: as `lds`; counts: subset counts, each in [2, M].

    Returns:
      `[{"m", "lds", "lds_ci", "num_queries", "num_constant_loss"}]` in the order of `counts`.

    Raises:
      ValueError: a count outside [2, M].
    """
    out = []
    for m in counts:
        if not 2 <= m <= len(masks):
            raise ValueError(f"subset count {m} must be in [2, M={len(masks)}] (retrain more subsets first)")
        r = lds(scores, masks[:m], losses[:m], seed=seed)
        out.append(
            {
                "m": int(m),
                "lds": r.mean,
                "lds_ci": list(r.ci),
                "num_queries": r.num_queries,
                "num_constant_loss": r.num_constant_loss,
            }
        )
    return out


# ---------------------------------------------------------------------------------------
# Attribution scores of every (query, training example) pair
# ---------------------------------------------------------------------------------------


def method_scores(ctx: rows_lib.Context, method: methods_lib.Method, eq: query_set.EvalQueries) -> np.ndarray:
    """Scores `[Q, N]` of any row, from its kind's retriever (`rows.Retriever.scores`): gold (1 on
    the fact's entailing passages), BM25, dense, gradient (as retrieval scores it, R_eval = the queries)."""
    return rows_lib.make_retriever(method, ctx).scores(eq)


# ---------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------


def _manifest(
    settings: settings_lib.TableSettings, run: checkpoint_lib.Run, eq: query_set.EvalQueries, num_steps: int
) -> dict:
    """What the cached subsets depend on (flat keys; compared field by field on a rerun)."""
    v = settings.validate
    queries = [[q.prompt, q.target] for q in eq.queries]
    out = {
        "corpus_fingerprint": run.corpus.fingerprint,
        "num_examples": len(run.corpus.examples),
        "run_step": run.step,
        "validate.fraction": v.fraction,
        "validate.seed": v.seed,
        "validate.num_steps": num_steps,
        "queries_fingerprint": hashlib.sha256(json.dumps(queries).encode()).hexdigest(),
        "num_queries": len(queries),
    }
    for sec in ("seed", "model", "train"):
        out.update(manifest_lib.flatten({sec: settings.to_dict()[sec]}))
    for k in step_lib.RESUMABLE_TRAIN_KEYS:  # cadences and completions do not change a retrained model
        if k != "num_steps":
            out.pop(f"train.{k}", None)
    return json.loads(json.dumps(out))


def check_manifest(workdir: pathlib.Path, want: dict) -> None:
    """Writes `workdir/validate/manifest.json` once; a later run must match it.

    Raises:
      ConfigError: naming each differing field (remove the folder to start over).
    """
    path = workdir / retrain_lib.VALIDATE_DIR / retrain_lib.MANIFEST_FILE
    if files.create_once(path, json.dumps(want, indent=1, sort_keys=True)):
        return
    saved = files.read_json(path, "LDS manifest", "delete workdir/validate to retrain")
    bad = [
        f"{k}: saved {saved.get(k, '<absent>')!r}, now {want.get(k, '<absent>')!r}"
        for k in sorted(set(saved) | set(want))
        if saved.get(k) != want.get(k)
    ]
    if bad:
        raise files.ConfigError(
            f"{path.parent} holds subsets retrained for another corpus or config: "
            + "; ".join(bad)
            + f" (use another workdir or remove {path.parent})"
        )


def check_settings(settings: settings_lib.TableSettings) -> settings_lib.TableSettings:
    """The settings the LDS runs with (`validate.num_queries` as `eval.max_queries`), refused
    before any work when the candidates are not the training examples.

    Raises:
      config.ConfigError: `candidates.passages` is not "all".
    """
    if settings.candidates.passages != "all":  # subsets are drawn over the training examples
        raise files.ConfigError(
            f"config.candidates.passages={settings.candidates.passages!r}: the LDS retrains on subsets of the "
            "training examples and scores those same examples; use candidates.passages='all'"
        )
    v = settings.validate
    return settings.replace({"eval.max_queries": v.num_queries}) if v.num_queries else settings


def validate_run(
    ctx: rows_lib.Context,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    subset_counts: Sequence[int] = (),
) -> dict:
    """The LDS on a loaded run (`stages.validate` opens it): retrain this process's share of the
    M subsets; once all are done, score every row.

    Args:
      ctx: the settings (from `check_settings`), run directory, loaded run and mesh.
      process_index, process_count: split subsets i with i % count == index across processes.
      subset_counts: also the LDS of each row from its first m subsets, for each m (<= M);
        each row gets `"by_m"` and lds.md a second table.

    Returns:
      `{"trained": [...], "reused": [...], "pending": n}` plus, once every subset is done,
      `"rows"` (the lds.json rows) and `"report"` (the lds.md path).
    """
    t0 = time.perf_counter()
    settings, workdir, run, mesh = ctx.settings, ctx.workdir, ctx.run, ctx.mesh
    pi, pc = process_index or 0, process_count or 1
    if not 0 <= pi < pc:
        raise ValueError(f"--process_index={pi} must be in [0, --process_count={pc})")
    v = settings.validate
    num_steps = v.num_steps or settings.train.num_steps
    eq = query_set.make_eval_queries(run, settings)
    check_manifest(workdir, _manifest(settings, run, eq, num_steps))
    n = len(run.corpus.examples)
    masks = [draw_subset(n, v.fraction, v.seed, i) for i in range(v.num_subsets)]
    mine = list(range(pi, v.num_subsets, pc))
    trained = retrain_lib.run_subsets(
        settings, workdir, mine, [masks[i] for i in mine], run.corpus, run.tokenizer, eq.encoded, num_steps, mesh
    )
    reused = [i for i in mine if i not in trained]
    pending = [i for i in range(v.num_subsets) if not retrain_lib.is_done(workdir, i)]
    out = {"trained": trained, "reused": reused, "pending": len(pending)}
    logging.info(
        "validate: trained %d subsets, reused %d; %d of %d still pending",
        len(trained),
        len(reused),
        len(pending),
        v.num_subsets,
    )
    if pending:
        return out
    losses = np.stack([retrain_lib.read_subset(workdir, i)[1] for i in range(v.num_subsets)])
    counts = sorted(set(subset_counts))
    if counts and not 2 <= counts[0] <= counts[-1] <= v.num_subsets:
        raise ValueError(f"subset counts {counts} must lie in [2, validate.num_subsets={v.num_subsets}]")
    rows, seed = [], settings.eval.bootstrap_seed
    for name in v.methods:
        m = methods_lib.method(name)
        scores = method_scores(ctx, m, eq)
        res = lds(scores, np.stack(masks), losses, seed=seed)
        rows.append({"method": name, "label": m.label, **res.to_dict()})
        if counts:
            rows[-1]["by_m"] = lds_by_m(scores, np.stack(masks), losses, counts, seed=seed)
        logging.info(
            "validate: %s LDS %s (%d queries, %d constant-loss)", name, res.mean, res.num_queries, res.num_constant_loss
        )
    paired_to_reference(rows, seed=seed)
    out_dir = report_lib.eval_dir(settings, workdir)
    write_report(out_dir, rows, v, num_steps, len(eq.queries), seconds=time.perf_counter() - t0)
    out.update(rows=rows, report=str(out_dir / LDS_MD))
    return out


PAIRED_REFERENCE = "trackstar"  # each row's LDS is compared with this row's, query by query


def paired_to_reference(rows: Sequence[dict], reference: str = PAIRED_REFERENCE, *, seed: int = 0) -> None:
    """Adds `vs_<reference>` to every other row: the mean over queries of (row LDS - reference
    LDS) with a paired percentile-bootstrap interval (the same query resamples for both rows,
    `claims.paired_difference`), over the queries where both correlations are defined.

    Rows of one validation share their queries, so per-query noise common to both rows
    cancels; two rows' separate intervals cannot show that. No-op without the reference row.
    """
    ref = next((r for r in rows if r["method"] == reference), None)
    if ref is None:
        return
    for r in rows:
        if r is ref:
            continue
        pairs = [(a, b) for a, b in zip(r["per_query"], ref["per_query"]) if a is not None and b is not None]
        a = np.asarray([p[0] for p in pairs], np.float64)
        b = np.asarray([p[1] for p in pairs], np.float64)
        iv = claims_lib.paired_difference(a, b, seed=seed)
        r[f"vs_{reference}"] = {"diff": iv.mean, "diff_ci": [iv.lo, iv.hi], "n": iv.n}


def markdown(rows: Sequence[dict], v: settings_lib.ValidateSettings, num_steps: int, num_queries: int) -> str:
    """The LDS table: method, LDS [95% CI], M, alpha, queries (scored / left out)."""
    title = (
        f"## Linear datamodeling score (M={v.num_subsets}, alpha={v.fraction}, {num_steps} retraining steps, "
        f"{num_queries} queries)"
    )
    lines = [
        title,
        "",
        "Spearman(sum of the subset's scores, -retrained query loss), mean over queries.",
        "",
        f"| Method | LDS [95% CI] | LDS - {PAIRED_REFERENCE} [95% CI, paired over queries] | M | alpha | queries "
        "| constant loss / prediction |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["lds_ci"]
        val = "n/a" if r["lds"] is None else f"{r['lds']:.3f} [{lo:.3f}, {hi:.3f}]"
        p = r.get(f"vs_{PAIRED_REFERENCE}")
        diff = (
            "–"
            if not p or p["diff"] is None
            else f"{p['diff']:+.3f} [{p['diff_ci'][0]:+.3f}, {p['diff_ci'][1]:+.3f}] (n={p['n']})"
        )
        lines.append(
            f"| {r['label']} | {val} | {diff} | {v.num_subsets} | {v.fraction} | {r['num_queries']} | "
            f"{r['num_constant_loss']} / {r['num_constant_prediction']} |"
        )
    counts = [b["m"] for b in rows[0].get("by_m", [])] if rows else []
    if counts:
        lines += [
            "",
            "LDS [95% CI] from the first m subsets (the interval is a bootstrap over queries):",
            "",
            "| Method | " + " | ".join(f"M={m}" for m in counts) + " |",
            "|---|" + "---|" * len(counts),
        ]
        for r in rows:
            cells = [
                "n/a" if b["lds"] is None else f"{b['lds']:.3f} [{b['lds_ci'][0]:.3f}, {b['lds_ci'][1]:.3f}]"
                for b in r["by_m"]
            ]
            lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: pathlib.Path,
    rows: Sequence[dict],
    v: settings_lib.ValidateSettings,
    num_steps: int,
    num_queries: int,
    seconds: float,
) -> None:
    """`lds.json` (settings + rows with per-query values) and `lds.md`."""
    doc = {
        "num_subsets": v.num_subsets,
        "fraction": v.fraction,
        "seed": v.seed,
        "num_steps": num_steps,
        "num_queries": num_queries,
        "sign": "spearman(predicted sum, -loss)",
        "seconds": seconds,
        "rows": list(rows),
    }
    files.atomic_write_json(out_dir / LDS_JSON, doc)
    files.atomic_write(out_dir / LDS_MD, markdown(rows, v, num_steps, num_queries))
