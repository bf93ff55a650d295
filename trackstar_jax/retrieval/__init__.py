"""Retrieval: exact top-k / bottom-k over the whole index, and stage 3.

- `topk`: sharded all-gather top-k, in memory (`topk`) or streamed (`stream_topk`), `search`.
- `native`: the hand-written CPU scoring kernel (XLA FFI) and its build cache.
- `records`: output lines in the PAIR-code/pretraining-tda schema.
- `stage`: `retrieve_queries` (text queries -> proponents / opponents) and `write_retrieval`
  (their files), the work of the `stages.retrieve` stage.
"""

from trackstar_jax.retrieval.stage import TextQuery, load_text_queries, retrieve_queries, write_retrieval
