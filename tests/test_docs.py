"""Every fenced code block in README.md and docs/*.md is run or checked, so the documents stay true.

Info-string convention (the first word is the language, so GitHub still highlights it):

- ```python               run in a fresh namespace, in a temporary working directory.
- ```python fixture=run   run the same way with `workdir` (a `pathlib.Path`) bound to a trained and
                          indexed tiny run (`_run` below: tests' sizes, not the quickstart's).
- ```bash run             run: each command from the repository root, `python` being this
                          interpreter; it must exit 0 within `RUN_TIMEOUT_S`.
- ```bash                 checked, not run. Every command must be one the checker knows:
                          `python -m launch.<stage>`: the module exists, every `--flag` is defined
                          by it (or by the `launch/_*.py` it imports), its required flags are given,
                          and `--config=<file>[:arg]` with its `--config.<section>.<key>=` overrides
                          loads and converts to typed `Settings` exactly as the launcher would
                          (nothing else runs); `python -m benchmarks.<name>`: the module exists and
                          names each `--flag`; `python -m pytest <paths>`: the paths exist; `python -m experiments.<m>`: the module exists;
                          `bash` / `source <file>`: the file exists; `pip install -e '.[extra]'`:
                          the extras exist in setup.cfg. Leading `VAR=value` assignments are
                          skipped; `\\` continues a line; `#` starts a comment.
- ```bash no-run: <reason> neither run nor checked; the reason is required (also ```python no-run: <reason>).
- ```text                 a diagram or a sample of output: not code.

Any other info string fails, so that a new block has to choose one of these.
"""

import ast
import configparser
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from absl import flags
from conftest import tiny_run_config
from ml_collections import config_flags

from trackstar_jax import config as config_lib
from trackstar_jax import stages

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_TIMEOUT_S = 120
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```\s*$", re.M | re.S)


def _blocks() -> list:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            info = m.group("info").strip()
            out.append(pytest.param(path, line, info, m.group("body"), id=f"{path.name}:{line}"))
    return out


BLOCKS = _blocks()


def _kind(info: str) -> str:
    if info in ("python", "python fixture=run"):
        return info
    if info in ("bash", "bash run", "text"):
        return info
    if re.fullmatch(r"(bash|python) no-run: \S.*", info):
        return "bash no-run"
    raise AssertionError(f"unknown info string {info!r}: use one of those in tests/test_docs.py's docstring")


# ---------------------------------------------------------------------------------------
# Shell commands: split, then check against the real launchers
# ---------------------------------------------------------------------------------------


def _commands(body: str) -> list[list[str]]:
    """The block's commands as argv lists (continuations joined, comments and env prefixes dropped)."""
    joined = re.sub(r"\\\n", " ", body)
    out = []
    for line in joined.splitlines():
        for part in re.split(r"\s&&\s|;\s", line):
            argv = shlex.split(part, comments=True)
            while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                argv = argv[1:]
            if argv:
                out.append(argv)
    return out


def _flags_defined(module: pathlib.Path) -> tuple[set[str], set[str]]:
    """(flag names, required flag names) a launcher defines, read from its source and its
    `launch/_*.py` helpers (tests never import launchers: absl flags are process-global)."""
    names, required = set(), set()
    sources = [module]
    tree = ast.parse(module.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "launch":
            sources += [REPO / "launch" / f"{a.name}.py" for a in node.names if a.name.startswith("_")]
    for src in sources:
        for node in ast.walk(ast.parse(src.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr.startswith("DEFINE_") and node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
            if node.func.attr == "mark_flags_as_required" and src == module:
                required |= {e.value for e in node.args[0].elts}
    return names, required


def _parse_config(argv: list[str]) -> config_lib.Settings:
    """`--config` and its overrides parsed by ml_collections as the launcher parses them, then typed."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return config_lib.from_configdict(fv["config"].value, source=config_flags.get_config_filename(fv["config"]))


def _check_launcher(argv: list[str]) -> None:
    module = REPO / "launch" / f"{argv[2].split('.', 1)[1]}.py"
    assert argv[2].startswith("launch.") and module.is_file(), f"no launcher {argv[2]}"
    names, required = _flags_defined(module)
    given = set()
    for arg in argv[3:]:
        assert arg.startswith("--"), f"{argv[2]}: positional argument {arg!r} (launchers take flags only)"
        name = arg[2:].split("=", 1)[0]
        if name.startswith("config."):
            continue
        if name not in names and name.startswith("no") and name[2:] in names:
            name = name[2:]
        assert name in names, f"{argv[2]} defines no flag --{name} (it defines {sorted(names)})"
        given.add(name)
    assert required <= given, f"{argv[2]}: required flags missing: {sorted(required - given)}"
    if "config" in given:
        path = next(a for a in argv if a.startswith("--config="))[len("--config=") :].split(":")[0]
        assert (REPO / path).is_file(), f"no config file {path}"
        _parse_config(["launch"] + [a for a in argv[3:] if a.startswith("--config")])


def _check_benchmark(argv: list[str]) -> None:
    module = REPO / "benchmarks" / f"{argv[2].split('.', 1)[1]}.py"
    assert module.is_file(), f"no benchmark {argv[2]}"
    src, (absl_names, _) = module.read_text(), _flags_defined(module)  # argparse or absl flags
    for arg in argv[3:]:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            assert f'"{flag}"' in src or flag[2:] in absl_names, f"{argv[2]} has no option {flag}"


def _extras() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return set(cfg["options.extras_require"])


def _check_command(argv: list[str]) -> None:
    if argv[0] == "python" and argv[1:2] == ["-m"]:
        target = argv[2]
        if target.startswith("launch."):
            return _check_launcher(argv)
        if target.startswith("benchmarks."):
            return _check_benchmark(argv)
        if target.startswith("experiments."):
            path = REPO / pathlib.Path(*target.split("."))
            assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"no module {target}"
            return None
        if target == "pytest":
            for arg in argv[3:]:
                if not arg.startswith("-") and "/" in arg:
                    assert (REPO / arg.split("::")[0]).exists(), f"pytest path {arg} does not exist"
            return None
    if argv[0] in ("bash", "source"):
        assert (REPO / argv[1]).is_file(), f"{argv[1]} does not exist"
        return None
    if argv[:2] == ["pip", "install"]:
        for arg in argv[2:]:
            m = re.fullmatch(r"\.\[(.*)\]", arg)
            if m:
                missing = set(m.group(1).split(",")) - _extras()
                assert not missing, f"setup.cfg has no extra {sorted(missing)}"
        return None
    raise AssertionError(f"the checker does not know {' '.join(argv)!r}: mark the block `bash no-run: <reason>`")


# ---------------------------------------------------------------------------------------
# The run that `fixture=run` blocks see
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def _run(tiny_run):
    """A trained tiny run with its index built (a few seconds of training at tests' sizes)."""
    config = tiny_run_config(num_facts=12, num_distractors=12, num_steps=20, chunk_rows=32)
    workdir = tiny_run(config, index=True)
    stages.build_index(config_lib.from_configdict(config), workdir)
    return workdir


# ---------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------


def test_the_documents_have_code_blocks():
    assert (REPO / "docs").is_dir() and len(DOCS) >= 2
    kinds = {_kind(info) for _, _, info, _ in (p.values for p in BLOCKS)}
    assert {"python fixture=run", "bash", "bash run"} <= kinds


@pytest.mark.parametrize("path, line, info, body", BLOCKS)
def test_code_block(path, line, info, body, request, tmp_path, monkeypatch):
    kind = _kind(info)
    where = f"{path.relative_to(REPO)}:{line}"
    if kind in ("text", "bash no-run"):
        return
    if kind.startswith("python"):
        ns = {"__name__": "__docs__"}
        if kind == "python fixture=run":
            ns["workdir"] = request.getfixturevalue("_run")
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(REPO))  # `from experiments import ...` as from the repo root
        exec(compile(body, where, "exec"), ns)
        return
    commands = _commands(body)
    assert commands, f"{where}: an empty block"
    for argv in commands:
        if kind == "bash":
            try:
                _check_command(argv)
            except Exception as e:
                raise AssertionError(f"{where}: {' '.join(argv)}: {type(e).__name__}: {e}") from e
        else:
            cmd = [sys.executable if a == "python" and i == 0 else a for i, a in enumerate(argv)]
            env = {**os.environ, "PYTHONPATH": str(REPO), "TRACKSTAR_COMPILATION_CACHE": "off"}
            env.pop("XLA_FLAGS", None)  # the tests' 8 fake devices are not the user's machine
            res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            assert res.returncode == 0, f"{where}: {' '.join(argv)} exited {res.returncode}:\n{res.stderr[-3000:]}"


# The lines of `plan.summary` (and `launch.plan`'s warnings) on stderr, as a document quotes them.
PLAN_LINE = re.compile(
    r"^(model|mesh|parameters|index \(|featurize \(|retrieval|peak memory per device|cannot run as configured|WARNING)"
)
# The lines `--nocompile` leaves out: they come from the compiled steps.
COMPILED_LINE = re.compile(r"^(peak memory per device|cannot run as configured|WARNING)")


def _documented_plans() -> list:
    """Each documented `python -m launch.plan` command whose block is followed at once by a
    ```text block of what it prints (its `plan.summary` lines): `(argv, printed lines)`."""
    out = []
    for path in DOCS:
        text = path.read_text()
        fences = list(FENCE.finditer(text))
        for m, nxt in zip(fences, fences[1:]):
            if not m.group("info").startswith("bash") or "launch.plan" not in m.group("body"):
                continue
            if nxt.group("info").strip() != "text" or text[m.end() : nxt.start()].strip():
                continue
            lines = [x for x in nxt.group("body").splitlines() if x.strip()]
            for argv in _commands(m.group("body")):
                if argv[:3] == ["python", "-m", "launch.plan"]:
                    line = text.count("\n", 0, m.start()) + 1
                    out.append(pytest.param(argv, lines, id=f"{path.name}:{line}"))
    return out


def _plan_prints(argv: list[str], *extra: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRACKSTAR_COMPILATION_CACHE": "off", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # its own --fake_devices
    res = subprocess.run(
        [sys.executable, "-m", "launch.plan", *argv[3:], *extra], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return [x for x in res.stderr.splitlines() if PLAN_LINE.match(x)]


def test_the_paper_scale_plan_is_documented_with_its_output():
    assert any("paper_8b.py" in " ".join(p.values[0]) for p in _documented_plans())


@pytest.mark.parametrize("argv, documented", _documented_plans())
def test_a_documented_plan_prints_its_documented_figures(argv, documented):
    """The arithmetic lines (parameters, index, featurize and retrieval time) of a documented
    `launch.plan` command are what it prints now (`--nocompile`: seconds)."""
    assert all(PLAN_LINE.match(x) for x in documented), documented
    assert _plan_prints(argv, "--nocompile") == [x for x in documented if not COMPILED_LINE.match(x)]


@pytest.mark.slow
@pytest.mark.parametrize("argv, documented", _documented_plans())
def test_a_documented_plan_prints_its_documented_memory(argv, documented):
    """The whole documented output, the compiled steps' memory and warnings included (the 8B plan
    compiles for minutes)."""
    assert _plan_prints(argv) == documented


def test_the_checker_refuses_what_is_wrong():
    """The static check fails on a misspelt key, an unknown flag, a missing launcher or file."""
    for bad in (
        "python -m launch.train --config=experiments/tiny.py --workdir=x --config.train.lr=3",
        "python -m launch.train --config=experiments/tiny.py --workdir=x --config.vectors.output_fn=nope",
        "python -m launch.train --config=experiments/tiny.py --work_dir=x",
        "python -m launch.train --config=experiments/tiny.py",
        "python -m launch.trian --config=experiments/tiny.py --workdir=x",
        "python -m launch.train --config=experiments/nope.py --workdir=x",
        "python -m benchmarks.featurize --nope=1",
        "bash launch/nope.sh",
        "pip install -e .[nope]",
        "rm -rf runs",
    ):
        with pytest.raises((AssertionError, AttributeError, ValueError, flags.Error)):
            for argv in _commands(bad):
                _check_command(argv)
    for good in (
        "WORKDIR=/tmp/x python -m launch.evaluate --config=experiments/trex_lds.py:gpu --workdir=x --notrain "
        "--config.mesh.shape='(2,4,1)' --config.eval.methods='(\"bm25\",\"trackstar\")'",
        "python -m launch.train --config=experiments/tiny.py --workdir=x --distributed --process_id=1",
    ):
        for argv in _commands(good):
            _check_command(argv)


def test_configuration_md_is_generated_from_the_current_config():
    """docs/configuration.md equals what tools/gen_config_doc.py makes from the typed config now."""
    spec = importlib.util.spec_from_file_location("gen_config_doc", REPO / "tools" / "gen_config_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    for key in ("`model.arch`", "`vectors.proj_dim`", "`data.embedded.num_facts`", "`validate.parallel_subsets`"):
        assert key in text
    assert (REPO / "docs" / "configuration.md").read_text() == text, "stale: run `python tools/gen_config_doc.py`"
