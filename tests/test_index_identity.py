"""What defines an index: every config key is classified (`index.build.INDEX_KEYS` / `config.INDEX_SECTIONS`)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from trackstar_jax import config as config_lib
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import build as build_lib
from trackstar_jax.models import lm


def test_every_config_key_is_classified():
    """A new knob must say whether it defines an index: add it to index.build.INDEX_KEYS (a key of
    `model` / `vectors`) or give its section a reason in config.INDEX_SECTIONS."""
    keys = config_lib.flatten(config_lib.to_dict(config_lib.Settings()))
    sections = {k.split(".")[0] for k in keys}
    unclassified = sorted(
        k for k in keys if k not in build_lib.INDEX_KEYS and k.split(".")[0] not in config_lib.INDEX_SECTIONS
    )
    assert not unclassified, f"classify these keys in index.build.INDEX_KEYS / config.INDEX_SECTIONS: {unclassified}"
    assert not set(build_lib.INDEX_KEYS) - set(keys), "INDEX_KEYS names keys the config does not have"
    assert set(config_lib.INDEX_SECTIONS) <= sections
    assert not {k.split(".")[0] for k in build_lib.INDEX_KEYS} & set(config_lib.INDEX_SECTIONS)
    assert set(build_lib.INDEX_KEYS.values()) <= {build_lib.IDENTITY, build_lib.FEATURIZER, build_lib.OTHER}


def _manifest(model_cfg: lm.LMConfig, vec_cfg: vectors_lib.VectorConfig) -> dict:
    run = types.SimpleNamespace(
        params={"w": np.arange(4.0, dtype=np.float32)},
        opt_state=None,
        opt_state_info=None,
        model_cfg=model_cfg,
        step=7,
        workdir="/run",
        corpus=types.SimpleNamespace(name="c", fingerprint="f", examples=[0, 1, 2]),
    )
    storage = config_lib.StorageConfig()
    return build_lib.index_manifest(run, vec_cfg, storage, vec_cfg.dim)


def test_the_manifest_records_exactly_the_identity_keys():
    model_cfg, vec_cfg = lm.LMConfig(tie_embeddings=False, source="x.gguf"), vectors_lib.VectorConfig(correction=False)
    m = _manifest(model_cfg, vec_cfg)
    want = lambda sec: {
        k.split(".")[1] for k, c in build_lib.INDEX_KEYS.items() if k.startswith(sec + ".") and c == build_lib.IDENTITY
    }  # noqa: E731
    assert set(m["vectors"]) == want("vectors") | {"dim", "num_blocks_total", "block_dim"}  # + the layout
    assert set(m["model"]["config"]) == want("model")
    # The two compatibility omissions: no `unembed` for tied models, no `source` for pretrained runs.
    m2 = _manifest(dataclasses.replace(model_cfg, tie_embeddings=True, source=""), vec_cfg)
    assert set(m2["model"]["config"]) == want("model") - {"source"}
    assert "unembed" not in m2["vectors"]


def test_only_identity_keys_change_the_identity():
    model_cfg, vec_cfg = lm.LMConfig(), vectors_lib.VectorConfig(correction=False)
    ident = lambda m: {s: m[s] for s in ("model", "vectors", "corpus")}  # noqa: E731
    base = ident(_manifest(model_cfg, vec_cfg))
    for key, cls in build_lib.INDEX_KEYS.items():
        if not key.startswith("vectors.") or key == "vectors.unembed":
            continue
        field = key.split(".")[1]
        value = getattr(vec_cfg, field)
        other = {
            bool: lambda v: not v,
            int: lambda v: v + 1,
            str: lambda v: {
                "loss": "margin",
                "fast": "reference",
                "float32": "tf32",
                "minibatch": "per_example",  # V's settings enter through the run's record (opt_state_info)
                "heldout": "candidates",
            }[v],
        }
        changed = dataclasses.replace(vec_cfg, **{field: other[type(value)](value)})
        assert (ident(_manifest(model_cfg, changed)) != base) == (cls == build_lib.IDENTITY), key
