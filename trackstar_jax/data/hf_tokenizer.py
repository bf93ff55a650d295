"""Hugging Face `tokenizers` tokenizers behind the interface of `corpus.Tokenizer`.

`HFTokenizer` has what the pipeline uses of the SentencePiece wrapper: `encode` / `encode_batch`
(ids without BOS / EOS), `decode` (drops pad / BOS / EOS), `bos_id`, `eos_id`, `pad_id`,
`vocab_size` and `save`. It is built from

  * a Hugging Face tokenizer folder (`tokenizer.json`, plus `tokenizer_config.json` for which
    tokens are BOS / EOS / pad): `HFTokenizer.from_pretrained_dir(path)`;
  * the tokenizer metadata of a GGUF file (`tokenizer.ggml.model == "gpt2"`, a byte-level BPE):
    `from_gguf_metadata(meta)` (`models.gguf.load_tokenizer(path)` reads a file's). The result matches what
    transformers' GGUF converter builds (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`):
    a BPE over the file's tokens and merges, a GPT-2 ByteLevel pre-tokenizer (its regex, no
    prefix space) and decoder, the tokens typed CONTROL added as special tokens and those typed
    USER_DEFINED as plain added tokens.

BOS convention. The project's batches always start with `bos_id` (`corpus.encode_example`,
`generate.complete` prepend it; `encode` never adds it). For a GGUF file, `bos_id` / `eos_id` /
`pad_id` are the file's `tokenizer.ggml.{bos,eos,padding}_token_id`, never guessed. For
SmolLM2-135M-Instruct these are 1 `<|im_start|>`, 2 `<|im_end|>` and 2; its
`tokenizer.ggml.add_bos_token` is False (llama.cpp and transformers prepend nothing), kept as
`add_bos` for callers that want the file's own behaviour. Note that the batch helpers pad with
`tokenizer.PAD_ID` (0, SmolLM2's `<|endoftext|>`); padding is masked out of the loss and, being at the
end under causal attention, changes no other position.

Known difference from llama.cpp: SmolLM2's GGUF names the pre-tokenizer `smollm`, for which
llama.cpp (and SmolLM2's own `tokenizer.json`) first splits every digit on its own; transformers'
GGUF converter does not. Since the vocabulary has no multi-digit tokens, both agree except when
several spaces precede a digit; `split_digits=True` gives llama.cpp's behaviour.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from trackstar_jax import files

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
_CONTROL, _USER_DEFINED = 3, 4
# GGUF `tokenizer.ggml.pre` names whose splitting is the GPT-2 regex (the `smollm` family adds
# an individual-digit split in llama.cpp, see the module docstring).
_GPT2_REGEX_PRE = (None, "default", "gpt-2", "gpt2", "smollm", "starcoder", "refact")
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level vocabularies use)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the `corpus.Tokenizer` interface (see the module docstring).

    Attributes:
      bos_id, eos_id, pad_id: special ids (`pad_id` falls back to `eos_id` when none is named).
      unk_id: unknown-token id or None.
      add_bos: whether the source says BOS is prepended (informational; `encode` never adds it).
      backend: the `tokenizers.Tokenizer`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int,
        eos_id: int,
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
    ):
        self.backend = backend
        size = backend.get_vocab_size(with_added_tokens=True)
        for name, i in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id), ("unk_id", unk_id)):
            if i is not None and not 0 <= int(i) < size:
                raise ValueError(f"tokenizer {name} {i} is outside the vocabulary (size {size})")
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        self.pad_id = int(pad_id) if pad_id is not None else self.eos_id
        self.unk_id = int(unk_id) if unk_id is not None else None
        self.add_bos = bool(add_bos)

    # -- the corpus.Tokenizer interface ---------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding must have at least this)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS / EOS (`""` gives `[]`)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]`, in parallel in the Rust backend."""
        return [list(e.ids) for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; pad / BOS / EOS are dropped, other special tokens are kept as text."""
        drop = (self.pad_id, self.bos_id, self.eos_id)
        return self.backend.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

    def token(self, i: int) -> str | None:
        """The vocabulary entry of id `i` (byte-level spelling for BPE vocabularies)."""
        return self.backend.id_to_token(int(i))

    # -- persistence ----------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` (a Hugging Face tokenizer folder).

        `HFTokenizer.from_pretrained_dir(directory)` and transformers'
        `AutoTokenizer.from_pretrained(directory)` both read it back.
        """
        d = pathlib.Path(directory)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.token(self.bos_id),
            "eos_token": self.token(self.eos_id),
            "pad_token": self.token(self.pad_id),
            "unk_token": self.token(self.unk_id) if self.unk_id is not None else None,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        files.atomic_write(d / TOKENIZER_FILE, self.backend.to_str().encode("utf-8"))
        files.atomic_write(d / CONFIG_FILE, json.dumps(config, indent=2).encode("utf-8"))

    @classmethod
    def from_pretrained_dir(
        cls,
        path: str | os.PathLike,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> HFTokenizer:
        """Loads a Hugging Face tokenizer folder (or its `tokenizer.json`).

        The special tokens come from the arguments, else from `tokenizer_config.json` beside
        `tokenizer.json` (`bos_token`, `eos_token`, `pad_token`, `unk_token`, `add_bos_token`;
        a value may be a string or `{"content": ...}`).

        Raises:
          FileNotFoundError: no `tokenizer.json`.
          ValueError: no BOS or EOS token can be determined, or one is not in the vocabulary.
        """
        p = pathlib.Path(path)
        file = p if p.suffix == ".json" else p / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} at {file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the Rust library raises a bare Exception for a damaged file
            raise files.InputError(
                f"{file} is not a readable tokenizer file ({e}): it is truncated or damaged; download it again"
            ) from None
        config_file = file.parent / CONFIG_FILE
        config = files.read_json(config_file, "tokenizer config", "download it again") if config_file.is_file() else {}

        def token_id(name: str, override: str | None, required: bool) -> int | None:
            tok = override if override is not None else config.get(name)
            if isinstance(tok, Mapping):
                tok = tok.get("content")
            if tok is None:
                if required:
                    raise ValueError(f"no {name} for the tokenizer at {file}: pass {name}= or set it in {config_file}")
                return None
            i = backend.token_to_id(tok)
            if i is None:
                raise ValueError(f"{name} {tok!r} of the tokenizer at {file} is not in its vocabulary")
            return i

        return cls(
            backend,
            bos_id=token_id("bos_token", bos_token, True),
            eos_id=token_id("eos_token", eos_token, True),
            pad_id=token_id("pad_token", pad_token, False),
            unk_id=token_id("unk_token", None, False),
            add_bos=bool(config.get("add_bos_token", False)),
        )

    load = from_pretrained_dir

    # -- GGUF -----------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(
        cls, meta: Mapping[str, Any], *, split_digits: bool = False, source: str = "<metadata>"
    ) -> HFTokenizer:
        """Byte-level BPE from GGUF `tokenizer.ggml.*` metadata, as transformers builds it.

        Args:
          meta: GGUF metadata (`models.gguf.read_metadata`): `tokenizer.ggml.model` ("gpt2"),
            `.tokens`, `.merges` ("a b" strings), `.token_type` (optional), `.pre` (optional),
            `.bos_token_id`, `.eos_token_id`, `.padding_token_id` / `.unknown_token_id` /
            `.add_bos_token` (optional).
          split_digits: split each digit on its own before the GPT-2 regex, as llama.cpp does
            for `pre` = smollm / starcoder / refact (transformers does not; default False).
          source: the file, for messages.

        Raises:
          ValueError: another tokenizer model or pre-tokenizer, or a missing key (named).
        """

        def need(key: str) -> Any:
            if "tokenizer.ggml." + key not in meta:
                raise ValueError(f"GGUF metadata key 'tokenizer.ggml.{key}' is missing in {source}")
            return meta["tokenizer.ggml." + key]

        kind = need("model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} in {source} is not supported (only 'gpt2', byte-level BPE)"
            )
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in _GPT2_REGEX_PRE:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} in {source} is not supported "
                f"(supported: {[p for p in _GPT2_REGEX_PRE if p]})"
            )
        tokens, merges = list(need("tokens")), list(need("merges"))
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        # A vocabulary entry written outside the byte alphabet is re-spelled byte by byte, as
        # transformers does, so that BPE can reach it (later duplicates win, as in a dict).
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        bpe = models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ")) for m in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
        backend = tokenizers.Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if split_digits and pre in _DIGIT_SPLIT_PRE:
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        # Control tokens (e.g. <|im_start|>) are matched whole and are special; a control token
        # spelled outside the byte alphabet is a llama.cpp mislabel and is skipped (as transformers does).
        backend.add_special_tokens(
            [
                tokenizers.AddedToken(t, normalized=False, special=True)
                for t, k in zip(tokens, types)
                if k == _CONTROL and set(t) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                tokenizers.AddedToken(t, normalized=False, special=False)
                for t, k in zip(tokens, types)
                if k == _USER_DEFINED and t in vocab
            ]
        )
        return cls(
            backend,
            bos_id=need("bos_token_id"),
            eos_id=need("eos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )
