"""Evaluation: the fact-tracing table (§4-5) and stage 4.

- `settings`: the `eval`, `tailpatch` and `validate` section types, and `TableSettings`, what
  the evaluation reads of the composed config (a `Protocol` that `config.Settings` satisfies).

- `queries`: fact queries from templates, §A.4 sampling, frequency buckets.
- `query_set`: the run's facts -> the encoded query set with the model's completions.
- `rows`: the row-kind registry (`register(RowKind(...))`: gold, BM25, dense, gradient), one
  retriever interface for the evaluation, LDS and the explorer.
- `baselines`: BM25, dense embeddings, the table's `METHODS`.
- `embedding`: the dense row's MiniLM encoder in JAX.
- `tailpatch`: the tail-patch influence metric (§4.3).
- `metrics`: MRR / recall / precision, bootstrap intervals, tables.
- `report`: retrieval files, table.md. `results`: reading an evaluation back (notebook).
- `stage`: `evaluate_run`, the work of the `stages.evaluate` stage (memory checks, rows,
  tail-patch, the table).
"""

from trackstar_jax.evaluation.stage import evaluate_run
