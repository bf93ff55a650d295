"""evaluation.evaluate end to end on a tiny run, then notebooks/inspect_proponents.ipynb on its output.

Checks that can fail: table.json has every required field with intervals; BM25 ranks the
exact template passage first on the embedded corpus (MRR 1); the per-row means equal the
metrics recomputed from the written retrievals; a stored tail-patch delta equals a fresh
`tailpatch_pairs` call for that (query, proponent) pair; prediction mode queries the model's
own completions; the notebook executes headless (nbclient).
"""

import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_run_config

from trackstar_jax import config as config_lib
from trackstar_jax import data as data
from trackstar_jax import stages
from trackstar_jax.evaluation import embedding, metrics, report, results, tailpatch
from trackstar_jax.training import step as train

REPO = pathlib.Path(__file__).resolve().parents[1]
# The dense row runs end to end here when its model package is installed (launch/_venv.sh does).
METHODS = ("trex_gold", "bm25") + (("dense",) if embedding.is_available() else ()) + ("trackstar",)
REQUIRED = ("method", "mrr", "recall_at_10", "precision_at_10", "tailpatch_at_1", "tailpatch_at_10", "num_queries")


pytestmark = pytest.mark.usefixtures("compile_cache")


def _config():
    return tiny_run_config(
        num_facts=24,
        num_distractors=30,
        num_steps=10,
        chunk_rows=32,
        **{"eval.methods": METHODS, "eval.max_new_tokens": 4, "eval.num_examples_shown": 2, "tailpatch.batch_size": 8},
    )


@pytest.fixture(scope="module")
def evaluated(tiny_run):
    workdir = tiny_run(_config(), evaluate=True)
    table = stages.evaluate(config_lib.from_configdict(_config()), workdir)  # reads the shared evaluation
    return workdir, table


def test_table_has_every_row_field_and_interval(evaluated):
    workdir, table = evaluated
    on_disk = json.loads((workdir / "eval" / "table.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(table["rows"]))
    assert [r["method"] for r in table["rows"]] == list(METHODS)
    n = table["num_queries"]
    assert n == table["query_report"]["num_selected"] - table["query_report"]["num_empty_target"] > 0
    for r in table["rows"]:
        for k in REQUIRED:
            assert k in r, (r["method"], k)
        for k in REQUIRED[1:-1]:
            assert len(r[k + "_ci"]) == 2, (r["method"], k)
            if r[k] is not None:
                assert r[k + "_ci"][0] <= r[k] <= r[k + "_ci"][1]
        assert r["num_queries"] == n
    gold = table["rows"][0]
    assert gold["gold_attribution"] and gold["mrr"] is None and gold["tailpatch_at_1"] is not None
    md = (workdir / "eval" / "table.md").read_text()
    assert "| T-REx gold |" in md and "| TrackStar |" in md and "## Example queries" in md


def test_bm25_finds_the_template_passage(evaluated):
    """The embedded corpus states every fact in the form of template 0: BM25 ranks it first."""
    _, table = evaluated
    bm25 = next(r for r in table["rows"] if r["method"] == "bm25")
    assert bm25["mrr"] == pytest.approx(1.0) and bm25["recall_at_10"] == pytest.approx(1.0)


@pytest.mark.skipif("dense" not in METHODS, reason=f"model not installed: {embedding.INSTALL_COMMAND}")
def test_dense_row_end_to_end(evaluated):
    """evaluate's dense row: passage embeddings cached in the workdir, stating passages first."""
    workdir, table = evaluated
    dense = next(r for r in table["rows"] if r["method"] == "dense")
    assert dense["mrr"] >= 0.9 and dense["num_queries"] > 0
    assert any((workdir / "dense_embeddings").iterdir())
    rows = results.load_results(workdir).retrievals["dense"]
    assert all(x["proponent_scores"] == sorted(x["proponent_scores"], reverse=True) for x in rows)


def test_rows_equal_metrics_recomputed_from_retrievals(evaluated):
    workdir, table = evaluated
    res = results.load_results(workdir)
    for r in table["rows"]:
        rows = res.retrievals[r["method"]]
        if r["method"] != "trex_gold":
            mrr = [metrics.ground_truth_metrics(x["proponent_correct"])["mrr"] for x in rows if x["has_trex_sentence"]]
            assert r["mrr"] == pytest.approx(np.mean(mrr))
        tp10 = [np.mean(x["proponent_tailpatch"][:10]) for x in rows if x["proponent_tailpatch"]]
        assert r["tailpatch_at_10"] == pytest.approx(np.mean(tp10))
        for x, q in zip(rows, res.queries):
            assert x["inputs_plaintext"] == q.prompt and x["targets_plaintext"] == q.target
            assert x["proponent_correct"] == [i in set(q.entailing_ids) for i in x["proponent_ids"]]


def test_stored_tailpatch_equals_a_fresh_step(evaluated):
    workdir, _ = evaluated
    res = results.load_results(workdir)
    run = stages.load_run(workdir)
    row = res.retrievals["trackstar"][1]
    q = res.queries[1]
    pid = row["proponent_ids"][0]
    query = data.encode_query(run.tokenizer, q.prompt, q.target, run.model_cfg.max_len)
    t, _ = data.encode_example(run.tokenizer, run.corpus.texts[pid], run.model_cfg.max_len)
    prop = {"tokens": t, "loss_mask": np.r_[0, np.ones(len(t) - 1, np.int32)]}
    opt = train.make_optimizer(run.optimizer)
    fresh = jax.jit(tailpatch.tailpatch_pairs, static_argnames=("graphdef", "opt"))
    got = fresh(
        run.params,
        run.opt_state,
        {k: v[None] for k, v in prop.items()},
        {k: v[None] for k, v in query.items()},
        graphdef=run.graphdef,
        opt=opt,
    )
    np.testing.assert_allclose(float(got["delta_prob"][0]), row["proponent_tailpatch"][0], rtol=1e-3, atol=1e-7)


def test_gradient_rows_have_opponents_and_scores_sorted(evaluated):
    workdir, table = evaluated
    res = results.load_results(workdir)
    for m in ("trackstar",):
        for x in res.retrievals[m]:
            s = x["proponent_scores"]
            assert s == sorted(s, reverse=True) and len(s) == 10
            assert x["opponent_scores"] == sorted(x["opponent_scores"]) and x["opponent_scores"][0] <= s[-1]
    ts = next(r for r in table["rows"] if r["method"] == "trackstar")
    assert ts["scoring"]["whitening"]["mode"] == "mixed" and ts["scoring"]["whitening"]["unit_norm"]


def test_prediction_mode_queries_the_models_completion(evaluated):
    workdir, _ = evaluated
    c = _config()
    c.eval.query_mode = "prediction"
    c.eval.methods = ("bm25",)
    table = stages.evaluate(config_lib.from_configdict(c), workdir)
    res = results.load_results(workdir, "eval_prediction")
    assert (
        table["query_mode"] == "prediction"
        and report.eval_dir(config_lib.from_configdict(c), workdir).name == "eval_prediction"
    )
    for x in res.retrievals["bm25"]:
        assert x["targets_plaintext"] == " " + x["model_completion"]


def test_unknown_method_and_missing_template_errors(evaluated):
    workdir, _ = evaluated
    c = _config()
    c.eval.methods = ("bm26",)
    with pytest.raises(ValueError, match="unknown evaluation method 'bm26'"):
        stages.evaluate(config_lib.from_configdict(c), workdir)
    c = _config()
    c.eval.template_variant = 7
    with pytest.raises(ValueError, match="has no template variant 7"):
        stages.evaluate(config_lib.from_configdict(c), workdir)


def test_highlight_marks_whole_word_entities():
    html = results.highlight("Ann Lee was born in Paris; Parisian food <3", ["Ann Lee"], ["Paris"])
    assert html.count("<mark") == 2
    assert '<mark style="background:#cfe8ff">Ann Lee</mark>' in html
    assert '<mark style="background:#ffe3a8">Paris</mark>;' in html and "Parisian food &lt;3" in html


def _untimed(x):
    """table.json without its wall times (every `*seconds` key)."""
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if not k.endswith("seconds")}
    return [_untimed(v) for v in x] if isinstance(x, list) else x


def _index_names(x):
    """table.json with each `index` path cut to its folder name (a moved run's paths differ)."""
    if isinstance(x, dict):
        return {
            k: pathlib.Path(v).name if k == "index" and isinstance(v, str) else _index_names(v) for k, v in x.items()
        }
    return [_index_names(v) for v in x] if isinstance(x, list) else x


def _differences(a, b, at=""):
    """Paths of the leaves where `a` and `b` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{at}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{at}/{i}")]
    return [] if a == b else [f"{at}: {a!r} != {b!r}"]


def test_a_killed_evaluation_resumes_to_the_same_bytes(evaluated, tmp_path):
    """Killed mid tail-patch (the pair cache holds its first third of pairs and half a line;
    no table yet) and rerun: the retrieval files and table.json (timings aside) are the bytes of
    the uninterrupted evaluation's, although the pairs left are fewer than a whole batching."""
    workdir, _ = evaluated
    work = tmp_path / "run"
    shutil.copytree(workdir, work, symlinks=True)
    (cache,) = (work / "tailpatch_pairs").glob("*.jsonl")
    lines = cache.read_text().splitlines(keepends=True)
    cut = len(lines) // 3 + 1  # not a multiple of a call's pairs
    assert 8 < cut < len(lines)
    cache.write_text("".join(lines[:cut]) + lines[cut][:12])
    for f in ("table.json", "table.md"):
        (work / "eval" / f).unlink()
    stages.evaluate(config_lib.from_configdict(_config()), work)
    names = sorted(f.name for f in (workdir / "eval" / "retrievals").glob("*.jsonl"))
    assert names == sorted(f.name for f in (work / "eval" / "retrievals").glob("*.jsonl")) and len(names) >= 3
    for name in names:
        assert (work / "eval" / "retrievals" / name).read_bytes() == (
            workdir / "eval" / "retrievals" / name
        ).read_bytes()
    # the same run, moved (and the shared tiny run was evaluated in another folder before it was
    # copied here): the table names its index by absolute path, so compare the paths' last part
    whole = json.loads((workdir / "eval" / "table.json").read_text())
    again = json.loads((work / "eval" / "table.json").read_text())
    assert _differences(_untimed(_index_names(again)), _untimed(_index_names(whole))) == []


PAYLOAD = '<img src=x onerror="window.__pwned=(window.__pwned||0)+1">'


def _tampered(workdir: pathlib.Path, dst: pathlib.Path, numbers: bool = True) -> results.Results:
    """A copy of the evaluation whose every field the notebook shows holds `PAYLOAD` (query 0's
    relation and frequency, each row's first proponent and opponent, the rows' labels, a split's
    value); with `numbers`, the scores, tail-patch deltas and a metric too."""
    shutil.copytree(workdir / "eval", dst / "eval")
    qpath = dst / "eval" / "queries.jsonl"
    qs = [json.loads(x) for x in qpath.read_text().splitlines()]
    qs[0].update(relation=PAYLOAD, frequency=PAYLOAD)
    qpath.write_text("".join(json.dumps(q) + "\n" for q in qs))
    for f in (dst / "eval" / "retrievals").glob("*.jsonl"):
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        for kind in ("proponent", "opponent"):
            if f"{kind}_ids" in rows[0]:
                rows[0][f"{kind}_ids"][0] = rows[0][f"{kind}s"][0] = PAYLOAD
                if numbers:
                    rows[0][f"{kind}_scores"][0] = PAYLOAD
        if numbers:
            rows[0]["proponent_tailpatch"][0] = PAYLOAD
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tpath = dst / "eval" / "table.json"
    table = json.loads(tpath.read_text())
    for r in table["rows"]:
        r["label"] = PAYLOAD
        split = next(iter(r["by_bucket"].values()))
        r["by_bucket"] = {PAYLOAD: {**split, "mrr": PAYLOAD} if numbers else split}
    tpath.write_text(json.dumps(table))
    return results.load_results(dst)


def test_tampered_evaluation_is_escaped_in_the_notebook_html_and_markdown(evaluated, tmp_path):
    res = _tampered(evaluated[0], tmp_path)
    for kind in ("proponents", "opponents"):
        html = results.side_by_side_html(res, 0, k=3, kind=kind)
        assert "<img" not in html and "onerror=&quot;" in html
        assert html.count("&lt;img") >= 4  # relation, frequency, a label, an example id / score / text
    md = results.split_markdown(res, "by_bucket")
    assert "<img" not in md and "&lt;img" in md


def test_tampered_evaluation_runs_no_script_in_headless_chromium(evaluated, tmp_path):
    """The notebook's `side_by_side_html` of a tampered evaluation, opened in a real browser:
    the payload shows as text and its `onerror` never runs."""
    missing = [b for b in ("chromium", "chromedriver") if not shutil.which(b)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver)")
    pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    res = _tampered(evaluated[0], tmp_path, numbers=False)  # what markup alone does
    page = tmp_path / "notebook.html"
    body = "".join(results.side_by_side_html(res, 0, k=3, kind=kind) for kind in ("proponents", "opponents"))
    page.write_text(f"<!doctype html><meta charset=utf-8><body>{body}</body>", encoding="utf-8")
    opts = Options()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.get(page.as_uri())
        driver.execute_script("return new Promise(r => setTimeout(r, 500))")  # an onerror would have fired
        assert driver.execute_script("return window.__pwned === undefined")
        assert driver.find_elements(By.CSS_SELECTOR, "img, [onerror]") == []
        assert PAYLOAD in driver.find_element(By.TAG_NAME, "body").text
    finally:
        driver.quit()


def test_notebook_defaults_to_the_quickstarts_run_and_its_extra_exists():
    """A newcomer's first run is the quickstart's: the notebook reads it by default, and the
    `notebook` extra it documents installs its kernel and runners."""
    import configparser  # noqa: PLC0415
    import re  # noqa: PLC0415

    quickstart = re.search(r'WORKDIR="\$\{WORKDIR:-([^}]+)\}"', (REPO / "launch" / "quickstart.sh").read_text()).group(
        1
    )
    nb = (REPO / "notebooks" / "inspect_proponents.ipynb").read_text()
    assert f'os.environ.get(\\"TRACKSTAR_WORKDIR\\", \\"{quickstart}\\")' in nb
    assert "pip install -e '.[notebook]'" in nb and "TRACKSTAR_QUERY_ID" in nb
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    extra = cfg["options.extras_require"]["notebook"]
    assert all(pkg in extra for pkg in ("ipykernel", "nbclient", "jupyterlab"))


def test_notebook_runs_headless(evaluated):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    workdir, _ = evaluated
    nb = nbformat.read(REPO / "notebooks" / "inspect_proponents.ipynb", as_version=4)
    env = {"TRACKSTAR_WORKDIR": str(workdir), "TRACKSTAR_QUERY_ID": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel subprocess inherits them
    try:
        nbclient.NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
        ).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "<mark" in html and "TrackStar" in html
