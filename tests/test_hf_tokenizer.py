"""data.hf_tokenizer: byte-level BPE from GGUF metadata or a Hugging Face folder.

The SmolLM2 tests compare ids with transformers' tokenizer built from the same GGUF file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) on real LAMA T-REx sentences, read by path
from `../shared/data/lama` (or `$TRACKSTAR_SHARED_DATA/lama`), and on edge cases.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib

import numpy as np
import pytest
from conftest import transformers_reference

pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")

from trackstar_jax import data
from trackstar_jax.data import hf_tokenizer
from trackstar_jax.models import gguf

EDGE_CASES = [
    "",
    " ",
    "  leading spaces",
    "trailing  ",
    "a  1",
    "tab\tand\nnewline\n\n",
    "2024-11-23 12:30, 3.14159",
    "héllo naïve café",
    "日本語のテキスト",
    "emoji 🎉👍🏽",
    "Ünïcödé ß ﬁ",
    "don't I'll we've",
    "<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>",
    "x" * 300,
    "The capital of France is",
]


def _lama_dir() -> pathlib.Path:
    root = os.environ.get("TRACKSTAR_SHARED_DATA")
    root = pathlib.Path(root) if root else pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return root / "lama"


@pytest.fixture(scope="module")
def lama_sentences() -> list[str]:
    """About 400 real sentences: every relation file, evidences with [MASK] filled in."""
    files = sorted((_lama_dir() / "TREx").glob("P*.jsonl.gz"))
    if not files:
        pytest.skip(f"LAMA T-REx not found at {_lama_dir()} (set TRACKSTAR_SHARED_DATA)")
    out = []
    for f in files:  # 20 sentences per relation, every 40th fact's first evidence
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            lines = [line for n, line in enumerate(fh) if n % 40 == 0][:20]
        for line in lines:
            e = json.loads(line)["evidences"][0]
            out.append(e["masked_sentence"].replace("[MASK]", e["obj_surface"]))
    return out


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return gguf.load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    transformers = pytest.importorskip("transformers", reason="transformers is needed for the reference tokenizer")
    auto = transformers.AutoTokenizer
    return transformers_reference(  # kept across sessions as transformers' own save_pretrained
        "smollm2-tokenizer",
        smollm2_path,
        lambda: auto.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name),
        lambda tokenizer, folder: tokenizer.save_pretrained(folder),
        auto.from_pretrained,
    )


def test_ids_equal_transformers_on_lama(ours, reference, lama_sentences):
    assert len(lama_sentences) >= 300
    got = ours.encode_batch(lama_sentences)
    want = [reference.encode(s, add_special_tokens=False) for s in lama_sentences]
    bad = [(s, g, w) for s, g, w in zip(lama_sentences, got, want) if g != w]
    assert not bad, f"{len(bad)} of {len(got)} differ, first: {bad[0]}"
    # transformers adds nothing either (the file says add_bos_token = False).
    assert reference(lama_sentences[0])["input_ids"] == got[0]
    assert [ours.decode(ids) for ids in got] == lama_sentences


@pytest.mark.parametrize("text", EDGE_CASES)
def test_ids_equal_transformers_on_edge_cases(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.encode_batch([text]) == [ids]
    # Byte-level BPE is lossless, apart from the BOS / EOS / pad ids that `decode` drops.
    dropped = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert ours.decode(ids) == dropped


def test_special_ids_come_from_the_metadata(ours, reference):
    # SmolLM2's file: bos 1 <|im_start|>, eos 2 <|im_end|>, padding 2, unknown 0, add_bos_token False.
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id, ours.add_bos) == (1, 2, 2, 0, False)
    assert (ours.token(1), ours.token(2), ours.token(0)) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
    )
    assert ours.vocab_size == len(reference) == 49152
    assert ours.encode("") == [] and ours.decode([]) == ""
    # Control tokens in text are matched whole, as transformers does.
    assert ours.encode("<|im_start|>") == [1]


def test_batches_start_with_bos(ours):
    tokens, truncated = data.encode_example(ours, "Paris is the capital of France.", 64)
    assert tokens[0] == ours.bos_id == 1 and tokens[-1] == ours.eos_id and not truncated
    q = data.encode_query(ours, "The capital of France is", " Paris", 64)
    assert q["tokens"][0] == 1 and ours.decode(q["tokens"][q["loss_mask"] > 0]) == " Paris"


def test_split_digits_follows_llama_cpp(smollm2_path, ours):
    digits = gguf.load_tokenizer(smollm2_path, split_digits=True)
    # The vocabulary has no multi-digit tokens, so only spaces before a digit tell them apart.
    assert digits.encode("born in 1960") == ours.encode("born in 1960")
    assert ours.encode("a  1") == [81, 216, 216, 33]
    assert digits.encode("a  1") == [81, 256, 33]  # "a", "  ", "1" as llama.cpp's smollm split


def test_save_and_load(tmp_path, ours, lama_sentences):
    ours.save(tmp_path / "tok")
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    back = hf_tokenizer.HFTokenizer.load(tmp_path / "tok")
    assert (back.bos_id, back.eos_id, back.pad_id, back.unk_id, back.add_bos) == (1, 2, 2, 0, False)
    texts = lama_sentences[:50] + EDGE_CASES
    assert back.encode_batch(texts) == ours.encode_batch(texts)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert [hf.encode(t, add_special_tokens=False) for t in texts] == ours.encode_batch(texts)
    assert hf.bos_token_id == 1 and hf.eos_token_id == 2


# ---------------------------------------------------------------------------------------
# Without SmolLM2: a tiny byte-level vocabulary
# ---------------------------------------------------------------------------------------


def _tiny_meta(**changes) -> dict:
    alphabet = [hf_tokenizer._bytes_to_unicode()[b] for b in range(256)]
    tokens = ["<s>", "</s>", "<pad>"] + alphabet + ["Ġt", "he", "Ġthe", "<think>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * 259 + [4],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.padding_token_id": 2,
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def test_tiny_vocabulary_merges_and_added_tokens():
    tok = hf_tokenizer.HFTokenizer.from_gguf_metadata(_tiny_meta())
    the, think = 3 + 256 + 2, 3 + 256 + 3
    assert tok.encode(" the") == [the]
    assert tok.encode("<think> the") == [think, the]
    assert tok.encode("</s>") == [1]
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, 2, 263)
    assert tok.decode([0, the, 1, 2]) == " the"


def test_refusals():
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        hf_tokenizer.HFTokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2'"):
        hf_tokenizer.HFTokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.pre": "qwen2"}))
    for key in ("merges", "tokens", "bos_token_id", "eos_token_id", "model"):
        with pytest.raises(ValueError, match=f"'tokenizer.ggml.{key}' is missing"):
            hf_tokenizer.HFTokenizer.from_gguf_metadata(_tiny_meta(**{f"tokenizer.ggml.{key}": None}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hf_tokenizer.HFTokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.eos_token_id": 9999}))


def test_folder_without_bos_is_refused(tmp_path):
    tok = hf_tokenizer.HFTokenizer.from_gguf_metadata(_tiny_meta())
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no bos_token"):
        hf_tokenizer.HFTokenizer.from_pretrained_dir(tmp_path)
    assert hf_tokenizer.HFTokenizer.from_pretrained_dir(tmp_path / "tokenizer.json", bos_token="<s>").bos_id == 0
    with pytest.raises(FileNotFoundError):
        hf_tokenizer.HFTokenizer.from_pretrained_dir(tmp_path / "nowhere")
    np.testing.assert_equal(tok.encode_batch(["the", ""]), [tok.encode("the"), []])
