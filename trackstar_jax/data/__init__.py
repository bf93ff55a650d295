"""Data: corpora with stable example ids, the tokenizer, encoding and batches.

- `corpus_types`: `DataConfig` (`config.data`), `Corpus` / `Example` / `Fact`, what every
  source builds them with.
- `corpus`: the sources (LAMA T-REx, text, jsonl, seqio), saving beside the run.
- `embedded`: the seeded fact corpus used by the quickstart and the tests.
- `tokenizer`: the SentencePiece tokenizer a run trains on its corpus.
- `batching`: passages and queries -> `(tokens, loss_mask)`, padded batches, grain loaders.
- `answers`: is a completion the fact's object (§4.2)?
"""

from trackstar_jax.data.answers import is_correct, normalize_answer
from trackstar_jax.data.batching import (
    BUCKETS_PER_OCTAVE,
    LENGTH_BUCKETS,
    MIN_BUCKET_LEN,
    bucket_len,
    encode_example,
    encode_passages,
    encode_query,
    eval_batches,
    example_loss_mask,
    index_batches,
    length_groups,
    pad_batch,
    train_batches,
    truncation_report,
)
from trackstar_jax.data.corpus import build_corpus, check_source, load_corpus, save_corpus
from trackstar_jax.data.corpus_types import (
    SOURCES,
    Corpus,
    DataConfig,
    EmbeddedConfig,
    Example,
    Fact,
    fingerprint,
    make_corpus,
)
from trackstar_jax.data.embedded import fill_template, generate_embedded
from trackstar_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, load_tokenizer, train_tokenizer
