"""The SentencePiece tokenizer a pretraining run trains on its corpus (`workdir/tokenizer.model`)."""

from __future__ import annotations

import io
import os
import pathlib
from typing import Iterable, Sequence

import sentencepiece as spm

from trackstar_jax import files

# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------

# Token ids of every batch: PAD_ID pads `tokens [B, T]` at the end (masked out of the loss, so
# any id works; SmolLM2's 0 is `<|endoftext|>`); a trained SentencePiece model uses all four.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """SentencePiece tokenizer with `pad_id == PAD_ID == 0`, unk 1, BOS 2, EOS 3."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        if self._sp.pad_id() != PAD_ID or self._sp.bos_id() != BOS_ID or self._sp.eos_id() != EOS_ID:
            raise ValueError(
                f"tokenizer ids (pad {self._sp.pad_id()}, bos {self._sp.bos_id()}, eos {self._sp.eos_id()}) "
                f"must be ({PAD_ID}, {BOS_ID}, {EOS_ID}); train it with train_tokenizer"
            )

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS / EOS."""
        return list(self._sp.encode(text, out_type=int))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(x) for x in self._sp.encode(list(texts), out_type=int)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; pad / BOS / EOS are dropped."""
        return self._sp.decode([int(i) for i in ids if int(i) not in (self.pad_id, self.bos_id, self.eos_id)])

    def save(self, path: str | os.PathLike) -> None:
        files.atomic_write(path, self.model_proto)


def train_tokenizer(
    texts: Sequence[str], vocab_size: int, path: str | os.PathLike | None = None, model_type: str = "unigram"
) -> Tokenizer:
    """Trains a SentencePiece model on `texts` and saves it to `path` (if given).

    The vocabulary is at most `vocab_size` (fewer when the corpus is too small to fill it,
    `hard_vocab_limit=False`); it must then fit the model's embedding table.
    """
    if not texts:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    if vocab_size < 8:
        raise ValueError(f"tokenizer vocab_size must be >= 8, got {vocab_size}")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        hard_vocab_limit=False,
        character_coverage=1.0 if len(texts) < 100_000 else 0.9995,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        max_sentence_length=1 << 16,
        minloglevel=2,
        num_threads=2,
    )
    tok = Tokenizer(buf.getvalue())
    if path is not None:
        tok.save(path)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Loads a tokenizer saved by `train_tokenizer` / `Tokenizer.save`."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no tokenizer model at {p}")
    return Tokenizer(p.read_bytes())
