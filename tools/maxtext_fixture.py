"""Trains the tiny MaxText llama2-block model and dumps MaxText's own logits (the import's reference).

Run by tools/maxtext_fixture.sh inside the Python 3.12 side venv that holds `maxtext` (it
cannot import under the project's Python 3.11): `python tools/maxtext_fixture.py OUT_DIR
[VARIANT ...]`. For each variant (scanned and unscanned layers, and scanned with the
interleaved llama3.1 RoPE layout without its scaling) it trains `STEPS` steps of
`maxtext.trainers.pre_train.train` on CPU with synthetic data, keeps the final orbax
checkpoint `OUT_DIR/<variant>/checkpoints/<last step>/items`, and writes
`OUT_DIR/<variant>/reference.npz` (`tokens [B, T]` int32, `logits [B, T, vocab]` float32 from
MaxText's own model on that checkpoint's params) and `OUT_DIR/<variant>/maxtext_args.json`
(the MaxText config keys it was trained with; the import takes the shape-less ones as flags).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

STEPS = 4
# Tiny llama2 block: GQA (4 query heads over 2 kv heads), head_dim 8, untied output head.
# float32 everywhere and the highest matmul precision, so the reference is exact to float32.
ARGS = {
    "hardware": "cpu",
    "dataset_type": "synthetic",
    "decoder_block": "llama2",
    "base_emb_dim": 32,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 2,
    "head_dim": 8,
    "base_mlp_dim": 64,
    "base_num_decoder_layers": 2,
    "vocab_size": 128,
    "max_target_length": 16,
    "per_device_batch_size": 1,
    "steps": STEPS,
    "learning_rate": 1e-2,
    "checkpoint_period": STEPS,
    "enable_checkpointing": True,
    "async_checkpointing": False,
    "dtype": "float32",
    "weight_dtype": "float32",
    "matmul_precision": "highest",
    "attention": "dot_product",
    "rope_max_timescale": 10_000,
    "normalization_layer_epsilon": 1e-5,
    "enable_tensorboard": False,
    "log_period": 1,
    "skip_jax_distributed_system": True,  # one CPU process: no coordinator
}
VARIANTS = {
    "scanned": {"scan_layers": True},
    "unscanned": {"scan_layers": False},
    # RoPE pairs (2i, 2i+1) as MaxText's LLaMARotaryEmbedding lays them out, without llama3.1's scaling
    "interleaved_rope": {"scan_layers": True, "rope_type": "llama3.1", "rope_use_scale": False},
}


def _argv(out: pathlib.Path, name: str, extra: dict) -> list[str]:
    import maxtext  # noqa: PLC0415

    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    kv = {**ARGS, **extra, "run_name": name, "base_output_directory": str(out)}
    return ["train", str(base)] + [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kv.items()]


def _reference(argv: list[str], items: pathlib.Path, out: pathlib.Path) -> None:
    """MaxText's own forward (its linen Transformer) on the checkpoint's params."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import orbax.checkpoint as ocp  # noqa: PLC0415
    from maxtext.configs import pyconfig  # noqa: PLC0415
    from maxtext.layers import quantizations  # noqa: PLC0415
    from maxtext.models import models  # noqa: PLC0415
    from maxtext.utils import maxtext_utils  # noqa: PLC0415

    config = pyconfig.initialize(argv)
    mesh = maxtext_utils.get_mesh_from_config(config)
    model = models.transformer_as_linen(config, mesh, quant=quantizations.configure_quantization(config))
    restored = ocp.PyTreeCheckpointer().restore(str(items))
    params = restored["params"]
    rng = np.random.default_rng(0)
    b, t = 3, ARGS["max_target_length"]
    tokens = rng.integers(1, ARGS["vocab_size"], size=(b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    segments = np.ones((b, t), np.int32)
    with mesh:
        logits = model.apply(params, tokens, positions, decoder_segment_ids=segments, enable_dropout=False)
    logits = np.asarray(jax.device_get(logits), np.float32)
    np.savez(out / "reference.npz", tokens=tokens, logits=logits)
    print(f"reference logits {logits.shape} -> {out / 'reference.npz'}")


def main() -> None:
    out = pathlib.Path(sys.argv[1]).resolve()
    work = out / "_work"
    for name in sys.argv[2:] or VARIANTS:
        extra = VARIANTS[name]
        argv = _argv(work, name, extra)
        shutil.rmtree(work / name, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "maxtext.trainers.pre_train.train", *argv[1:]], check=True)
        ckpts = work / name / "checkpoints"
        last = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())  # MaxText names it by step index
        dst = out / name
        shutil.rmtree(dst, ignore_errors=True)
        (dst / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpts / str(last), dst / "checkpoints" / str(last))
        (dst / "maxtext_args.json").write_text(json.dumps({**ARGS, **extra}, indent=1, sort_keys=True) + "\n")
        _reference(argv, dst / "checkpoints" / str(last) / "items", dst)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
