"""config.data.source="seqio" (trackstar_jax/data/seqio_source.py, docs/seqio.md).

Default suite (no seqio): the missing extra stops with the install command; the reading rules
(Mixture = its Tasks with a rate > 0 in order, `_pretokenized` / vocabulary-decoded text, clear
errors) on a stand-in `seqio` module. `-m slow`: the real thing in a side virtualenv
(`.venv-seqio`, or $TRACKSTAR_SEQIO_VENV) built from the `seqio` extra: the demo Mixture of
experiments/seqio_demo trained twice, indexed and retrieved by the launchers, then checked
against `task.get_dataset` by experiments/seqio_demo/check.py.
"""

import json
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from trackstar_jax import config as config_lib
from trackstar_jax import data

REPO = pathlib.Path(__file__).resolve().parents[1]


def seqio_cfg(**kw):
    return config_lib.section("data", {"source": "seqio", "seqio_task": "t", "eval_fraction": 0.0, **kw})


def test_without_seqio_names_the_extra_and_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "seqio", None)  # `import seqio` raises ImportError, installed or not
    with pytest.raises(ImportError) as e:
        data.build_corpus(seqio_cfg(), 0)
    msg = str(e.value)
    assert "config.data.source='seqio'" in msg and "`seqio` extra" in msg
    assert "pip install 'trackstar_jax[seqio]'" in msg and "pip install -e '.[seqio]'" in msg


# --- a stand-in seqio: the API surface seqio_source uses ----------------------------------


class FakeDataset:
    def __init__(self, examples):
        self.examples = examples

    def as_numpy_iterator(self):
        return iter(self.examples)


class FakeVocab:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


class FakeTask:
    def __init__(self, name, examples, splits=("train",), vocab=None):
        self.name, self.examples, self.splits = name, examples, splits
        self.output_features = {"text": types.SimpleNamespace(vocabulary=vocab)}
        self.calls = []

    def get_dataset(self, sequence_length, split, shuffle, seed, num_epochs):
        self.calls.append({"split": split, "shuffle": shuffle, "seed": seed, "num_epochs": num_epochs})
        return FakeDataset(self.examples)


class FakeMixture:
    def __init__(self, rates):
        self.rates = rates
        self.tasks = sorted(rates, key=lambda t: t.name)

    def get_rate(self, task):
        return self.rates[task]


def fake_seqio(monkeypatch, providers):
    m = types.ModuleType("seqio")
    m.Task = FakeTask
    m.TaskRegistry = types.SimpleNamespace(names=lambda: [n for n, p in providers.items() if isinstance(p, FakeTask)])
    m.MixtureRegistry = types.SimpleNamespace(
        names=lambda: [n for n, p in providers.items() if isinstance(p, FakeMixture)]
    )
    m.get_mixture_or_task = providers.__getitem__
    monkeypatch.setitem(sys.modules, "seqio", m)


def test_mixture_reads_each_task_with_a_rate_once_in_task_order(monkeypatch):
    ids = np.array([5, 6, 1], np.int32)
    b = FakeTask(
        "b", [{"text": ids, "text_pretokenized": b"beta one"}, {"text": ids, "text_pretokenized": b"beta two"}]
    )
    a = FakeTask("a", [{"text": np.array(b"alpha")}])
    dev = FakeTask("c_dev", [{"text": b"only validation"}], splits=("validation",))
    off = FakeTask("d_off", [{"text": b"never sampled"}])
    fake_seqio(monkeypatch, {"mix": FakeMixture({b: 3.0, a: 1.0, dev: 1.0, off: 0.0}), "a": a, "b": b})
    c = data.build_corpus(seqio_cfg(seqio_task="mix"), 7)
    assert c.texts == ["alpha", "beta one", "beta two"]
    assert c.name == "seqio:mix/train"
    assert [t["task"] for t in c.info["seqio"]["tasks"]] == ["a", "b"]
    assert [t["text_from"] for t in c.info["seqio"]["tasks"]] == [["string"], ["pretokenized"]]
    # unshuffled, one epoch, the run seed fixed for stochastic preprocessors
    assert b.calls == [{"split": "train", "shuffle": False, "seed": 7, "num_epochs": 1}]
    assert data.build_corpus(seqio_cfg(seqio_task="mix", max_examples=2), 7).texts == ["alpha", "beta one"]


def test_token_ids_without_pretokenized_copy_are_decoded_with_the_task_vocabulary(monkeypatch):
    t = FakeTask("t", [{"text": np.array([3, 4], np.int32)}], vocab=FakeVocab())
    fake_seqio(monkeypatch, {"t": t})
    c = data.build_corpus(seqio_cfg(), 0)
    assert c.texts == ["w3 w4"] and c.info["seqio"]["tasks"][0]["text_from"] == ["decoded"]


def test_bad_task_split_or_feature_is_named(monkeypatch):
    t = FakeTask("t", [{"inputs": b"x"}])
    ids_only = FakeTask("ids", [{"text": np.array([1, 2], np.int32)}])
    fake_seqio(monkeypatch, {"t": t, "ids": ids_only})
    with pytest.raises(
        ValueError, match=r"seqio_task='nope' is not a registered seqio Task or Mixture.*\['ids', 't'\]"
    ):
        data.build_corpus(seqio_cfg(seqio_task="nope"), 0)
    with pytest.raises(ValueError, match=r"seqio_split='test': seqio Task t has splits \['train'\]"):
        data.build_corpus(seqio_cfg(seqio_split="test"), 0)
    with pytest.raises(
        ValueError, match=r"example 0 has no feature config.data.text_key='text' \(features: \['inputs'\]\)"
    ):
        data.build_corpus(seqio_cfg(), 0)
    with pytest.raises(ValueError, match="neither text nor token ids with a `text_pretokenized` copy"):
        data.build_corpus(seqio_cfg(seqio_task="ids"), 0)
    with pytest.raises(ImportError, match="seqio_module='no_such_tasks_module' cannot be imported"):
        data.build_corpus(seqio_cfg(seqio_module="no_such_tasks_module"), 0)


# --- the real seqio, in a side virtualenv (-m slow) ---------------------------------------


def seqio_venv() -> pathlib.Path:
    """Builds (or reuses) the side virtualenv with the `seqio` extra; skips, saying why, if pip fails."""
    venv = pathlib.Path(os.environ.get("TRACKSTAR_SEQIO_VENV", REPO / ".venv-seqio"))
    env = {**os.environ, "TRACKSTAR_VENV": str(venv)}
    p = subprocess.run(
        # `;`, not `&&`: errexit stays on inside the sourced script, so a failed pip writes no stamp
        ["bash", "-c", 'source launch/_venv.sh seqio; "$PY" -c "import seqio, tensorflow_text"'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if p.returncode:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-8:])
        pytest.skip(f"cannot build the seqio side virtualenv {venv} (launch/_venv.sh seqio):\n{tail}")
    return venv / "bin" / "python"


@pytest.mark.slow
def test_seqio_mixture_end_to_end_matches_seqio(tmp_path):
    py = seqio_venv()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRACKSTAR_SEQIO_DATA": str(tmp_path / "data")}
    env.pop("TRACKSTAR_VENV", None)

    def run(*args):
        p = subprocess.run([str(py), "-m", *args], cwd=REPO, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"{args}:\n{p.stderr[-3000:]}"
        return p.stdout

    run("experiments.seqio_demo.make_data", str(tmp_path / "data"))
    cfg = "--config=experiments/seqio_tiny.py"
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    run("launch.train", cfg, f"--workdir={a}")
    run("launch.train", cfg, f"--workdir={b}")
    run("launch.build_index", cfg, f"--workdir={a}")
    out = run("launch.retrieve", cfg, f"--workdir={a}", f"--config.retrieval.queries={tmp_path / 'data/queries.jsonl'}")
    assert json.loads(out.splitlines()[-1])["num_queries"] == 40
    got = json.loads(run("experiments.seqio_demo.check", str(a), str(b)).splitlines()[-1])
    # make_data: 40 facts x 3 phrasings + 40 distractors, all distinct; ~5% held out by text hash
    assert got["num_seqio_passages"] == 160 and got["num_examples"] + got["num_held_out"] == 160
    assert got["num_retrieval_records"] == 40
