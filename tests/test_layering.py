"""The package's import layering: every import goes down the list `LAYERS`, never up or sideways.

Read from the source with `ast` (nothing is imported), counting imports inside functions too:
a lazy import is still a dependency. `trackstar_jax/__init__.py` (the version string) may be
imported from anywhere.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "trackstar_jax"

# Bottom to top. A package (a sub-package, or a top-level module such as `config.py`) imports
# only the packages of lower layers; packages in one layer do not import each other.
# `config` is the composition root: it sits above every role (each owns its section's type,
# which config re-exports and composes into `Settings`), below the planner and the stages.
LAYERS = (
    ("files",),  # atomic files, workdir locks, ConfigError
    ("distributed",),  # mesh, shardings, runtime, multi-host steps (its stage lock: files)
    ("data",),  # corpora, tokenizers, batches (token ids: data.tokenizer)
    ("models",),  # the LM family, HF / GGUF loaders
    ("features", "methods"),  # gradient vectors; the table's row presets
    ("training",),  # step, loop, checkpoints, a released model's loading
    ("index",),  # store, builder, R, scoring
    ("retrieval",),  # exact top-k, the retrieve stage's work
    ("evaluation",),  # queries, metrics, tail-patch, row kinds, LDS
    ("serving",),  # the explorer
    ("config",),  # the typed settings: the composition root
    ("plan",),  # the resource planner
    ("stages",),  # the stage entry points, `open_run`
)
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module: str) -> str | None:
    """`trackstar_jax.index.store` -> "index"; `trackstar_jax.config` -> "config"; the root -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == PACKAGE else None


def _imported_modules(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`; `from a import b` gives `a.b`
    (b may be a module or a name: both sit in a's package, or b is a's sub-package)."""
    me = _module_name(path, root).split(".")
    here = me if path.name == "__init__.py" else me[:-1]  # the package relative imports start from
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}" if base else a.name) for a in node.names]
    return out


def _is_package(name: str) -> bool:
    return (ROOT / PACKAGE / f"{name}.py").exists() or (ROOT / PACKAGE / name / "__init__.py").exists()


def _upward_imports() -> list[str]:
    """`path:line (pkg, layer i) imports module (pkg, layer j)` for every import with j >= i."""
    bad = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        src = _package_of(_module_name(path))
        if src is None:  # the root's __init__
            continue
        for line, name in _imported_modules(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if name.split(".")[0] in ("launch", "experiments", "benchmarks", "notebooks", "tests"):
                bad.append(f"{where} imports {name} (the library imports no entry point or test)")
                continue
            dst = _package_of(name)
            if dst is None or dst == src or not _is_package(dst):
                continue  # another library, its own package, or a name of the root (`__version__`)
            if LAYER_OF.get(dst, len(LAYERS)) >= LAYER_OF.get(src, -1):
                bad.append(
                    f"{where} ({src}, layer {LAYER_OF.get(src)}) imports {name} ({dst}, layer {LAYER_OF.get(dst)})"
                )
    return bad


def test_every_package_has_a_layer():
    packages = {p.stem for p in (ROOT / PACKAGE).iterdir() if p.suffix == ".py" and p.stem != "__init__"}
    packages |= {p.name for p in (ROOT / PACKAGE).iterdir() if (p / "__init__.py").exists()}
    missing = sorted(packages - set(LAYER_OF))
    assert not missing, f"place these packages in tests/test_layering.py LAYERS: {missing}"
    assert not set(LAYER_OF) - packages, f"LAYERS names packages that do not exist: {set(LAYER_OF) - packages}"


def test_imports_only_go_down():
    bad = _upward_imports()
    assert not bad, "imports that go up or sideways in LAYERS:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source, expect",
    [
        ("from trackstar_jax.training import step\n", "trackstar_jax.training.step"),
        ("from trackstar_jax import config as c\n", "trackstar_jax.config"),
        ("def f():\n    import trackstar_jax.index.store\n", "trackstar_jax.index.store"),
        ("from ..training import step\n", "trackstar_jax.training.step"),
    ],
)
def test_the_scanner_sees_every_import_form(tmp_path, source, expect):
    """Absolute, aliased, function-local and relative imports are all found (else the test above passes vacuously)."""
    pkg = tmp_path / PACKAGE / "models"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(source)
    assert [name for _, name in _imported_modules(pkg / "x.py", tmp_path)] == [expect]


def test_the_package_and_launchers_import_without_optional_packages():
    """A base install (no `hf`, `gguf`, `serve`, `seqio` extras) imports every role package and the
    launchers: optional packages are imported where they are used (models/hf.py imported
    safetensors at module level once the architecture registry made every import reach it)."""
    import subprocess
    import sys

    optional = ("safetensors", "tokenizers", "gguf", "starlette", "uvicorn", "seqio", "torch", "transformers")
    code = (
        "import sys\n"
        f"for name in {optional!r}:\n"
        "    sys.modules[name] = None  # import of it raises ImportError\n"
        "import trackstar_jax.config, trackstar_jax.models, trackstar_jax.features, trackstar_jax.index\n"
        "import trackstar_jax.retrieval, trackstar_jax.training, trackstar_jax.evaluation\n"
    )
    for launcher in ("train", "evaluate"):  # each defines the same absl flags: one per process
        res = subprocess.run(
            [sys.executable, "-c", code + f"import launch.{launcher}\n"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-3000:]
