"""TRAK's example-level Q = 1 - p̄ per candidate, applied to the *scores* after R (§4.4 footnote).

TRAK (Park et al. 2023) converts its margin-function influence into an effect on the loss by
multiplying each candidate's score by `Q_m = 1 - p̄_m`, `p̄_m` the model's mean probability of the
candidate's tokens (§A.1.1). The factor is applied after R: scores are `Q_m · φ_mᵀ R⁻¹ φ_q`
with `R = Σ_m φ_m φ_mᵀ` over the stored margin gradients. Folding Q into the stored vectors
instead would make R = Σ Q_m² φ_m φ_mᵀ (another method). The index of a "trak" row holds
plain margin gradients (`features/grads.py`); its build caches Q beside it from the featurize
pass's own forward (`save_q`; the fast path), and otherwise (a resumed or split build, the
reference path) `candidate_q` computes it with one forward pass over the candidates; retrieval
multiplies the per-row scale by it (`scoring.Scoring.row_scale`).
"""

from __future__ import annotations

import functools
import hashlib
import io
import pathlib

import jax
import numpy as np
from absl import logging

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.features import grads as grads_lib
from trackstar_jax.index import store as store_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import logs

Q_FILE = "trak_q.npy"  # in <index>/scoring/, keyed by the index's manifest fingerprint


@functools.partial(jax.jit, static_argnums=0)
def _mean_prob_step(graphdef, params, tokens, loss_mask):
    inputs, targets, weights = model_lib.lm_targets({"tokens": tokens, "loss_mask": loss_mask})
    return grads_lib.mean_target_prob(model_lib.apply(graphdef, params, inputs), targets, weights)


def mean_probs(run: checkpoint_lib.Run, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """p̄ of each passage under the run's model (mean p over its target tokens), `[len(texts)]` float32.

    Passages are encoded as the index encodes them (`data.encode_passages`, pretraining loss mask).
    """
    out = np.zeros(len(texts), np.float32)
    max_len = run.model_cfg.max_len
    # one forward per candidate: minutes for a 135M model over a few thousand passages
    for lo in logs.progress(
        range(0, len(texts), batch_size), total=-(-len(texts) // batch_size), desc="TRAK Q = 1 - p̄", unit="batch"
    ):
        hi = min(lo + batch_size, len(texts))
        items, _ = data_lib.encode_passages(run.tokenizer, texts[lo:hi], max_len)
        seq_len = data_lib.bucket_len(max(len(t) for t, _ in items), max_len)
        batch = data_lib.pad_batch(items, list(range(lo, hi)), batch_size, seq_len)
        p = _mean_prob_step(run.graphdef, run.params, batch["tokens"], batch["loss_mask"])
        out[lo:hi] = np.asarray(p)[: hi - lo]
    return out


def q_file(path: pathlib.Path, manifest: dict) -> pathlib.Path:
    """Where Q of the index at `path` is cached, keyed by its manifest (model weights, corpus)."""
    key = hashlib.sha256(store_lib.manifest_fingerprint(manifest).encode()).hexdigest()[:32]
    return pathlib.Path(path) / "scoring" / f"{key}-{Q_FILE}"


def save_q(path: pathlib.Path, manifest: dict, q: np.ndarray) -> None:
    """Caches `Q [num_rows]` of the index at `path` (with its sha256; process 0 only)."""
    f = q_file(path, manifest)
    if jax.process_index() == 0:
        data = files.npy_bytes(np.asarray(q, np.float32))
        files.atomic_write(f.with_suffix(".sha256"), files.sha256_bytes(data))
        files.atomic_write(f, data)
    logging.info(
        "trak: Q = 1 - p̄ over %d candidates: min %.3f, median %.3f, max %.3f", len(q), q.min(), np.median(q), q.max()
    )


def candidate_q(run: checkpoint_lib.Run, reader: store_lib.IndexReader, batch_size: int = 32) -> np.ndarray:
    """`Q_m = 1 - p̄_m` for every row of `reader` (the run's candidates), `[num_rows]` float32.

    Cached as `<index>/scoring/<fingerprint>-trak_q.npy` (with a sha256 beside it), keyed by the
    index's manifest (model weights, corpus): a changed model or candidate set recomputes it.

    Raises:
      ValueError: the index rows are not the run's candidates (row counts differ).
    """
    texts = run.corpus.texts
    if len(texts) != reader.num_rows:
        raise ValueError(f"index {reader.path} has {reader.num_rows} rows but the run has {len(texts)} candidates")
    f = q_file(reader.path, reader.manifest)
    sums = f.with_suffix(".sha256")
    if f.exists() and sums.exists():
        data = f.read_bytes()
        if files.sha256_bytes(data) == sums.read_text().strip():
            q = np.load(io.BytesIO(data), allow_pickle=False)
            if q.shape == (reader.num_rows,):
                return q
        logging.warning("trak: cached Q at %s is damaged; recomputing it", f)
    q = (1.0 - mean_probs(run, texts, batch_size)).astype(np.float32)
    save_q(reader.path, reader.manifest, q)
    return q


def row_factor(run: checkpoint_lib.Run, output_fn: str, reader: store_lib.IndexReader, batch_size: int = 32):
    """The per-row score factor of a row's scoring: TRAK's Q for `output_fn == "trak"`, else None."""
    return candidate_q(run, reader, batch_size) if output_fn == "trak" else None
