"""serving: the proponent explorer's API equals `retrieve_queries`, refuses bad input with a 4xx
and keeps serving, never serves files outside the workdir; and the page works in headless
Chromium (skipped when chromium / chromedriver / selenium are not installed)."""

import json
import os
import shutil
import socket
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the serve extra (starlette, httpx) is not installed")
pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")

from starlette.testclient import TestClient  # noqa: E402

from trackstar_jax import config as config_lib  # noqa: E402
from trackstar_jax import methods as methods_lib  # noqa: E402
from trackstar_jax import training  # noqa: E402
from trackstar_jax.evaluation import rows  # noqa: E402
from trackstar_jax.index import build  # noqa: E402
from trackstar_jax.retrieval import stage as retrieval_stage  # noqa: E402
from trackstar_jax.serving import app as app_lib  # noqa: E402
from trackstar_jax.serving import engine as engine_lib  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compile")


def _config():
    from experiments import tiny

    c = tiny.get_config()
    c.data.embedded.num_facts = 12
    c.data.embedded.num_distractors = 30
    c.train.num_steps = 60
    c.train.warmup_steps = 10
    c.train.log_every_steps = c.train.eval_every_steps = c.train.checkpoint_every_steps = 60
    c.train.num_completions = 0
    c.train.max_new_tokens = 2
    c.index.chunk_rows = 32
    c.eval.max_new_tokens = 4
    return c


@pytest.fixture(scope="module")
def served(tmp_path_factory, fast_compile):
    """A tiny trained run with its default (TrackStar) index, an engine and a TestClient over it."""
    workdir = tmp_path_factory.mktemp("run")
    settings = config_lib.from_configdict(_config())
    training.train(settings, workdir)
    build.build_index(settings, workdir)
    engine = engine_lib.Engine(settings, workdir, dense=False)
    return settings, workdir, engine, TestClient(app_lib.make_app(engine))


def _fact(engine, i=0):
    """(prompt, target) from a corpus passage: all but its last word -> " last word"."""
    words = engine.run.corpus.texts[i].rstrip(". ").split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def test_methods_lists_indexed_rows_and_text_baselines(served):
    _, workdir, engine, client = served
    d = client.get("/api/methods").json()
    names = [m["name"] for m in d["methods"]]
    # TrackStar, Exp. 4 and Exp. 5 share the default (loss, corrected) index; the rest have none here.
    assert names == ["exp4", "exp5", "trackstar", "bm25"] and d["default"] == "trackstar"
    assert "no index" in d["skipped"]["exp2"] and d["skipped"]["dense"] == "disabled"
    assert d["num_passages"] == len(engine.run.corpus.texts)


@pytest.mark.parametrize("method", ["trackstar", "exp5"])  # R_eval from the query (mixed) / cached R_train
def test_query_equals_retrieve_queries(served, method):
    settings, workdir, engine, client = served
    prompt, target = _fact(engine, 3)
    r = client.post("/api/query", json={"prompt": prompt, "target": target, "k": 7, "method": method})
    assert r.status_code == 200, r.text
    got = r.json()
    ms = rows.method_settings(settings, methods_lib.METHODS[method])
    want, _ = retrieval_stage.retrieve_queries(
        engine.run, ms, workdir, [retrieval_stage.TextQuery(0, prompt, target)], k=7
    )
    want = want[0]
    assert got["record"] == want
    assert [p["example_id"] for p in got["proponents"]] == want["proponent_ids"]
    assert [p["score"] for p in got["proponents"]] == want["proponent_scores"]
    assert [p["text"] for p in got["proponents"]] == want["proponents"]
    assert [p["example_id"] for p in got["opponents"]] == want["opponent_ids"]
    assert got["target"] == target and got["completion"] is None and got["method"] == method and got["seconds"] > 0


def test_no_target_uses_the_models_completion(served):
    _, _, engine, client = served
    prompt, _ = _fact(engine, 0)
    got = client.post("/api/query", json={"prompt": prompt, "k": 3, "method": "bm25"}).json()
    assert got["completion"] == engine.complete(prompt) and got["target"] == got["completion"]
    assert len(got["proponents"]) == 3 and got["opponents"] == []


def test_bad_input_is_refused_and_the_server_keeps_serving(served):
    _, _, engine, client = served
    prompt, target = _fact(engine, 1)
    good = {"prompt": prompt, "target": target, "k": 5, "method": "trackstar"}
    long_prompt = " ".join(["word"] * (engine.run.model_cfg.max_len + 5))
    bad = [
        ({**good, "prompt": ""}, "prompt"),
        ({**good, "prompt": "   "}, "prompt"),
        ({**good, "prompt": long_prompt}, "max_len"),
        ({**good, "target": " "}, "target"),
        ({**good, "target": 3}, "target"),
        ({**good, "method": "nope"}, "method"),
        ({**good, "method": "exp2"}, "no index"),
        ({**good, "k": 0}, "k: must be an integer"),
        ({**good, "k": 10**6}, "k: must be an integer"),
        ({**good, "k": "5"}, "k: must be an integer"),
        ({**good, "extra": 1}, "unknown fields"),
    ]
    for body, match in bad:
        r = client.post("/api/query", json=body)
        assert r.status_code == 400 and match in r.json()["error"], (body, r.status_code, r.text)
    assert client.post("/api/query", content=b"{not json").status_code == 400
    assert client.post("/api/query", json=[1]).status_code == 400
    assert client.get("/api/query").status_code == 405
    r = client.post("/api/query", json=good)
    assert r.status_code == 200 and len(r.json()["proponents"]) == 5


def test_file_endpoint_reads_jsonl_and_refuses_paths_outside(served, tmp_path):
    _, workdir, engine, client = served
    prompt, target = _fact(engine, 2)
    rec = client.post("/api/query", json={"prompt": prompt, "target": target, "k": 4, "method": "trackstar"}).json()[
        "record"
    ]
    (workdir / "retrieval").mkdir(exist_ok=True)
    (workdir / "retrieval" / "mine.jsonl").write_text(json.dumps(rec) + "\n\n" + json.dumps(rec) + "\n")
    r = client.get("/api/file", params={"path": "retrieval/mine.jsonl"})
    assert r.status_code == 200 and r.json() == [rec, rec]
    (workdir / "retrieval" / "broken.jsonl").write_text(json.dumps(rec) + "\n{oops\n")
    r = client.get("/api/file", params={"path": "retrieval/broken.jsonl"})
    assert r.status_code == 400 and "retrieval/broken.jsonl:2" in r.json()["error"]
    outside = tmp_path / "secret.jsonl"
    outside.write_text(json.dumps(rec) + "\n")
    os.symlink(outside, workdir / "retrieval" / "link.jsonl")
    for path in (
        "../" * 3 + str(outside).lstrip("/"),
        str(outside),
        "retrieval/../../secret.jsonl",
        "retrieval/link.jsonl",
        "",
    ):
        r = client.get("/api/file", params={"path": path})
        assert r.status_code == 403, (path, r.status_code, r.text)
    assert client.get("/api/file", params={"path": "retrieval/none.jsonl"}).status_code == 404
    assert client.get("/api/file", params={"path": "config.json"}).status_code in (400, 404)
    assert client.get("/api/eval").status_code == 404  # no evaluation in this run
    assert (
        client.post("/api/query", json={"prompt": prompt, "target": target, "k": 2, "method": "bm25"}).status_code
        == 200
    )


def test_page_is_served(served):
    client = served[3]
    r = client.get("/")
    assert r.status_code == 200 and "/api/query" in r.text and "Export jsonl" in r.text


# ------------------------------------------------------------------------------------------
# Browser: the page in headless Chromium over a real uvicorn server
# ------------------------------------------------------------------------------------------


def _browser_or_skip():
    missing = [b for b in ("chromium", "chromedriver") if not shutil.which(b)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver)")
    pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
    pytest.importorskip("uvicorn", reason="uvicorn is not installed (the serve extra)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_page_in_headless_chromium(served, tmp_path):
    _browser_or_skip()
    import uvicorn
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    _, _, engine, client = served
    prompt, target = _fact(engine, 4)
    want = {
        m: [
            p["example_id"]
            for p in client.post("/api/query", json={"prompt": prompt, "target": target, "k": 5, "method": m}).json()[
                "proponents"
            ]
        ]
        for m in ("trackstar", "bm25")
    }
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app_lib.make_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    opts = Options()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(a)
    driver = None
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 120)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))
        driver.find_element(By.ID, "prompt").send_keys(prompt)
        driver.find_element(By.ID, "target").send_keys(target)
        k = driver.find_element(By.ID, "k")
        k.clear()
        k.send_keys("5")

        def shown_ids(d):
            items = d.find_elements(By.CSS_SELECTOR, "#pane1 .item")
            return [int(i.get_attribute("data-id")) for i in items[:5]] if items else None

        for method in ("trackstar", "bm25"):  # switch the method: the page shows that method's ranking
            Select(driver.find_element(By.ID, "method")).select_by_value(method)
            driver.execute_script("document.getElementById('pane1').innerHTML = ''")
            driver.find_element(By.ID, "go").click()
            ids = wait.until(shown_ids)
            assert ids == want[method], (method, ids, want[method])
            assert driver.find_element(By.CSS_SELECTOR, "#pane1 h3").text == method
        assert driver.find_elements(By.CSS_SELECTOR, "#pane1 mark"), "no subject/target word highlighted"
        assert driver.find_element(By.ID, "error").text == ""
        driver.save_screenshot(str(tmp_path / "explorer.png"))
        assert (tmp_path / "explorer.png").stat().st_size > 0
    finally:
        if driver is not None:
            driver.quit()
        server.should_exit = True
        thread.join(timeout=10)
