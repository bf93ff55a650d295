"""Scale curve (issue 14): the whole pipeline on corpora of 10^4, 10^5 and 10^6 examples.

    nohup nice -n 10 python -m benchmarks.scale_curve --out=/work/runs/pod14/scale \\
        --sizes=10000,100000,1000000 > /work/runs/pod14/scale/log.txt 2>&1 &

Per size, a text corpus of `n` passages is written: the LAMA T-REx sentences
(`--lama=../shared/data/lama`, 62,242 distinct ones, `[MASK]` -> object), then, past them,
generated passages (two LAMA sentences picked by a seeded generator and joined: real words,
repeated material; said in every JSON line as `generated_examples`). Then each stage runs as
its own launcher process (`launch.train`, `launch.build_index`, `launch.retrieve`) with
`experiments/tiny.py` (the run's model is trained on that corpus for `--train_steps` steps)
and the same overrides at every size (vocabulary 4096 for LAMA's characters), and we record its wall time, its own peak RSS (VmHWM), and
the bytes it leaves on disk. Finally the retrieval of one query batch of 1 query is timed
in this process over the stored index (streamed from disk, page cache warm; chunk files read
directly and, side by side, every read through tensorstore) and over the
rows resident in memory, next to the memory-bandwidth bound of the same bytes
(`jit(jnp.sum)` over the resident rows, as `benchmarks/retrieve.py` measures it).

A finished stage leaves `<out>/n<size>/<stage>.json` and is skipped by a rerun (the
launchers themselves resume an interrupted train or index build), so the run can be
restarted at any point. One JSON line per stage and one summary line per size.
"""

import gzip
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from trackstar_jax import config as config_lib
from trackstar_jax.index import scoring as scoring_lib
from trackstar_jax.index import store as store_lib
from trackstar_jax.retrieval import topk

_OUT = flags.DEFINE_string("out", "/work/runs/pod14/scale", "Output folder (one sub-folder per size).")
_SIZES = flags.DEFINE_list("sizes", ["10000", "100000", "1000000"], "Corpus sizes (examples).")
_LAMA = flags.DEFINE_string("lama", str(pathlib.Path(__file__).resolve().parents[2] / "shared/data/lama"), "LAMA dir.")
_STEPS = flags.DEFINE_integer("train_steps", 200, "Training steps of the tiny model per size.")
_QUERIES = flags.DEFINE_integer("queries", 64, "Queries of the retrieve stage (one batch).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Repeats of the timed single-query retrievals (minimum kept).")

REPO = pathlib.Path(__file__).resolve().parents[1]
# The same overrides at every size: 1024-row index chunks (1 chunk file per 1024 examples),
# featurize batches of 128, 64K-row retrieval reads, bfloat16 rows (d = 256), few held-out.
OVERRIDES = {
    "data.source": "text",
    "model.vocab_size": 4096,  # LAMA has 2,349 distinct characters; tiny's 512 pieces cannot hold them
    "data.eval_fraction": 0.002,
    "index.chunk_rows": 1024,
    "vectors.batch_size": 128,
    "retrieval.read_chunk_rows": 65536,
    "retrieval.query_batch_size": 64,
    "retrieval.top_k": 10,
    "retrieval.overwrite": True,
    "train.log_every_steps": 100,
    "train.eval_every_steps": 100_000,
    "train.checkpoint_every_steps": 100_000,
    "train.num_completions": 0,
    "train.max_fact_prompts": 0,
}


def lama_sentences(path: pathlib.Path) -> list[str]:
    """Distinct LAMA T-REx evidence sentences, `[MASK]` replaced by the object, in file order."""
    seen, out = set(), []
    for f in sorted((path / "TREx").glob("P*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                for ev in rec.get("evidences", []):
                    s = " ".join(ev["masked_sentence"].replace("[MASK]", ev["obj_surface"]).split())
                    if s and s not in seen:
                        seen.add(s)
                        out.append(s)
    return out


def write_corpus(directory: pathlib.Path, n: int, sents: list[str]) -> int:
    """`corpus.txt` with `n` distinct passages; returns how many were generated."""
    rng = np.random.default_rng(n)
    real = sents[:n]
    lines, seen = list(real), set(real)
    while len(lines) < n:
        i, j = rng.integers(len(sents), size=2)
        s = f"{sents[i]} {sents[j]}"
        if s not in seen:
            seen.add(s)
            lines.append(s)
    (directory / "text").mkdir(parents=True, exist_ok=True)
    (directory / "text" / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    queries = []
    short = [s for s in sents if len(s) <= 60 and len(s.split()) >= 4]  # fit tiny's 64 tokens
    for s in short[: _QUERIES.value]:  # prompt = the sentence but its last word, target = that word
        words = s.rstrip(" .").split(" ")
        queries.append({"prompt": " ".join(words[:-1]), "target": " " + words[-1]})
    (directory / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    return len(lines) - len(real)


def dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# Runs a module as __main__ and, at exit, writes the process's own peak RSS (VmHWM, KiB) to a file.
# wait4's ru_maxrss would not do: Linux keeps the forked copy's high-water mark across exec, so
# every child reports at least this (corpus-holding, jax-importing) process's RSS at fork.
_RSS_WRAPPER = """
import atexit, pathlib, runpy, sys
out, mod = sys.argv.pop(1), sys.argv.pop(1)
def _hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            pathlib.Path(out).write_text(line.split()[1])
atexit.register(_hwm)
sys.argv[0] = mod
runpy.run_module(mod, run_name="__main__", alter_sys=True)
"""


def run_stage(name: str, workdir: pathlib.Path, size_dir: pathlib.Path) -> dict:
    """Runs `python -m launch.<name>` as a child; wall time, its own peak RSS (VmHWM), CPU time."""
    flags_ = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
    flags_ += [f"--config.data.path={size_dir / 'text'}", f"--config.train.num_steps={_STEPS.value}"]
    if name == "retrieve":
        flags_ += [f"--config.retrieval.queries={size_dir / 'queries.jsonl'}", "--config.retrieval.output=scale"]
    hwm = size_dir / f"{name}.vmhwm"
    args = [sys.executable, "-c", _RSS_WRAPPER, str(hwm), f"launch.{name}", "--config=experiments/tiny.py"]
    args += [f"--workdir={workdir}", *flags_]
    log = open(size_dir / f"{name}.log", "w")  # noqa: SIM115
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    log.close()
    if status != 0:
        tail = (size_dir / f"{name}.log").read_text()[-3000:]
        raise RuntimeError(f"launch.{name} failed (status {status}); log tail:\n{tail}")
    return {
        "stage": name,
        "seconds": wall,
        "peak_rss_mib": int(hwm.read_text()) / 1024,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
    }


def single_query_retrieval(workdir: pathlib.Path) -> dict:
    """One query over the stored index: streamed from disk and resident, vs the bandwidth bound."""
    settings = config_lib.load_run_settings(workdir)
    reader = store_lib.open_index(workdir / "index")
    hcfg = settings.replace({"hessian.mode": "train"}).hessian  # R_train only: needs no query set
    scoring = scoring_lib.prepare_scoring(reader, hcfg)  # one more pass over the index (its own cache key)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, reader.dim)).astype(np.float32)
    rows, _ = reader.read_block(0, reader.num_rows)
    nbytes = rows.nbytes
    dev_rows = jax.device_put(rows)
    scale = jax.device_put(scoring.row_scale)
    sum_fn = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    ts_reader = store_lib.open_index(workdir / "index", direct=False)  # every read through tensorstore
    times = {"stream": [], "stream_tensorstore": [], "resident": [], "sum_probe": []}
    for _ in range(_REPEATS.value + 1):  # the first round compiles
        t0 = time.perf_counter()
        topk.stream_topk(q, reader, 10, 65536, row_scale=scoring.row_scale)
        t1 = time.perf_counter()
        topk.stream_topk(q, ts_reader, 10, 65536, row_scale=scoring.row_scale)
        t2 = time.perf_counter()
        topk.topk(q, dev_rows, 10, row_scale=scale)
        t3 = time.perf_counter()
        sum_fn(dev_rows).block_until_ready()
        t4 = time.perf_counter()
        for key, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[key].append(v)
    best = {k: min(v[1:]) for k, v in times.items()}
    return {
        "index_bytes_resident": nbytes,
        "direct_reads": reader._direct,
        "stream_seconds": best["stream"],
        "stream_tensorstore_seconds": best["stream_tensorstore"],
        "resident_seconds": best["resident"],
        "bound_seconds": best["sum_probe"],
        "probe_gb_per_s": nbytes / best["sum_probe"] / 1e9,
        "stream_over_bound": best["stream"] / best["sum_probe"],
        "stream_tensorstore_over_bound": best["stream_tensorstore"] / best["sum_probe"],
        "resident_over_bound": best["resident"] / best["sum_probe"],
    }


def main(argv):
    del argv
    out = pathlib.Path(_OUT.value)
    sents = None
    for n in [int(s) for s in _SIZES.value]:
        size_dir = out / f"n{n}"
        summary_file = size_dir / "summary.json"
        if summary_file.exists():
            print(summary_file.read_text().strip(), flush=True)
            continue
        size_dir.mkdir(parents=True, exist_ok=True)
        workdir = size_dir / "run"
        meta_file = size_dir / "corpus.json"
        if not meta_file.exists():
            sents = sents or lama_sentences(pathlib.Path(_LAMA.value))
            generated = write_corpus(size_dir, n, sents)
            meta_file.write_text(
                json.dumps({"lines": n, "lama_sentences": len(sents), "generated_examples": generated})
            )
        meta = json.loads(meta_file.read_text())
        stages = {}
        for name in ("train", "build_index", "retrieve"):
            f = size_dir / f"{name}.json"
            if not f.exists():
                f.write_text(json.dumps(run_stage(name, workdir, size_dir)))
            stages[name] = json.loads(f.read_text())
            print(json.dumps({"kind": "stage", "n": n, **stages[name]}), flush=True)
        rows = store_lib.open_index(workdir / "index").num_rows
        man = json.loads((workdir / "retrieval" / "scale.manifest.json").read_text())
        single = single_query_retrieval(workdir)
        summary = {
            "kind": "size",
            "n": n,
            "index_rows": rows,
            "generated_examples": meta["generated_examples"],
            "lama_examples": n - meta["generated_examples"],
            "seconds": {k: round(v["seconds"], 2) for k, v in stages.items()},
            "peak_rss_mib": {k: round(v["peak_rss_mib"], 1) for k, v in stages.items()},
            "index_examples_per_s": rows / stages["build_index"]["seconds"],
            "bytes_on_disk": {
                "corpus_txt": dir_bytes(size_dir / "text"),
                "run_corpus": dir_bytes(workdir / "corpus"),
                "index": dir_bytes(workdir / "index"),
                "checkpoints": dir_bytes(workdir / "checkpoints"),
            },
            "retrieve_stage": {
                k: man.get(k) for k in ("num_queries", "featurize_seconds", "scoring_prep_seconds", "retrieval_seconds")
            },
            "one_query": single,
            "device": str(jax.devices()[0]),
            "load_avg": os.getloadavg(),
        }
        summary_file.write_text(json.dumps(summary))
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
