"""Cost planner: `python -m launch.plan --config=experiments/paper_8b.py --num_examples=365000000 --tokens_per_example=512`.

Prints, before anything runs (abstract shapes only, nothing allocated): parameter and
optimizer-state bytes per device, the compiled memory per device of the train, featurize
(fast and reference paths; `configured` is what `build_index` runs), tail-patch and
retrieval-scoring steps, index bytes per storage dtype, R bytes, bytes read per retrieval
query batch, and time estimates from a short calibration on this machine (or
`--flops_per_s` / `--bytes_per_s` per device, stated).
`--fake_devices=N` plans an N-device mesh on this host (CPU devices; set before JAX starts),
e.g. `--fake_devices=64 --config.mesh.shape='(4,16,1)'`. Warns when a step does not fit the
device memory limit (`--device_memory_gib`, `TRACKSTAR_JAX_DEVICE_MEMORY_BYTES`, or the device's),
naming the knob; the stages refuse such a step at their start, before any work.
`--target_platform=gpu` (or tpu) compiles the steps as that platform runs them where their
programs differ by platform (the fused head's 16,384-token chunks, not the CPU's few hundred,
and its input-only gradient over the whole vocabulary, not in blocks; the exact-V path
batched, not looped per example; the dense layers unflattened; the retrieval kernel): with
`--fake_devices`, an accelerator's memory per device planned on this CPU
(`distributed.runtime.target_platform`).
"""

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

# importing jax does not start its backend: `--fake_devices` below still takes effect
from launch import _config
from trackstar_jax.distributed import runtime as runtime_lib
from trackstar_jax.distributed.runtime import PLATFORMS

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_N = flags.DEFINE_integer("num_examples", None, "Corpus examples (default: config.data.max_examples or 1e6).")
_T = flags.DEFINE_integer("tokens_per_example", None, "Tokens per example (default: config.model.max_len).")
_Q = flags.DEFINE_integer("num_queries", 1000, "Queries for the retrieval time estimate.")
_FAKE = flags.DEFINE_integer("fake_devices", 0, "Plan on this many fake CPU devices (0: the present devices).")
_FLOPS = flags.DEFINE_float("flops_per_s", 0.0, "Stated FLOP/s per device (0: measure on this machine).")
_BW = flags.DEFINE_float("bytes_per_s", 0.0, "Stated memory bytes/s per device (0: measure on this machine).")
_MEM = flags.DEFINE_float("device_memory_gib", 0.0, "Device memory limit in GiB (0: env / device).")
_TARGET = flags.DEFINE_enum(
    "target_platform",
    None,
    list(PLATFORMS),
    "Compile the steps' platform-dependent structure for this platform (default: the present backend).",
)
_COMPILE = flags.DEFINE_bool(
    "compile", True, "Compile the train / featurize / tail-patch / retrieval steps abstractly for their memory."
)
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    runtime_lib.quiet_library_logs()
    if _FAKE.value:  # must precede JAX's backend start
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_FAKE.value}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"
    if _MEM.value:
        os.environ["TRACKSTAR_JAX_DEVICE_MEMORY_BYTES"] = str(int(_MEM.value * 2**30))
    import jax  # noqa: PLC0415

    from launch import _config  # noqa: PLC0415
    from trackstar_jax import plan  # noqa: PLC0415
    from trackstar_jax.distributed import runtime, sharding  # noqa: PLC0415

    if _TARGET.value:  # read by `runtime.target_platform` whenever a step is traced
        os.environ[runtime.TARGET_ENV] = _TARGET.value
    settings = _config.settings(_CONFIG)
    mesh = sharding.make_mesh(settings.mesh.shape)
    if _FLOPS.value and _BW.value:
        rates = plan.Rates(_FLOPS.value, _BW.value, "stated")
    else:
        m = plan.calibrate()
        rates = plan.Rates(
            _FLOPS.value or m["flops_per_s"], _BW.value or m["bytes_per_s"], f"measured on {jax.devices()[0]}"
        )
    n = _N.value or settings.data.max_examples or 1_000_000
    out = plan.plan(
        settings,
        mesh,
        num_examples=n,
        tokens_per_example=_T.value or settings.model.max_len,
        rates=rates,
        num_queries=_Q.value,
        compile_steps=_COMPILE.value,
    )
    out["num_examples"] = n
    out["target_platform"] = runtime.target_platform()
    print(json.dumps(out, indent=1))
    print("\n".join(plan.summary(out)), file=sys.stderr)  # the same figures in GiB and hours
    for step, peak in plan.peaks(out).items():
        try:
            plan.check_fits(step, peak)
        except plan.DoesNotFitError as e:
            print(f"WARNING: {e}", file=sys.stderr)


if __name__ == "__main__":
    _config.run(main, flags_parser=app.parse_flags_with_usage)  # not parse_flags: no compilation cache
