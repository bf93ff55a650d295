"""`config.data.source="seqio"`: the passages of a registered seqio Task or Mixture (docs/seqio.md).

The Task (or every Task of the Mixture with a rate > 0, in `Mixture.tasks` order, i.e. by
name) is read once, unshuffled, with `seed` fixed for any stochastic preprocessor; each
example's `config.data.text_key` feature is one passage, ids in that order. A Mixture's rates
only set how often training samples a Task, so the index holds every example once.

The feature may be a string, or token ids (after `seqio.preprocessors.tokenize`): then its
`<key>_pretokenized` copy (tokenize keeps one by default) is the passage, else the ids decoded
with the Task's output-feature vocabulary.

seqio needs tensorflow, tensorflow-text and tensorflow-datasets, so it is the optional `seqio`
extra; without it `read` stops with `INSTALL_HINT`.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from trackstar_jax.data import corpus_types as corpus_lib

INSTALL_HINT = (
    "config.data.source='seqio' needs the optional `seqio` extra of trackstar_jax (seqio with "
    "tensorflow, tensorflow-text, tensorflow-datasets), which is not installed: "
    "pip install 'trackstar_jax[seqio]'  (from a checkout: pip install -e '.[seqio]'); see docs/seqio.md"
)


def import_seqio() -> Any:
    """The `seqio` module, or an ImportError that says how to install the extra."""
    try:
        import seqio  # noqa: PLC0415  (optional extra)
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} [{type(e).__name__}: {e}]") from e
    return seqio


def read(cfg: corpus_lib.DataConfig, seed: int) -> tuple[list[str], dict]:
    """The passages of `cfg.seqio_task`'s `cfg.seqio_split` and how they were read.

    Returns:
      (texts, info): info["seqio"] names the provider, split, text feature and, per Task,
      how many passages it gave and whether they are strings, `_pretokenized` copies or decoded ids.

    Raises:
      ImportError: seqio is not installed (names the extra), or `config.data.seqio_module` fails.
      ValueError: an unknown Task / Mixture or split, an example without the text feature.
    """
    seqio = import_seqio()
    if cfg.seqio_module:
        try:
            importlib.import_module(cfg.seqio_module)  # registers the Task / Mixture
        except ImportError as e:
            raise ImportError(f"config.data.seqio_module={cfg.seqio_module!r} cannot be imported: {e}") from e
    known = set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names())
    if cfg.seqio_task not in known:
        raise ValueError(
            f"config.data.seqio_task={cfg.seqio_task!r} is not a registered seqio Task or Mixture "
            f"(config.data.seqio_module={cfg.seqio_module!r} is imported to register it); "
            f"registered: {sorted(known)[:20]}"
        )
    provider = seqio.get_mixture_or_task(cfg.seqio_task)
    is_task = isinstance(provider, seqio.Task)
    tasks = [provider] if is_task else [t for t in provider.tasks if provider.get_rate(t) > 0]
    texts: list[str] = []
    per_task = []
    for task in tasks:
        if cfg.seqio_split not in task.splits:
            if is_task:
                raise ValueError(
                    f"config.data.seqio_split={cfg.seqio_split!r}: seqio Task {task.name} has splits {list(task.splits)}"
                )
            continue  # as Mixture.get_dataset does
        n0, how = len(texts), set()
        ds = task.get_dataset(sequence_length=None, split=cfg.seqio_split, shuffle=False, seed=seed, num_epochs=1)
        feature = task.output_features.get(cfg.text_key)
        for i, ex in enumerate(ds.as_numpy_iterator()):
            text, kind = _passage(
                ex, cfg.text_key, feature, f"seqio task {task.name} split {cfg.seqio_split} example {i}"
            )
            texts.append(corpus_lib.check_passage(text, f"{task.name}[{i}]"))
            how.add(kind)
            if cfg.max_examples and len(texts) >= cfg.max_examples:
                break
        per_task.append({"task": task.name, "num_passages": len(texts) - n0, "text_from": sorted(how)})
        if cfg.max_examples and len(texts) >= cfg.max_examples:
            break
    if not per_task:
        raise ValueError(f"config.data.seqio_split={cfg.seqio_split!r}: no Task of mixture {cfg.seqio_task} has it")
    info = {
        "seqio": {
            "provider": cfg.seqio_task,
            "kind": "task" if is_task else "mixture",
            "split": cfg.seqio_split,
            "text_key": cfg.text_key,
            "seed": seed,
            "tasks": per_task,
        }
    }
    return texts, info


def _passage(ex: dict, key: str, feature: Any, where: str) -> tuple[str, str]:
    """(text, how): the example's passage and where it came from ("string", "pretokenized", "decoded")."""
    if key not in ex:
        raise ValueError(f"{where} has no feature config.data.text_key={key!r} (features: {sorted(ex)})")
    v = ex[key]
    if _is_text(v):
        return _decode(v), "string"
    pre = ex.get(f"{key}_pretokenized")
    if pre is not None and _is_text(pre):
        return _decode(pre), "pretokenized"
    ids = np.asarray(v)
    vocab = getattr(feature, "vocabulary", None)
    if ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer) and vocab is not None:
        return str(vocab.decode([int(t) for t in ids])), "decoded"
    raise ValueError(
        f"{where}: feature {key!r} is neither text nor token ids with a `{key}_pretokenized` copy or an "
        f"output-feature vocabulary (got {type(v).__name__} {getattr(v, 'dtype', '')})"
    )


def _is_text(v: Any) -> bool:
    return isinstance(v, (bytes, str)) or (isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "SUO")


def _decode(v: Any) -> str:
    v = v.item() if isinstance(v, np.ndarray) else v
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)
