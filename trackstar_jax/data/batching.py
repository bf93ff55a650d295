"""Encoding passages and queries, padded batches and the grain loaders.

Batches follow the convention in `models/layers.py`: `tokens [B, T]` (BOS first, `tokenizer.PAD_ID`
padding at the end), `loss_mask [B, T]`, `example_id [B]` (-1 for padding rows).
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Mapping, Sequence

import grain
import grain.experimental as grain_experimental
import numpy as np

from trackstar_jax import files
from trackstar_jax.data import corpus_types as corpus_lib
from trackstar_jax.data import tokenizer as tokenizer_lib

# ---------------------------------------------------------------------------------------
# Encoding and batches
# ---------------------------------------------------------------------------------------


def encode_example(tok: tokenizer_lib.Tokenizer, text: str, max_len: int) -> tuple[np.ndarray, bool]:
    """BOS + text + EOS, truncated to `max_len` tokens (loss on everything after BOS).

    Returns:
      `(tokens int32 [<= max_len], truncated)`.
    """
    ids = [tok.bos_id] + tok.encode(text) + [tok.eos_id]
    return np.asarray(ids[:max_len], np.int32), len(ids) > max_len


def encode_query(
    tok: tokenizer_lib.Tokenizer, prompt: str, target: str, max_len: int, query_id: Any = None
) -> dict[str, np.ndarray]:
    """BOS + prompt + target with `loss_mask` = 1 only on the target tokens.

    `target` starts with a space (" Paris"); SentencePiece splits on whitespace, so encoding
    the two parts separately gives the tokens of the joined text.

    Raises:
      ValueError: the target encodes to nothing, or prompt + target exceeds `max_len`
        (the message names the query).
    """
    # query_id may be a location ("queries.jsonl:2"); long prompts are cut in the message.
    name = (
        (query_id if isinstance(query_id, str) and ":" in query_id else f"query {query_id!r}") + " "
        if query_id is not None
        else ""
    )
    shown = f"({files.shorten(prompt)} -> {files.shorten(target, 40)})"
    p, t = tok.encode(prompt), tok.encode(target)
    if not t:
        raise ValueError(f"{name}{shown}: the target encodes to no tokens")
    tokens = [tok.bos_id] + p + t
    if len(tokens) > max_len:
        raise ValueError(f"{name}{shown}: {len(tokens)} tokens exceed max_len={max_len}")
    mask = [0] * (1 + len(p)) + [1] * len(t)
    return {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def pad_batch(
    items: Sequence[tuple[np.ndarray, np.ndarray]], example_ids: Sequence[int], batch_size: int, seq_len: int
) -> dict[str, np.ndarray]:
    """Stacks `(tokens, loss_mask)` pairs into the batch convention, padding rows and length.

    Returns:
      `tokens int32 [batch_size, seq_len]`, `loss_mask int32 [batch_size, seq_len]`,
      `example_id int32 [batch_size]` (-1 on padding rows, whose mask is all zero).
    """
    if len(items) > batch_size or len(items) != len(example_ids):
        raise ValueError(f"pad_batch: {len(items)} items / {len(example_ids)} ids for batch_size {batch_size}")
    tokens = np.full((batch_size, seq_len), tokenizer_lib.PAD_ID, np.int32)
    mask = np.zeros((batch_size, seq_len), np.int32)
    ids = np.full((batch_size,), -1, np.int32)
    for r, ((t, m), i) in enumerate(zip(items, example_ids)):
        if len(t) > seq_len or len(m) != len(t):
            raise ValueError(
                f"pad_batch: example {i} has {len(t)} tokens / {len(m)} mask entries for seq_len {seq_len}"
            )
        tokens[r, : len(t)], mask[r, : len(t)], ids[r] = t, m, i
    return {"tokens": tokens, "loss_mask": mask, "example_id": ids}


def example_loss_mask(tokens: np.ndarray) -> np.ndarray:
    """Pretraining loss mask of one passage: every token after BOS is a target (paper §3:
    all tokens of a training example). `int32 [len(tokens)]`."""
    m = np.ones(len(tokens), np.int32)
    m[0] = 0  # BOS is never a target
    return m


# Padded lengths of a featurize batch: from MIN_BUCKET_LEN up to model.max_len on a ladder of
# BUCKETS_PER_OCTAVE steps per doubling (16, 24, 32, 48, 64, 96, ...). Short passages (T-REx
# sentences) do not pay for max_len padding, a batch's padding past its longest row is under
# 1/BUCKETS_PER_OCTAVE of a doubling, and a step compiles at most
# BUCKETS_PER_OCTAVE * log2(max_len / 16) + 1 times. With rows batched in order of length
# (`length_groups`) Run A's sentences pad 1.14x their tokens, against 1.47x for power-of-two
# buckets over rows in corpus order.
MIN_BUCKET_LEN = 16
BUCKETS_PER_OCTAVE = 2
# How index rows are batched, recorded in an index's manifest (`featurizer`): it sets the rows' bits.
LENGTH_BUCKETS = f"sorted, {BUCKETS_PER_OCTAVE} per octave from {MIN_BUCKET_LEN}"


def bucket_len(longest: int, max_len: int, *, per_octave: int | None = None, min_len: int | None = None) -> int:
    """Padded length of a batch whose longest example has `longest` tokens: the smallest step of
    the ladder (`per_octave` per doubling from `min_len`; by default the featurizer's
    `BUCKETS_PER_OCTAVE` from `MIN_BUCKET_LEN`) >= `longest`, at most `max_len`."""
    per_octave = BUCKETS_PER_OCTAVE if per_octave is None else per_octave
    n = min_len = MIN_BUCKET_LEN if min_len is None else min_len
    while n < longest:
        n *= 2
    if n > min_len:  # the doubling (n / 2, n] split into per_octave steps
        half = n // 2
        step = max(1, half // per_octave)
        n = half + -(-(longest - half) // step) * step
    return min(n, max_len)


def length_groups(lengths: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Positions `0..len(lengths)-1` in groups of `batch_size` (the last may be short), in order
    of length (stable: ties keep their order), so each padded batch holds rows of like length.

    Returns:
      int64 arrays of positions; their concatenation is a permutation of the positions.
    """
    order = np.argsort(np.asarray(lengths, np.int64), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def encode_passages(
    tok: tokenizer_lib.Tokenizer, texts: Sequence[str], max_len: int
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """`(tokens, loss_mask)` of each passage under the pretraining loss, and how many were truncated."""
    out, truncated = [], 0
    for text in texts:
        t, cut = encode_example(tok, text, max_len)
        truncated += int(cut)
        out.append((t, example_loss_mask(t)))
    return out, truncated


class _Encoded:
    """Random-access grain source: row i -> padded `tokens`, `loss_mask`, `example_id`."""

    def __init__(self, texts: Sequence[str], ids: Sequence[int], tok: tokenizer_lib.Tokenizer, seq_len: int):
        self.texts, self.ids, self.tok, self.seq_len = texts, ids, tok, seq_len

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        t, _ = encode_example(self.tok, self.texts[i], self.seq_len)
        b = pad_batch([(t, example_loss_mask(t))], [self.ids[i]], 1, self.seq_len)
        return {k: v[0] for k, v in b.items()}


def _stack(rows: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _pad_rows(b: dict[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
    n = b["tokens"].shape[0]
    if n == batch_size:
        return b
    out = pad_batch([], [], batch_size - n, b["tokens"].shape[1])
    return {k: np.concatenate([b[k], out[k]]) for k in b}


def index_batches(
    corpus: corpus_lib.Corpus,
    tok: tokenizer_lib.Tokenizer,
    batch_size: int,
    seq_len: int,
    start: int = 0,
    stop: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Ordered (no shuffle) batches over examples `[start, stop)`; the last one is padded.

    Row r of batch b holds example `start + b * batch_size + r` (example_id -1 on padding),
    so a caller can write vectors straight into index rows.
    """
    stop = len(corpus.examples) if stop is None else min(stop, len(corpus.examples))
    if not 0 <= start <= stop:
        raise ValueError(f"index_batches: bad row range [{start}, {stop}) for {len(corpus.examples)} examples")
    texts = [e.text for e in corpus.examples[start:stop]]
    ids = list(range(start, stop))
    ds = grain.MapDataset.source(_Encoded(texts, ids, tok, seq_len)).batch(batch_size, batch_fn=_stack)
    for b in ds:
        yield _pad_rows(b, batch_size)


def eval_batches(
    corpus: corpus_lib.Corpus, tok: tokenizer_lib.Tokenizer, batch_size: int, seq_len: int, max_batches: int = 0
) -> list[dict[str, np.ndarray]]:
    """Batches of the held-out passages (example_id -1: they are not examples)."""
    texts = list(corpus.eval_texts)
    if max_batches:
        texts = texts[: max_batches * batch_size]
    if not texts:
        return []
    ds = grain.MapDataset.source(_Encoded(texts, [-1] * len(texts), tok, seq_len)).batch(batch_size, batch_fn=_stack)
    return [_pad_rows(b, batch_size) for b in ds]


# grain's seeded shuffle (`MapDataset.seed(s).shuffle().repeat(None)`), position for position:
# epoch e is the permutation j -> `index_shuffle(j, max_index=n-1, seed=(s+e) % 2**32, rounds=4)`.
# grain calls it once per element, at a cost that grows as n shrinks (~38 ms per epoch below
# n ~ 1,000: 1.9 ms per element at n = 20), which a small corpus repeated for hundreds of
# epochs pays on every step. Epochs of small corpora are computed whole and kept per process
# (the LDS retrains many same-sized subsets with one seed); larger ones go element by element
# as grain does. A test pins the order to grain's own pipeline.
SMALL_EPOCH = 4096  # corpora up to this size: whole epochs kept (<= 32 kB each)
_SHUFFLE_ROUNDS = 4  # grain's `ShuffleMapDataset`


@functools.lru_cache(maxsize=256)
def _epoch_permutation(n: int, seed: int) -> np.ndarray:
    """`[n]` int64: position j of an epoch -> the example it reads (grain's order)."""
    perm = [grain_experimental.index_shuffle(j, max_index=n - 1, seed=seed, rounds=_SHUFFLE_ROUNDS) for j in range(n)]
    out = np.asarray(perm, np.int64)
    out.setflags(write=False)
    return out


def shuffled_position(i: int, n: int, seed: int) -> int:
    """The example read at position `i` of the infinite seeded shuffle of `n` examples."""
    epoch, j = divmod(i, n)
    epoch_seed = (seed + epoch) % 2**32
    if n <= SMALL_EPOCH:
        return int(_epoch_permutation(n, epoch_seed)[j])
    return grain_experimental.index_shuffle(j, max_index=n - 1, seed=epoch_seed, rounds=_SHUFFLE_ROUNDS)


def train_batches(
    corpus: corpus_lib.Corpus,
    tok: tokenizer_lib.Tokenizer,
    batch_size: int,
    seq_len: int,
    seed: int,
    start_step: int = 0,
    example_ids: Sequence[int] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Infinite shuffled batches (grain's seeded shuffle, reshuffled each epoch; full batches).

    Batch s is a pure function of (corpus, seed, s), so a run resumed at step s sees exactly
    the batches it would have seen without the interruption. `example_ids` restricts training
    to those examples (the LDS's retrained subsets); rows keep their corpus example ids.
    """
    ids = list(range(len(corpus.examples))) if example_ids is None else [int(i) for i in example_ids]
    if not ids or min(ids) < 0 or max(ids) >= len(corpus.examples):
        raise ValueError(
            f"train_batches: example_ids must be non-empty ids in [0, {len(corpus.examples)}), got {len(ids)} ids"
        )
    texts = corpus.texts if example_ids is None else [corpus.examples[i].text for i in ids]
    if seed < 0:
        raise ValueError(f"train_batches: seed must be non-negative, got {seed}")
    source, n = _Encoded(texts, ids, tok, seq_len), len(texts)
    # the seed grain's `.seed(seed).shuffle()` derives for the shuffle (`MapDataset._default_seed`:
    # the seed and the shuffle's distance to the `.seed` node, 1, through numpy's SeedSequence)
    shuffle_seed = int(np.random.SeedSequence([seed, 1]).generate_state(1, dtype=np.uint32)[0])
    rows: dict[int, dict[str, np.ndarray]] = {}  # a small corpus is encoded once, not once per epoch
    step = start_step
    while True:
        picked = []
        for i in range(step * batch_size, (step + 1) * batch_size):
            k = shuffled_position(i, n, shuffle_seed)
            row = rows.get(k)
            if row is None:
                row = source[k]
                if n <= SMALL_EPOCH:
                    rows[k] = row
            picked.append(row)
        yield _stack(picked)
        step += 1


def truncation_report(texts: Sequence[str], tok: tokenizer_lib.Tokenizer, max_len: int) -> list[int]:
    """Indices of passages longer than `max_len` tokens (BOS + text + EOS)."""
    out = []
    for start in range(0, len(texts), 4096):
        for j, ids in enumerate(tok.encode_batch(texts[start : start + 4096])):
            if len(ids) + 2 > max_len:
                out.append(start + j)
    return out
