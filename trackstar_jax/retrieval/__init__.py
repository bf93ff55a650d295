"""Retrieval: exact top-k / bottom-k over the whole index, and stage 3.

- `topk`: sharded all-gather top-k, in memory (`topk`) or streamed (`stream_topk`), `search`.
  Its parts: `score_plan` (how rows meet the queries, per platform: `Plan`, `make_score_plan`),
  `kernel` (the per-device scoring, stable selection and merge, the sharded program), `merge`
  (several processes: each scores its row range, candidates merged on the host).
- `native`: the hand-written CPU scoring kernel (XLA FFI) and its build cache.
- `records`: output lines in the PAIR-code/pretraining-tda schema.
- `stage`: `retrieve_queries` (text queries -> proponents / opponents) and `write_retrieval`
  (their files), the work of the `stages.retrieve` stage.
"""

from trackstar_jax.retrieval.stage import TextQuery, load_text_queries, retrieve_queries, write_retrieval
