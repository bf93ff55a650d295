"""End-to-end `launch.build_index` on a LAMA corpus: the real stage as a user runs it (a fresh
process: JAX start-up, reading, tokenising, compiling, featurizing, writing the zarr index and
R_train), one JSON line.

    python -m benchmarks.lama_index --data=.gpu_data/lama --workdir=/tmp/lama_run \\
        [--config=experiments/small.py] [--train_steps=20] [--max_examples=0] [--extra=--config.x=y ...]

Trains the config's model on the corpus first (`launch.train`, `--train_steps` steps; not the
measurement) when the workdir holds no run. The line is `launch.build_index`'s own summary
(`tokens_per_s`: the build loop) plus `wall_s` (the whole process) and `tokens_per_s_wall`
(= tokens / wall_s: reading, tokenising and compiling included).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time


def _run(cmd: list[str]) -> tuple[float, list[str]]:
    """Runs a stage; its stderr (progress, errors) passes straight through, so a run killed at
    its time limit still shows in the log how far it got."""
    print(f"[lama_index] {' '.join(cmd[2:4])} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    print(f"[lama_index] {cmd[3]} took {wall:.1f} s", file=sys.stderr, flush=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}")
    return wall, proc.stdout.splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="LAMA folder (relations.jsonl, TREx/)")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--config", default="experiments/small.py")
    parser.add_argument("--train_steps", type=int, default=20)
    parser.add_argument("--max_examples", type=int, default=0, help="data.max_examples (0: the whole corpus)")
    parser.add_argument("--fresh", type=int, default=1, help="1: delete the workdir's index before building")
    parser.add_argument("--extra", nargs="*", default=[], help="more --config.* overrides for both stages")
    args = parser.parse_args()
    if not (pathlib.Path(args.data) / "relations.jsonl").is_file():  # a line that says so, not a crash
        reason = f"--data={args.data} holds no relations.jsonl (run benchmarks/prepare_lama.sh first)"
        print(json.dumps({"bench": "build_index", "skipped": "lama", "reason": reason}), flush=True)
        return
    overrides = [
        "--config.data.source=lama",
        f"--config.data.path={args.data}",
        f"--config.data.max_examples={args.max_examples}",
        f"--config.train.num_steps={args.train_steps}",
        *args.extra,
    ]
    workdir = pathlib.Path(args.workdir)
    train_s = None
    if not (workdir / "checkpoints").is_dir():
        train_s, _ = _run(
            [sys.executable, "-m", "launch.train", f"--config={args.config}", f"--workdir={workdir}", *overrides]
        )
    if args.fresh:
        shutil.rmtree(workdir / "index", ignore_errors=True)
    wall, lines = _run(
        [sys.executable, "-m", "launch.build_index", f"--config={args.config}", f"--workdir={workdir}", *overrides]
    )
    summary = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    import jax  # noqa: PLC0415  (after the subprocesses: this process holds no device while they run)

    dev = jax.devices()[0]
    row = {
        "bench": "build_index",
        "config": args.config,
        "train_steps": args.train_steps,
        "train_wall_s": train_s,
        **summary,
        "wall_s": wall,
        "tokens_per_s_wall": summary.get("tokens", 0) / wall,
        "device": f"{dev.platform}:{dev.device_kind} x{jax.device_count()}",
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
