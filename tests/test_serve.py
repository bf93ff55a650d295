"""serving: the proponent explorer's API equals `retrieve_queries`, refuses bad input with a 4xx
and keeps serving, never serves files outside the workdir; and the page works in headless
Chromium (skipped when chromium / chromedriver / selenium are not installed)."""

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time

import numpy as np
import pytest
from conftest import tiny_run_config

pytest.importorskip("starlette", reason="the serve extra (starlette, httpx) is not installed")
pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")

from starlette.testclient import TestClient  # noqa: E402
from starlette.websockets import WebSocketDisconnect  # noqa: E402

from trackstar_jax import config as config_lib  # noqa: E402
from trackstar_jax import (
    evaluation,  # noqa: E402
    stages,  # noqa: E402
)
from trackstar_jax import methods as methods_lib  # noqa: E402
from trackstar_jax.evaluation import embedding, rows  # noqa: E402
from trackstar_jax.index import hessian as hessian_lib  # noqa: E402
from trackstar_jax.index import scoring as scoring_lib  # noqa: E402
from trackstar_jax.retrieval import stage as retrieval_stage  # noqa: E402
from trackstar_jax.serving import app as app_lib  # noqa: E402
from trackstar_jax.serving import (
    browse,  # noqa: E402
    guard,  # noqa: E402
)

pytestmark = pytest.mark.usefixtures("fast_compile")

LOCAL = "http://127.0.0.1:8765"  # the TestClients' base URL: a loopback Host, as a browser on the machine sends


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
    # The automatic λ crosses at component 8 of d = 256: above one query's rank (4, one per
    # diagonal block), below the evaluation queries' (`test_automatic_lambda_above_one_querys_rank_is_served`).
    c.hessian.lambda_component_fraction = 8 / 256
    return c


@pytest.fixture(scope="module")
def served(fast_compile, tiny_run):
    """A tiny trained run with its default (TrackStar) index, an engine and a TestClient over it."""
    settings = config_lib.from_configdict(_config())
    workdir = tiny_run(_config(), index=True)
    stages.build_index(settings, workdir)
    engine = stages.open_engine(settings, workdir, dense=False)  # what launch.serve loads
    return settings, workdir, engine, TestClient(app_lib.make_app(engine), base_url=LOCAL)


def _fact(engine, i=0):
    """(prompt, target) from a corpus passage: all but its last word -> " last word"."""
    words = engine.run.corpus.texts[i].rstrip(". ").split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def test_methods_lists_indexed_rows_and_text_baselines(served):
    _, workdir, engine, client = served
    d = client.get("/api/methods").json()
    names = [m["name"] for m in d["methods"]]
    # TrackStar (automatic and fixed λ 0.50 / 0.90 / 0.99), Exp. 4 and Exp. 5 share the default
    # (loss, corrected) index; the rest have none here.
    lam = ["trackstar_l050", "trackstar_l090", "trackstar_l099"]
    assert names == ["exp4", "exp5", "trackstar", *lam, "bm25"] and d["default"] == "trackstar"
    assert "no index" in d["skipped"]["exp2"] and d["skipped"]["dense"] == "disabled"
    assert d["num_passages"] == len(engine.run.corpus.texts)


@pytest.mark.parametrize("method", ["trackstar", "exp5"])  # R_eval from the evaluation's queries (mixed) / R_train
def test_query_equals_retrieve_queries(served, method):
    settings, workdir, engine, client = served
    prompt, target = _fact(engine, 3)
    r = client.post("/api/query", json={"prompt": prompt, "target": target, "k": 7, "method": method})
    assert r.status_code == 200, r.text
    got = r.json()
    ms = rows.method_settings(settings, methods_lib.METHODS[method])
    r_eval = engine.r_eval_set().queries if method == "trackstar" else None
    want, _ = retrieval_stage.retrieve_queries(
        engine.run, ms, workdir, [retrieval_stage.TextQuery(0, prompt, target)], k=7, r_eval_queries=r_eval
    )
    want = want[0]
    assert got["record"] == want
    assert [p["example_id"] for p in got["proponents"]] == want["proponent_ids"]
    assert [p["score"] for p in got["proponents"]] == want["proponent_scores"]
    assert [p["text"] for p in got["proponents"]] == want["proponents"]
    assert [p["example_id"] for p in got["opponents"]] == want["opponent_ids"]
    assert got["target"] == target and got["completion"] is None and got["method"] == method and got["seconds"] > 0


def test_mixed_rows_take_r_eval_from_the_evaluations_queries(served):
    """R_eval of the mixed rows is the evaluation's query set (built once at start, independently
    rebuilt here), not the served query; `describe` says so and gives the λ used."""
    settings, _, engine, client = served
    eq = evaluation.query_set.make_eval_queries(engine.run, settings)
    assert len(eq.queries) > 1 and not eq.r_eval_prompts
    assert [(q.prompt, q.target) for q in engine.r_eval_set().queries] == [(q.prompt, q.target) for q in eq.queries]
    methods = {m["name"]: m for m in client.get("/api/methods").json()["methods"]}
    for name in ("trackstar", "trackstar_l090"):
        r_eval = methods[name]["r_eval"]
        assert r_eval["kind"] == "eval_queries" and r_eval["num_examples"] == len(eq.queries), r_eval
        assert methods[name]["mix_lambda"] == r_eval["mix_lambda"] == engine._rows[name].scoring.whitening.mix_lambda
    assert (
        methods["trackstar"]["r_eval"]["lambda"] == "automatic" and methods["trackstar"]["r_eval"]["lambda_component"]
    )
    assert methods["trackstar_l090"]["r_eval"]["lambda"] == "fixed" and methods["trackstar_l090"]["mix_lambda"] == 0.9
    assert "r_eval" not in methods["exp5"] and "mix_lambda" not in methods["exp5"]


def test_automatic_lambda_above_one_querys_rank_is_served(served):
    """The fixture's automatic λ crosses above one query's rank: the query alone cannot choose λ
    (`prepare_scoring` falls back to hessian.fallback_lambda, saying why), yet it is served,
    with λ resolved at that crossing from the evaluation's queries; the explorer shows what
    each statistic came from."""
    settings, _, engine, client = served
    row = engine._rows["trackstar"]
    one_rank = row.reader.num_blocks_total  # one vector: rank 1 per diagonal block
    crossing = hessian_lib.lambda_component(row.reader.dim, settings.hessian.lambda_component_fraction)
    assert one_rank < crossing and row.settings.hessian.mix_lambda < 0
    prompt, target = _fact(engine, 5)
    q_raw = retrieval_stage.featurize_text_queries(
        engine.run, row.vec_fn, [retrieval_stage.TextQuery(0, prompt, target)]
    )
    alone = scoring_lib.prepare_scoring(row.reader, row.settings.hessian, q_raw).whitening
    assert alone.mix_lambda == 0.9 and alone.statistics["lambda"]["how"] == "fallback"
    assert (
        f"R_eval has numerical rank {one_rank} < crossing component {crossing}" in alone.statistics["lambda"]["reason"]
    )
    r = client.post("/api/query", json={"prompt": prompt, "target": target, "k": 6, "method": "trackstar"})
    assert r.status_code == 200, r.text
    assert len(r.json()["proponents"]) == len(r.json()["opponents"]) == 6
    (m,) = [m for m in client.get("/api/methods").json()["methods"] if m["name"] == "trackstar"]
    assert m["r_eval"]["lambda_component"] == crossing and 0 < m["mix_lambda"] < 1
    assert m["statistics"]["lambda"]["how"] == "automatic" and m["statistics"]["r_eval"]["num_examples"] > one_rank
    assert m["statistics"]["r_train"]["num_examples"] == len(engine.run.corpus.texts)
    assert m["statistics"]["v"]["source"] == "optimizer state" and m["thin_notes"] == m["statistics"]["thin_notes"]


def test_mixed_rows_without_an_r_eval_set_are_not_offered(served, monkeypatch):
    """A corpus whose evaluation queries cannot be built: the mixed rows are skipped, saying why
    and what to give; the other rows are offered, and asking for TrackStar is a 400 naming it."""
    settings, workdir, engine, _ = served

    def no_facts(run, settings):
        raise ValueError(f"corpus {run.corpus.name} has no facts to query")

    monkeypatch.setattr(evaluation.query_set, "make_eval_queries", no_facts)
    engine2 = stages.open_engine(settings, workdir, dense=False)
    assert engine2.methods == ["exp4", "exp5", "bm25"]
    for name in ("trackstar", "trackstar_l090"):
        assert "has no facts to query" in engine2.skipped[name] and "retrieval.queries" in engine2.skipped[name]
    client2 = TestClient(app_lib.make_app(engine2), base_url=LOCAL)
    assert client2.get("/api/methods").json()["default"] == "exp4"
    prompt, target = _fact(engine, 1)
    r = client2.post("/api/query", json={"prompt": prompt, "target": target, "k": 3, "method": "trackstar"})
    assert r.status_code == 400 and "has no facts to query" in r.json()["error"], r.text
    r = client2.post("/api/query", json={"prompt": prompt, "target": target, "k": 3, "method": "bm25"})
    assert r.status_code == 200 and r.json()["record"] == engine.query(prompt, target, 3, "bm25")["record"]


@pytest.mark.slow  # a second engine featurizes and compiles anew: ~40 s on a shared 2-core CPU
def test_r_eval_from_the_retrieval_query_file(served, tmp_path):
    """With `retrieval.queries` set, R_eval is that file's queries, as `launch.retrieve` takes it."""
    settings, workdir, engine, _ = served
    facts = [_fact(engine, i) for i in (0, 2, 4, 6)]
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in facts))
    s2 = settings.replace({"retrieval.queries": str(path)})
    engine2 = stages.open_engine(s2, workdir, dense=False)
    d = {m["name"]: m for m in engine2.describe()["methods"]}
    assert d["trackstar"]["r_eval"]["kind"] == "retrieval_queries" and d["trackstar"]["r_eval"]["num_examples"] == 4
    prompt, target = _fact(engine, 3)
    got = engine2.query(prompt, target, k=5, method="trackstar")
    ms = rows.method_settings(s2, methods_lib.METHODS["trackstar"])
    want, _ = retrieval_stage.retrieve_queries(
        engine2.run,
        ms,
        workdir,
        [retrieval_stage.TextQuery(0, prompt, target)],
        k=5,
        r_eval_queries=retrieval_stage.load_text_queries(path),
    )
    assert got["record"] == want[0]
    assert got["record"] != engine.query(prompt, target, k=5, method="trackstar")["record"]  # another R_eval


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
    assert (
        client.post("/api/query", content=b"{not json", headers={"Content-Type": "application/json"}).status_code == 400
    )
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


def test_concurrent_queries_run_one_at_a_time(served, monkeypatch):
    """Eight requests fired together: each gets its own (correct) answer, and the device work
    (`Engine._answer`) never runs twice at once, so memory is not multiplied."""
    _, _, engine, client = served
    facts = [_fact(engine, (1, 3)[i % 2]) for i in range(8)]  # two facts asked before: no new compile
    want = [
        client.post("/api/query", json={"prompt": p, "target": t, "k": 4, "method": "trackstar"}).json()["record"]
        for p, t in facts
    ]
    inside, peak, guard = [0], [0], threading.Lock()
    original = engine._answer

    def counted(*args, **kwargs):
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.05)  # widen the window an unserialized second call would overlap in
        try:
            return original(*args, **kwargs)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(engine, "_answer", counted)
    got = [None] * len(facts)
    start = threading.Barrier(len(facts))

    def ask(i):
        start.wait()
        p, t = facts[i]
        got[i] = client.post("/api/query", json={"prompt": p, "target": t, "k": 4, "method": "trackstar"})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(facts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert all(r is not None and r.status_code == 200 for r in got), [r and r.text for r in got]
    assert [r.json()["record"] for r in got] == want
    assert peak[0] == 1, f"{peak[0]} queries ran on the device at once"


def test_page_is_served(served):
    client = served[3]
    r = client.get("/")
    assert r.status_code == 200 and "/api/query" in r.text and "Export jsonl" in r.text


# ------------------------------------------------------------------------------------------
# Hostile requests (issue 38): each refused with a 4xx before it reaches the engine
# ------------------------------------------------------------------------------------------


@pytest.fixture
def engine_calls(served, monkeypatch):
    """The served client, with `Engine.query` counting its calls (a refused request makes none)."""
    _, _, engine, client = served
    calls, original = [], engine.query
    monkeypatch.setattr(engine, "query", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    return engine, client, calls


def test_only_allowed_host_names_are_answered(engine_calls):
    """DNS rebinding: a page at evil.example.com whose name now resolves to 127.0.0.1 sends its
    own name as Host; it reads nothing and runs nothing. Loopback names, any port, are answered;
    a server bound elsewhere answers the names it is given."""
    engine, client, calls = engine_calls
    prompt, target = _fact(engine, 1)
    body = {"prompt": prompt, "target": target, "k": 2, "method": "bm25"}
    for host in ("evil.example.com:8765", "evil.example.com", "127.0.0.1.evil.example.com", "", "[::2]:8765"):
        h = {"Host": host}
        for r in (client.get("/api/methods", headers=h), client.get("/", headers=h)):
            assert r.status_code == 400 and "is not served" in r.json()["error"], (host, r.status_code, r.text)
        assert client.post("/api/query", json=body, headers=h).status_code == 400
        assert client.get("/api/file", params={"path": "x.jsonl"}, headers=h).status_code == 400
    assert calls == []
    for host in ("127.0.0.1:8765", "localhost:1234", "LOCALHOST", "[::1]:8765", "localhost."):
        assert client.get("/api/methods", headers={"Host": host}).status_code == 200, host
    app = app_lib.make_app(engine, hosts=guard.allowed_hosts("0.0.0.0", ["gpu7.lan", "10.0.0.7"]))
    other = TestClient(app, base_url="http://gpu7.lan:8765")
    assert other.get("/api/methods").status_code == 200
    assert other.get("/api/methods", headers={"Host": "10.0.0.7:8765"}).status_code == 200
    assert other.get("/api/methods", headers={"Host": "evil.example.com"}).status_code == 400
    with pytest.raises(ValueError, match="without a port"):
        guard.allowed_hosts("127.0.0.1", ["gpu7.lan:8765"])
    for host in ("evil.example.com", "127.0.0.1:8765"):  # no websocket route: every handshake refused
        with pytest.raises(WebSocketDisconnect) as e, client.websocket_connect("/", headers={"Host": host}):
            pass
        assert e.value.code == 1008, host


def test_cross_origin_and_non_json_requests_are_refused(engine_calls):
    """CSRF: a cross-origin page may POST text/plain without a preflight, and a browser marks
    other sites' requests (Origin, Sec-Fetch-Site); none reaches the engine. The page's own
    requests (same Origin, same-origin fetch) and a plain client (no Origin) are served."""
    engine, client, calls = engine_calls
    prompt, target = _fact(engine, 1)
    body = {"prompt": prompt, "target": target, "k": 2, "method": "bm25"}
    raw = json.dumps(body)
    refused = [
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ({}, 415),
        ({"Content-Type": "application/json", "Origin": "http://evil.example.com"}, 403),
        ({"Content-Type": "application/json", "Origin": "http://127.0.0.1:9999"}, 403),
        ({"Content-Type": "application/json", "Origin": "null"}, 403),
        ({"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}, 403),
        ({"Content-Type": "application/json", "Sec-Fetch-Site": "same-site"}, 403),
    ]
    for headers, status in refused:
        r = client.post("/api/query", content=raw, headers=headers)
        assert r.status_code == status and r.json()["error"], (headers, r.status_code, r.text)
    for headers in ({"Origin": "http://evil.example.com"}, {"Sec-Fetch-Site": "cross-site"}):
        assert client.get("/api/methods", headers=headers).status_code == 403, headers
    assert calls == []
    same = {"Content-Type": "application/json; charset=utf-8", "Origin": LOCAL, "Sec-Fetch-Site": "same-origin"}
    assert client.post("/api/query", content=raw, headers=same).status_code == 200
    assert client.post("/api/query", json=body).status_code == 200
    assert client.get("/", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200  # a link to the page
    assert len(calls) == 2


def _asgi(app, method, path, headers, chunks):
    """Drives `app` directly with a request body arriving in `chunks`; returns (status, body,
    bytes the app pulled from the client)."""
    pulled, out = [0], {"body": b""}
    it = iter(chunks)

    async def receive():
        chunk = next(it, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        else:
            out["body"] += message.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1:8765")] + [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8765),
    }
    asyncio.run(app(scope, receive, send))
    return out["status"], json.loads(out["body"]), pulled[0]


def test_oversized_bodies_are_refused_without_reading_them(served):
    """A 64 MiB body is refused with 413 after at most the limit and one chunk are read (chunked,
    no Content-Length), or before any is read (Content-Length); the server keeps serving."""
    _, _, engine, client = served
    app = app_lib.make_app(engine)
    chunk = b" " * (1 << 16)
    chunks = (chunk for _ in range(1024))  # 64 MiB, lazily
    status, body, pulled = _asgi(app, "POST", "/api/query", {"content-type": "application/json"}, chunks)
    assert status == 413 and "exceeds" in body["error"]
    assert pulled <= app_lib.MAX_BODY_BYTES + len(chunk), pulled
    headers = {"content-type": "application/json", "content-length": str(1 << 26)}
    status, body, pulled = _asgi(app, "POST", "/api/query", headers, (chunk for _ in range(1024)))
    assert status == 413 and pulled == 0 and str(1 << 26) in body["error"]
    prompt, target = _fact(engine, 1)
    ok = json.dumps({"prompt": prompt, "target": target, "k": 2, "method": "bm25"}).encode()
    status, body, _ = _asgi(app, "POST", "/api/query", {"content-type": "application/json"}, [ok])
    assert status == 200 and len(body["proponents"]) == 2


def test_malformed_numbers_and_text_are_400s(served):
    """Digits only ASCII ones (`"²".isdigit()` holds, `int("²")` fails: was a 500; `int("٣")` is 3),
    prompts / targets without lone surrogates or control characters, JSON that Python's parser
    refuses beyond syntax (an integer of 5000 digits, deep nesting): each a 400 naming it."""
    _, _, engine, client = served
    for k in ("²", "٣", "³", " 3", "+3", "3_0", "1" * 30, ""):
        r = client.get("/api/eval/query", params={"query_id": "0", "k": k})
        assert r.status_code == 400 and r.json()["error"].startswith("k:"), (k, r.status_code, r.text)
    prompt, target = _fact(engine, 1)
    good = {"prompt": prompt, "target": target, "k": 2, "method": "bm25"}
    post = lambda raw: client.post("/api/query", content=raw, headers={"Content-Type": "application/json"})  # noqa: E731
    for field, bad in [
        ("prompt", "Paris \ud800 is"),
        ("prompt", "a\u0000b"),
        ("prompt", "\udfff"),
        ("target", " x\ud83d"),
        ("target", " \u001b[31m"),
    ]:
        r = post(json.dumps({**good, field: bad}).encode())  # ASCII JSON: "\\ud800" escapes
        assert r.status_code == 400 and r.json()["error"].startswith(f"{field}: character"), (bad, r.text)
    for raw in (b'{"prompt": "a", "k": ' + b"1" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000):
        r = post(raw)
        assert r.status_code == 400 and r.json()["error"], (raw[:20], r.status_code, r.text)
    assert post(json.dumps({**good, "prompt": prompt + "\t\n"}).encode()).status_code == 200
    assert post(json.dumps(good, ensure_ascii=False).encode()).status_code == 200


def test_file_records_fields_are_type_checked(served):
    """`/api/file` serves only records whose shown fields have their types (naming the line and
    field), and turns NaN scores (the released files have some) into null instead of a 500."""
    _, workdir, _, client = served
    rec = {
        "example_id": "trex-1",
        "inputs_plaintext": "Paris is the capital of",
        "targets_plaintext": " France",
        "proponents": ["a", "b"],
        "proponent_ids": [4, "c4-7"],
        "proponent_scores": [1.5, float("nan")],
    }
    (workdir / "retrieval").mkdir(exist_ok=True)

    def load(*recs):
        (workdir / "retrieval" / "typed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return client.get("/api/file", params={"path": "retrieval/typed.jsonl"})

    r = load(rec)
    assert r.status_code == 200 and r.json()[0]["proponent_scores"] == [1.5, None], r.text
    bad = [
        ({"example_id": {"x": 1}}, "example_id"),
        ({"example_id": True}, "example_id"),
        ({"inputs_plaintext": ["<b>"]}, "inputs_plaintext"),
        ({"targets_plaintext": 3}, "targets_plaintext"),
        ({"proponents": ["a", {"html": "<img>"}]}, "proponents"),
        ({"proponent_ids": [4, [5]]}, "proponent_ids"),
        ({"proponent_scores": [1.5, "9"]}, "proponent_scores"),
        ({"proponent_ids": [4]}, "unequal lengths"),
        ({"opponent_ids": [1], "opponents": ["x"]}, "unequal lengths"),
        ({"model_correct": "yes"}, "model_correct"),
    ]
    for change, match in bad:
        r = load(rec, {**rec, **change})
        assert r.status_code == 400 and "retrieval/typed.jsonl:2" in r.json()["error"], (change, r.text)
        assert match in r.json()["error"], (change, r.text)


def test_page_builds_its_dom_without_html_strings_and_is_served_with_a_csp(served):
    """No HTML parsing of data anywhere in the page (every value goes through `el` / `fill`);
    the page's CSP allows exactly its own inline script, so injected markup could not run any."""
    client = served[3]
    r = client.get("/")
    page = r.text
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "DOMParser",
        "createContextualFragment",
    ):
        assert sink not in page, sink
    csp = r.headers["content-security-policy"]
    (script,) = re.findall(r"<script>(.*?)</script>", page, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert (
        f"script-src 'sha256-{digest}';" in csp
        and "default-src 'none'" in csp
        and "unsafe-inline' " not in csp.split("style-src")[0]
    )
    for url in ("/", "/api/methods", "/api/file?path=none.jsonl"):
        h = client.get(url).headers
        assert h["x-content-type-options"] == "nosniff" and h["content-security-policy"] == csp, url


# ------------------------------------------------------------------------------------------
# Browse an evaluation: /api/eval and /api/eval/query against the files evaluate wrote
# ------------------------------------------------------------------------------------------


def _eval_config():
    """tests/test_notebook.py's run and evaluation, value for value: in a full session both
    modules share the trained run (`tiny_run`) and evaluate finds its output and returns."""
    methods = ("trex_gold", "bm25") + (("dense",) if embedding.is_available() else ()) + ("trackstar",)
    return tiny_run_config(
        num_facts=24,
        num_distractors=30,
        num_steps=10,
        chunk_rows=32,
        **{"eval.methods": methods, "eval.max_new_tokens": 4, "eval.num_examples_shown": 2, "tailpatch.batch_size": 8},
    )


@pytest.fixture(scope="module")
def evaluated(tiny_run):
    """(workdir, engine, client) over a tiny run with `eval/` written by `evaluation.evaluate`."""
    settings = config_lib.from_configdict(_eval_config())
    workdir = tiny_run(_eval_config(), evaluate=True)
    stages.evaluate(settings, workdir)  # finds the shared evaluation and returns
    engine = stages.open_engine(settings, workdir, dense=False)
    return workdir, engine, TestClient(app_lib.make_app(engine), base_url=LOCAL)


def _eval_files(workdir):
    """What evaluate wrote, read with plain json: queries, {method: records}, table."""
    ev = workdir / "eval"
    lines = lambda p: [json.loads(x) for x in p.read_text().splitlines() if x.strip()]  # noqa: E731
    table = json.loads((ev / "table.json").read_text())
    recs = {r["method"]: lines(ev / "retrievals" / f"{r['method']}.jsonl") for r in table["rows"]}
    return lines(ev / "queries.jsonl"), recs, table


def _none_if_nan(x):
    return None if isinstance(x, float) and x != x else x


def test_eval_api_equals_the_evaluation_files(evaluated):
    workdir, engine, client = evaluated
    queries, recs, table = _eval_files(workdir)
    r = client.get("/api/eval")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["name"] == "eval" and "eval" in got["evals"] and got["num_queries"] == len(queries)
    assert [m["name"] for m in got["methods"]] == [row["method"] for row in table["rows"]]
    assert [m["label"] for m in got["methods"]] == [row["label"] for row in table["rows"]]
    for g, row in zip(got["table"]["rows"], table["rows"]):
        for key in ("method", "num_queries", "mrr", "recall_at_10", "tailpatch_at_1", "tailpatch_at_10"):
            assert g[key] == _none_if_nan(row[key]), (row["method"], key)
    assert got["table"]["model_accuracy"] == table["model_accuracy"]
    assert [q["query_id"] for q in got["queries"]] == [q["query_id"] for q in queries]
    for g, q in zip(got["queries"], queries):
        for key in ("fact_id", "relation", "subject", "object", "prompt", "target", "bucket"):
            assert g[key] == q[key], key
        assert g["frequency"] == len(q["mention_ids"])
        assert [p["example_id"] for p in g["gold"]] == q["entailing_ids"]
        assert [p["text"] for p in g["gold"]] == [engine.run.corpus.texts[i] for i in q["entailing_ids"]]
        for m, recs_m in recs.items():
            rec = recs_m[q["query_id"]]
            assert g["model_correct"] == rec["model_correct"] and g["model_completion"] == rec["model_completion"]
            # first gold rank, the naive way: scan the stored ids against the stored gold list
            want_rank = None
            for rank, pid in enumerate(rec["proponent_ids"], start=1):
                if pid in q["entailing_ids"]:
                    want_rank = rank
                    break
            cell = g["methods"][m]
            assert cell["first_gold_rank"] == want_rank, (m, q["query_id"])
            assert cell["tailpatch"] == rec["proponent_tailpatch"]
            top = rec["proponent_tailpatch"][:10]  # fewer than 10 for the gold row: the mean is over those
            assert cell["tailpatch_at_1"] == pytest.approx(top[0])
            assert cell["tailpatch_at_10"] == pytest.approx(sum(top) / len(top))
    # BM25 ranks the stating (template 0) passage first on the embedded corpus.
    assert all(g["methods"]["bm25"]["first_gold_rank"] == 1 for g in got["queries"] if g["gold"])


def test_eval_filters_return_exactly_the_matching_queries(evaluated):
    workdir, _, client = evaluated
    queries, recs, _ = _eval_files(workdir)
    correct = {q["query_id"]: recs["bm25"][q["query_id"]]["model_correct"] for q in queries}
    facets = client.get("/api/eval").json()["facets"]
    assert facets["relation"] == sorted({q["relation"] for q in queries})
    assert sorted(facets["bucket"]) == sorted({q["bucket"] for q in queries})
    assert len(facets["relation"]) > 1, facets  # (one bucket and no correct answer here: see the next test)

    def ids(**params):
        r = client.get("/api/eval", params=params)
        assert r.status_code == 200, (params, r.text)
        assert r.json()["filters"] == params
        return [q["query_id"] for q in r.json()["queries"]]

    cases = [{"relation": v} for v in facets["relation"]] + [{"bucket": v} for v in facets["bucket"]]
    cases += [{"correct": "true"}, {"correct": "false"}]
    cases += [{"relation": facets["relation"][0], "bucket": b, "correct": "false"} for b in facets["bucket"]]
    for params in cases:
        want = [
            q["query_id"]
            for q in queries
            if q["relation"] == params.get("relation", q["relation"])
            and q["bucket"] == params.get("bucket", q["bucket"])
            and ("correct" not in params or correct[q["query_id"]] == (params["correct"] == "true"))
        ]
        assert ids(**params) == want, params
    assert sum(len(ids(relation=v)) for v in facets["relation"]) == len(queries)


def test_eval_filters_on_mixed_buckets_and_correctness(evaluated, tmp_path):
    """The tiny run has one frequency bucket and a model that answers nothing correctly: on a
    copy of its eval files with buckets and correctness varied, each filter still returns
    exactly its subset."""
    workdir, engine, _ = evaluated
    queries, recs, table = _eval_files(workdir)
    (tmp_path / "eval" / "retrievals").mkdir(parents=True)
    for q in queries:
        q["bucket"] = ("0", "[1,10)", "[10,100)")[q["query_id"] % 3]
    correct = {q["query_id"]: q["query_id"] % 2 == 0 for q in queries}
    dump = lambda rows: "".join(json.dumps(x) + "\n" for x in rows)  # noqa: E731
    (tmp_path / "eval" / "queries.jsonl").write_text(dump(queries))
    (tmp_path / "eval" / "table.json").write_text(json.dumps(table))
    for m, recs_m in recs.items():
        for x in recs_m:
            x["model_correct"] = correct[int(x["example_id"])]  # example_id: a string (the released schema)
        (tmp_path / "eval" / "retrievals" / f"{m}.jsonl").write_text(dump(recs_m))
    browser = browse.Browser(tmp_path, engine.run.corpus.texts)
    assert browser.summary()["facets"]["bucket"] == ["0", "[1,10)", "[10,100)"]
    assert browser.summary()["facets"]["correct"] == [True, False]
    rel = queries[0]["relation"]
    for b in ("0", "[1,10)", "[10,100)"):
        for c in ("true", "false"):
            for f in ({"bucket": b}, {"bucket": b, "correct": c}, {"bucket": b, "correct": c, "relation": rel}):
                want = [
                    q["query_id"]
                    for q in queries
                    if q["bucket"] == b
                    and ("correct" not in f or correct[q["query_id"]] == (c == "true"))
                    and q["relation"] == f.get("relation", q["relation"])
                ]
                got = browser.summary(filters=f)["queries"]
                assert [q["query_id"] for q in got] == want, f
                assert all(q["model_correct"] == correct[q["query_id"]] for q in got)
    assert [q["query_id"] for q in browser.summary(filters={"correct": "true"})["queries"]] == [
        q for q in correct if correct[q]
    ]


def test_eval_bad_filters_are_refused_and_the_server_keeps_serving(evaluated):
    _, _, client = evaluated
    bad = [
        ("/api/eval?relation=P999", 400, "relation"),
        ("/api/eval?bucket=%5B7,8)", 400, "bucket"),
        ("/api/eval?correct=maybe", 400, "correct"),
        ("/api/eval?correct=True", 400, "correct"),
        ("/api/eval?colour=red", 400, "unknown parameters"),
        ("/api/eval?relation=P19&relation=P20", 400, "more than once"),
        ("/api/eval?name=nothing", 404, "no evaluation named"),
        ("/api/eval?name=..", 404, "no evaluation named"),
        ("/api/eval?name=../eval", 404, "no evaluation named"),
        ("/api/eval/query?query_id=-1", 400, "query_id"),
        ("/api/eval/query?query_id=x", 400, "query_id"),
        ("/api/eval/query?query_id=100000", 400, "query_id"),
        ("/api/eval/query", 400, "query_id"),
        ("/api/eval/query?query_id=0&k=0", 400, "k:"),
        ("/api/eval/query?query_id=0&k=ten", 400, "k:"),
    ]
    for url, status, match in bad:
        r = client.get(url)
        assert r.status_code == status and match in r.json()["error"], (url, r.status_code, r.text)
    assert client.get("/api/eval").status_code == 200


def test_served_mixed_row_equals_the_evaluations_records(evaluated):
    """An evaluation query asked of the explorer's TrackStar row (R_eval from the same query set,
    built at start) gets the proponents and opponents `evaluate` wrote for it."""
    workdir, engine, client = evaluated
    queries, recs, table = _eval_files(workdir)
    k = len(recs["trackstar"][0]["proponent_ids"])
    (row,) = [r for r in table["rows"] if r["method"] == "trackstar"]
    for q in queries[:3]:
        r = client.post(
            "/api/query", json={"prompt": q["prompt"], "target": q["target"], "k": k, "method": "trackstar"}
        )
        assert r.status_code == 200, r.text
        got, want = r.json()["record"], recs["trackstar"][q["query_id"]]
        for kind in ("proponent", "opponent"):
            assert got[f"{kind}_ids"] == want[f"{kind}_ids"], (q["query_id"], kind)
            assert got[f"{kind}_scores"] == pytest.approx(want[f"{kind}_scores"], rel=1e-5, abs=1e-6)
    d = {m["name"]: m for m in client.get("/api/methods").json()["methods"]}
    assert d["trackstar"]["r_eval"]["num_examples"] == len(queries)
    want_lambda = row["scoring"]["whitening"]["mix_lambda"]  # the λ the evaluation resolved
    assert d["trackstar"]["mix_lambda"] == pytest.approx(want_lambda, rel=1e-6)


def test_eval_query_detail_equals_the_records(evaluated):
    workdir, _, client = evaluated
    queries, recs, _ = _eval_files(workdir)
    qid = queries[1]["query_id"]
    r = client.get("/api/eval/query", params={"query_id": qid, "k": 3})
    assert r.status_code == 200, r.text
    got = r.json()
    for m, recs_m in recs.items():
        rec = recs_m[qid]
        assert got["records"][m] == rec
        shown = got["proponents"][m]
        assert [p["example_id"] for p in shown] == rec["proponent_ids"][:3]
        assert [p["score"] for p in shown] == rec["proponent_scores"][:3]
        assert [p["tailpatch"] for p in shown] == rec["proponent_tailpatch"][:3]
        assert [p["entailing"] for p in shown] == [i in queries[1]["entailing_ids"] for i in rec["proponent_ids"][:3]]


# ------------------------------------------------------------------------------------------
# The evaluation's pictures: /api/eval/plot serves only rows.png / lambda.png / checkpoints.png
# ------------------------------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n"
_PLOT_TABLE = {
    "num_queries": 3,
    "rows": [
        {"method": "bm25", "label": "BM25", "mrr": 0.5, "mrr_ci": [0.4, 0.6], "recall_at_10": 0.7},
        {"method": "trackstar", "mrr": 0.4, "tailpatch_at_10": 0.02, "scoring": {"whitening": {"mix_lambda": 0.7}}},
        {"method": "trackstar_l090", "mrr": 0.3, "tailpatch_at_10": 0.01},
    ],
}


def _plot_app(workdir, **eval_overrides):
    """A client over `make_app` with a stand-in engine (the plot routes read only its settings
    and workdir): no run to train, so these tests take a second."""
    import types

    c = _config()
    for k, v in eval_overrides.items():
        setattr(c.eval, k, v)
    engine = types.SimpleNamespace(
        settings=config_lib.from_configdict(c),
        workdir=workdir.resolve(),
        run=types.SimpleNamespace(corpus=types.SimpleNamespace(texts=[])),
        max_k=10,
    )
    return TestClient(app_lib.make_app(engine), base_url=LOCAL)


def _plot_eval(workdir, name="eval"):
    """An evaluation folder `browse.list_evals` lists, with rows.png and lambda.png written by
    `evaluation.plots` (no checkpoints.png: the table has no checkpoint curve)."""
    from trackstar_jax.evaluation import plots

    ev = workdir / name
    ev.mkdir(parents=True)
    (ev / "table.json").write_text(json.dumps(_PLOT_TABLE))
    (ev / "queries.jsonl").write_text("")
    assert plots.write_plots(_PLOT_TABLE, ev) == ["rows.png", "lambda.png"]
    return ev


def _refused(r, status, *words):
    """A JSON refusal with `status` naming `words`, carrying no byte of a PNG."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json" and PNG not in r.content, r.headers
    assert all(w in r.json()["error"] for w in words), (words, r.text)


def test_plot_endpoint_serves_only_the_evaluation_pngs(tmp_path):
    workdir = tmp_path / "run"
    ev = _plot_eval(workdir)
    _plot_eval(workdir, "eval_prediction")
    (workdir / "secret.png").write_bytes((ev / "rows.png").read_bytes())
    client = _plot_app(workdir)
    for name in ("rows.png", "lambda.png"):
        for params in ({"file": name}, {"file": name, "name": "eval"}):
            r = client.get("/api/eval/plot", params=params)
            assert r.status_code == 200 and r.content == (ev / name).read_bytes() and r.content.startswith(PNG)
            h = r.headers
            assert h["content-type"] == "image/png" and h["x-content-type-options"] == "nosniff", h
            assert (
                "img-src 'self'" in h["content-security-policy"]
                and "default-src 'none'" in h["content-security-policy"]
            )
    other = client.get("/api/eval/plot", params={"name": "eval_prediction", "file": "rows.png"})
    assert other.status_code == 200 and other.content == (workdir / "eval_prediction" / "rows.png").read_bytes()
    _refused(
        client.get("/api/eval/plot", params={"file": "checkpoints.png"}), 404, "eval/checkpoints.png", "not written"
    )
    for file in (
        "table.json",
        "queries.jsonl",
        "ROWS.PNG",
        "rows.png/",
        "./rows.png",
        "../secret.png",
        "../eval/rows.png",
        "eval/rows.png",
        str(ev / "rows.png"),
        "..%2Fsecret.png",
        "rows.png\x00",
        "",
    ):
        _refused(client.get("/api/eval/plot", params={"file": file}), 404, "only the evaluation plots")
    for name in ("..", ".", "../run/eval", "eval/.", str(ev), "", "nope"):
        _refused(client.get("/api/eval/plot", params={"name": name, "file": "rows.png"}), 404, "no evaluation named")
    # Encoded slashes and dots in the raw URL: decoded once into a name that is no allow-listed file.
    for url in (
        "/api/eval/plot?file=..%2Fsecret.png",
        "/api/eval/plot?file=%2e%2e%2fsecret.png",
        "/api/eval/plot?name=eval%2F..&file=..%2Fsecret.png",
        "/api/eval/plot?name=..&file=secret.png",
    ):
        assert client.get(url).status_code == 404, url
    for url in ("/api/eval/plot/..%2F..%2Fsecret.png", "/api/eval/plot%2F..%2Fsecret.png", "/api/eval/rows.png"):
        r = client.get(url)
        assert r.status_code == 404 and PNG not in r.content, url
    _refused(client.get("/api/eval/plot", params={"path": "eval/rows.png"}), 400, "unknown parameters")
    _refused(client.get("/api/eval/plot?file=rows.png&file=lambda.png"), 400, "more than once")
    assert client.post("/api/eval/plot?file=rows.png", json={}).status_code == 405
    # Without `name`, the served settings' own evaluation folder (report.eval_dir).
    mine = _plot_eval(workdir, "mine")
    (mine / "rows.png").write_bytes((ev / "lambda.png").read_bytes())
    r = _plot_app(workdir, output_dir="mine").get("/api/eval/plot", params={"file": "rows.png"})
    assert r.status_code == 200 and r.content == (ev / "lambda.png").read_bytes()
    # The page's allow-list is the server's.
    page = client.get("/").text
    assert json.loads(re.search(r"const PLOT_FILES = (\[.*?\]);", page).group(1)) == list(browse.PLOT_FILES)


def test_plot_endpoint_refuses_links_and_files_that_are_not_pngs(tmp_path, monkeypatch):
    """A symlink (out of the workdir, or to a file beside it), a non-PNG under a plot's name, a
    FIFO, a folder, a file past the size cap: each a clear error, none of its bytes sent; the
    listing the page shows (`Browser.plots`) names the same errors and shows only real PNGs."""
    workdir = tmp_path / "run"
    ev = _plot_eval(workdir)
    good = (ev / "rows.png").read_bytes()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "rows.png").write_bytes(good)
    client = _plot_app(workdir)
    get = lambda file, name="eval": client.get("/api/eval/plot", params={"name": name, "file": file})  # noqa: E731
    hostile = b'<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)"><script>alert(2)</script></svg>'
    (ev / "rows.png").unlink()
    os.symlink(outside / "rows.png", ev / "rows.png")
    (ev / "lambda.png").unlink()
    os.symlink(ev / "table.json", ev / "lambda.png")
    for file in ("rows.png", "lambda.png"):
        _refused(get(file), 403, f"eval/{file}", "symbolic link")
    (ev / "checkpoints.png").write_bytes(hostile)
    r = get("checkpoints.png")
    _refused(r, 500, "eval/checkpoints.png", "not a PNG")
    assert b"alert" not in r.content and b"svg" not in r.content
    listing = browse.Browser(workdir.resolve(), []).plots("eval")
    assert listing["files"] == [] and listing["none"] is None
    assert [e.split(":")[0] for e in listing["errors"]] == ["eval/rows.png", "eval/lambda.png", "eval/checkpoints.png"]
    # A FIFO would block a plain read; a folder is no file.
    (ev / "rows.png").unlink()
    os.mkfifo(ev / "rows.png")
    _refused(get("rows.png"), 500, "not a regular file")
    (ev / "lambda.png").unlink()
    (ev / "lambda.png").mkdir()
    _refused(get("lambda.png"), 500, "not a regular file")
    # An evaluation folder that is a link out of the workdir (`browse.servable`, every endpoint's rule).
    os.symlink(_plot_eval(tmp_path, "elsewhere"), workdir / "linked")
    _refused(get("rows.png", "linked"), 403, "linked: linked is a symbolic link")
    # Past the size cap.
    (ev / "checkpoints.png").write_bytes(good)
    assert get("checkpoints.png").status_code == 200
    monkeypatch.setattr(browse, "MAX_PLOT_BYTES", len(good) - 1)
    _refused(get("checkpoints.png"), 500, "larger than")
    monkeypatch.undo()
    # The listing: the servable PNG, the errors, and with no plots a line naming the command.
    listing = browse.Browser(workdir.resolve(), []).plots("eval")
    assert listing["files"] == ["checkpoints.png"] and len(listing["errors"]) == 2 and listing["none"] is None
    empty = _plot_eval(workdir, "empty")
    for f in browse.PLOT_FILES:
        (empty / f).unlink(missing_ok=True)
    listing = browse.Browser(workdir.resolve(), []).plots("empty")
    assert listing["files"] == listing["errors"] == [] and "python -m launch.evaluate" in listing["none"]


def _stand_in_app(workdir, texts=tuple(f"passage {i}" for i in range(8))):
    """`_plot_app` whose corpus has `texts` (the browse views read gold passages from it)."""
    import types

    engine = types.SimpleNamespace(
        settings=config_lib.from_configdict(_config()),
        workdir=workdir.resolve(),
        run=types.SimpleNamespace(corpus=types.SimpleNamespace(texts=list(texts))),
        max_k=10,
    )
    return TestClient(app_lib.make_app(engine), base_url=LOCAL)


def _record_eval(workdir, name="eval", record=None):
    """An evaluation folder with one query (gold passage 1) and one method's record (`record`
    replaces fields of a well-formed one), plus evaluate's plots."""
    import dataclasses

    from trackstar_jax.evaluation import queries as queries_lib

    ev = _plot_eval(workdir, name)
    q = queries_lib.Query(
        0, "f0", "P19", "Ann", "Rome", "Ann was born in", " Rome", ("Rome",), ("Ann",), (1,), (1, 2), "[1,10)", 0
    )
    (ev / "queries.jsonl").write_text(json.dumps(dataclasses.asdict(q)) + "\n")
    rec = {
        "example_id": 0,
        "inputs_plaintext": q.prompt,
        "targets_plaintext": q.target,
        "proponent_ids": [1, 3],
        "proponents": ["passage 1", "passage 3"],
        "proponent_scores": [2.0, 1.0],
        "proponent_tailpatch": [0.1, None],
        "model_completion": " Rome",
        "model_correct": True,
        **(record or {}),
    }
    (ev / "retrievals").mkdir()
    (ev / "retrievals" / "bm25.jsonl").write_text(json.dumps(rec) + "\n")
    table = json.loads((ev / "table.json").read_text())
    table["rows"] = [{"method": "bm25", "label": "BM25", "mrr": 1.0}]
    (ev / "table.json").write_text(json.dumps(table))
    return ev


def test_one_symlink_rule_for_every_endpoint(tmp_path):
    """Issue 53: an evaluation folder linked out of the workdir was served by `/api/eval` but refused
    by `/api/eval/plot`. Now every endpoint refuses a path with a link below the workdir (a folder or
    the file, pointing out of the workdir or into it) with the same 403 (`browse.servable`)."""
    workdir = tmp_path / "run"
    ev = _record_eval(workdir)
    client = _stand_in_app(workdir)
    endpoints = {
        "eval": lambda name: client.get("/api/eval", params={"name": name}),
        "query": lambda name: client.get("/api/eval/query", params={"name": name, "query_id": "0"}),
        "plot": lambda name: client.get("/api/eval/plot", params={"name": name, "file": "rows.png"}),
        "file": lambda name: client.get("/api/file", params={"path": f"{name}/retrievals/bm25.jsonl"}),
    }
    for name, get in endpoints.items():
        assert get("eval").status_code == 200, (name, get("eval").text)
    os.symlink(_record_eval(tmp_path, "elsewhere"), workdir / "linked")
    os.symlink(ev, workdir / "alias")  # a link inside the workdir is refused alike
    for link in ("linked", "alias"):
        for name, get in endpoints.items():
            r = get(link)
            assert r.status_code == 403 and f"{link} is a symbolic link" in r.json()["error"], (name, link, r.text)
    assert client.get("/api/eval").json()["evals"] == ["eval"]
    # A linked file or folder inside a real evaluation folder: the same rule, naming it.
    for inside in ("retrievals/bm25.jsonl", "retrievals", "queries.jsonl", "table.json"):
        other = _record_eval(tmp_path / inside.replace("/", "_"))
        target = other / inside
        moved = tmp_path / "moved"
        os.replace(ev / inside, moved)
        os.symlink(target, ev / inside)
        for name in ("eval", "query"):
            r = endpoints[name]("eval")
            assert r.status_code == 403 and f"eval/{inside} is a symbolic link" in r.json()["error"], (inside, r.text)
        (ev / inside).unlink()
        os.replace(moved, ev / inside)
    assert endpoints["eval"]("eval").status_code == 200


@pytest.mark.parametrize(
    "field,value,why",
    [
        ("proponent_ids", ["p1", "p3"], "proponent_ids must be corpus passage ids"),
        ("proponent_ids", "13", "proponent_ids must be a list"),
        ("proponent_ids", [1, 99], "proponent_ids must be corpus passage ids, integers in [0, 8); it holds 99"),
        ("proponent_tailpatch", "x", "proponent_tailpatch must be a list"),
        ("model_correct", "yes", "model_correct must be true, false or null"),
        ("proponent_scores", [1.0], "proponent lists of unequal lengths"),
    ],
)
def test_malformed_evaluation_records_are_400s_naming_file_line_and_field(tmp_path, field, value, why):
    """Issue 53: string `proponent_ids` in an evaluation's record gave a 500; every malformed field
    the browse views read is now a 400 naming `<eval>/retrievals/<method>.jsonl:<line>` and the field."""
    workdir = tmp_path / "run"
    _record_eval(workdir, record={field: value})
    client = _stand_in_app(workdir)
    for r in (client.get("/api/eval"), client.get("/api/eval/query", params={"query_id": "0"})):
        assert r.status_code == 400, r.text
        assert r.json()["error"].startswith("eval/retrievals/bm25.jsonl:1: ") and why in r.json()["error"], r.text


def test_file_endpoint_is_bounded_and_reads_off_the_event_loop(tmp_path, monkeypatch):
    """Issue 53: `/api/file` read a 58 MB jsonl whole inside the event loop (another request waited
    21 s). It now reads in a worker thread, at most `MAX_FILE_BYTES`: a larger file is a 413 naming it
    and the page's local-file picker, nothing of it parsed."""
    workdir = tmp_path / "run"
    _record_eval(workdir)
    (workdir / "retrieval").mkdir()
    line = json.dumps({"example_id": 0, "proponent_ids": [1], "proponents": ["p"], "proponent_scores": [1.0]})
    (workdir / "retrieval" / "big.jsonl").write_text((line + "\n") * 100)
    client = _stand_in_app(workdir)
    threads = []
    real = app_lib.read_jsonl

    def spy(*args):
        try:
            asyncio.get_running_loop()
            threads.append("event loop")
        except RuntimeError:
            threads.append("worker")
        return real(*args)

    monkeypatch.setattr(app_lib, "read_jsonl", spy)
    r = client.get("/api/file", params={"path": "retrieval/big.jsonl"})
    assert r.status_code == 200 and len(r.json()) == 100 and threads == ["worker"]
    monkeypatch.setattr(app_lib, "MAX_FILE_BYTES", 50 * len(line))
    r = client.get("/api/file", params={"path": "retrieval/big.jsonl"})
    assert r.status_code == 413, r.text
    assert r.json()["error"].startswith("retrieval/big.jsonl: ") and "local-file picker" in r.json()["error"]
    assert str(tmp_path) not in r.text
    os.mkfifo(workdir / "retrieval" / "fifo.jsonl")  # never waited on
    r = client.get("/api/file", params={"path": "retrieval/fifo.jsonl"})
    assert r.status_code == 400 and "not a regular file" in r.json()["error"]


def test_eval_api_lists_the_plots_evaluate_wrote(evaluated):
    """`GET /api/eval` names the pictures evaluate wrote (table.json's `plots`) and each is served
    byte for byte."""
    workdir, _, client = evaluated
    _, _, table = _eval_files(workdir)
    got = client.get("/api/eval").json()["plots"]
    assert got["files"] == table["plots"] and "rows.png" in got["files"] and got["errors"] == [] and got["none"] is None
    for f in got["files"]:
        r = client.get("/api/eval/plot", params={"name": "eval", "file": f})
        assert r.status_code == 200 and r.content == (workdir / "eval" / f).read_bytes() and r.content.startswith(PNG)


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


@contextlib.contextmanager
def _page_in_chromium(engine):
    """The app served by uvicorn on a free port and a headless Chromium driver on its page."""
    import uvicorn
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

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
        yield driver
    finally:
        if driver is not None:
            driver.quit()
        server.should_exit = True
        thread.join(timeout=10)


def test_page_in_headless_chromium(served, tmp_path):
    _browser_or_skip()
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
    with _page_in_chromium(engine) as driver:
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


def test_query_token_scores_sum_to_each_proponents_score(served):
    """`token_scores`: each proponent's token shares (and the target's) sum to its score, and the
    record carries `retrieve_queries`' token fields; text rows and non-booleans are refused."""
    settings, workdir, engine, client = served
    prompt, target = _fact(engine, 3)
    body = {"prompt": prompt, "target": target, "k": 3, "method": "exp4", "token_scores": True}
    r = client.post("/api/query", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    for p in got["proponents"]:
        ts = p["token_scores"]
        assert len(ts["tokens"]) == len(ts["scores"]) and len(ts["target_tokens"]) == len(ts["target_scores"])
        np.testing.assert_allclose(
            sum(ts["scores"]), p["score"], rtol=2e-2
        )  # recomputed from the tokens; the index row is bf16
        np.testing.assert_allclose(sum(ts["target_scores"]), p["score"], rtol=1e-3)
    ms = rows.method_settings(settings, methods_lib.METHODS["exp4"]).replace({"retrieval.token_scores": True})
    want, _ = retrieval_stage.retrieve_queries(
        engine.run, ms, workdir, [retrieval_stage.TextQuery(0, prompt, target)], k=3
    )
    assert got["record"] == want[0]
    for bad, why in (
        (dict(body, method="bm25"), "only gradient rows"),
        (dict(body, token_scores="yes"), "true or false"),
    ):
        r = client.post("/api/query", json=bad)
        assert r.status_code == 400 and why in r.json()["error"]


def test_token_heatmap_in_headless_chromium(served):
    """The heat-map over each proponent's text: one span per token, spelled as the passage, and
    token strings from a file are shown as text, never parsed as markup."""
    _browser_or_skip()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    _, workdir, engine, client = served
    prompt, target = _fact(engine, 4)
    want = client.post(
        "/api/query", json={"prompt": prompt, "target": target, "k": 3, "method": "trackstar", "token_scores": True}
    ).json()
    hostile = '<img src=x onerror="document.title=1">'
    rec = dict(want["record"])
    rec["proponent_token_scores"] = [{"tokens": [hostile, " & <b>x</b>"], "scores": [1.0, -0.5]}]
    (workdir / "retrieval").mkdir(exist_ok=True)
    (workdir / "retrieval" / "hostile.jsonl").write_text(json.dumps(rec) + "\n")
    with _page_in_chromium(engine) as driver:
        wait = WebDriverWait(driver, 120)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))
        driver.find_element(By.ID, "prompt").send_keys(prompt)
        driver.find_element(By.ID, "target").send_keys(target)
        k = driver.find_element(By.ID, "k")
        k.clear()
        k.send_keys("3")
        Select(driver.find_element(By.ID, "method")).select_by_value("trackstar")
        driver.find_element(By.ID, "tokscores").click()
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#pane1 .item .heat")) >= 6)
        items = driver.find_elements(By.CSS_SELECTOR, "#pane1 .item")
        for item, p in zip(items, want["proponents"]):
            tokens_row, target_row = item.find_elements(By.CSS_SELECTOR, ".heat")
            spans = tokens_row.find_elements(By.CSS_SELECTOR, ".tok")
            texts = [driver.execute_script("return arguments[0].textContent", sp) for sp in spans]
            assert texts == p["token_scores"]["tokens"] and "".join(texts[:-1]) == p["text"]
            scores = [float(sp.get_attribute("data-score")) for sp in spans]
            np.testing.assert_allclose(scores, p["token_scores"]["scores"])
            assert len(target_row.find_elements(By.CSS_SELECTOR, ".tok")) == len(p["token_scores"]["target_tokens"])
        assert driver.find_element(By.ID, "error").text == ""
        # a file's token strings are data
        driver.find_element(By.ID, "filepath").send_keys("retrieval/hostile.jsonl")
        driver.find_element(By.ID, "loadpath").click()

        # The previous query's spans are still on the page until the file's render replaces them:
        # read the texts in one script call (no stale handles) until the file's are shown.
        def first_two_texts(d):
            return d.execute_script(
                "return Array.from(document.querySelectorAll('#pane1 .item .heat .tok'))"
                ".slice(0, 2).map(e => e.textContent)"
            )

        wait.until(lambda d: first_two_texts(d) == [hostile, " & <b>x</b>"])
        assert not driver.find_elements(By.CSS_SELECTOR, "#pane1 img, #pane1 .heat b")
        assert driver.title != "1"


def test_browse_view_in_headless_chromium(evaluated, tmp_path):
    """Open the browse view, filter by a relation: the rows shown are the API's filtered queries."""
    _browser_or_skip()
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    _, engine, client = evaluated
    facets = client.get("/api/eval").json()["facets"]
    relation = facets["relation"][1]
    want = [q["query_id"] for q in client.get("/api/eval", params={"relation": relation}).json()["queries"]]
    everything = [q["query_id"] for q in client.get("/api/eval").json()["queries"]]
    assert 0 < len(want) < len(everything)
    with _page_in_chromium(engine) as driver:
        # A re-render between finding the rows and reading them leaves stale elements: look again.
        wait = WebDriverWait(driver, 60, ignored_exceptions=(StaleElementReferenceException,))

        def shown(d):
            rows = d.find_elements(By.CSS_SELECTOR, "#evalqueries tr.q")
            return [int(r.get_attribute("data-qid")) for r in rows]

        wait.until(lambda d: d.find_element(By.ID, "browse").is_displayed())
        driver.find_element(By.ID, "browse").click()
        wait.until(lambda d: shown(d) == everything)
        table_rows = client.get("/api/eval").json()["table"]["rows"]
        # The metrics table and the query rows render from one response, but not in one paint: wait.
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#metrics tr")) == 1 + len(table_rows))
        Select(driver.find_element(By.ID, "f-relation")).select_by_value(relation)
        wait.until(lambda d: shown(d) == want)
        cells = driver.find_elements(By.CSS_SELECTOR, "#evalqueries tr.q td:nth-child(2)")
        assert {c.text for c in cells} == {relation}
        driver.find_element(By.CSS_SELECTOR, "#evalqueries tr.q").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#evaldetail .gold"))
        assert driver.find_element(By.ID, "error").text == ""
        driver.save_screenshot(str(tmp_path / "browse.png"))
        assert (tmp_path / "browse.png").stat().st_size > 0


def test_hostile_retrieval_file_renders_as_text_in_headless_chromium(served, tmp_path):
    """Stored XSS: a retrieval jsonl whose every shown field holds markup with an onerror
    handler, loaded by workdir path and as a local file: the handler never runs (a global it
    would set stays unset), no element of it exists, and the markup shows as literal text."""
    _browser_or_skip()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _, workdir, engine, _ = served
    payload = '<img src=x onerror="window.__pwned=(window.__pwned||0)+1">'
    quote = '" onmouseover="window.__pwned=1" x="'  # breaks out of a quoted attribute
    rec = {
        "example_id": payload,
        "query_set": payload,
        "inputs_plaintext": payload + " capital",
        "targets_plaintext": payload,
        "proponents": [payload + " capital text", "plain <b>bold</b> passage"],
        "proponent_ids": [payload, quote],
        "proponent_scores": [1.0, 0.5],
        "opponents": [payload],
        "opponent_ids": [3],
        "opponent_scores": [-1.0],
    }
    line = json.dumps(rec) + "\n"
    (workdir / "retrieval").mkdir(exist_ok=True)
    (workdir / "retrieval" / "hostile.jsonl").write_text(line)
    (tmp_path / "hostile.jsonl").write_text(line)
    with _page_in_chromium(engine) as driver:
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))

        def check(how):
            items = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#pane1 .item"))
            time.sleep(0.3)  # let an <img> that slipped in fail to load and fire its handler
            assert driver.execute_script("return window.__pwned") is None, how
            assert driver.find_elements(By.CSS_SELECTOR, "#pane1 img, #filequeries img, [onerror], [onmouseover]") == []
            assert driver.find_element(By.CSS_SELECTOR, "#pane1 h3").text == payload, how
            assert [i.get_attribute("data-id") for i in items] == [payload, quote, "3"], how
            assert f"id={payload} score=1.000" in items[0].text and "plain <b>bold</b> passage" in items[1].text
            assert (
                driver.find_element(By.CSS_SELECTOR, "#filequeries option").text
                == f"{payload}: {payload} capital{payload}"
            )
            assert driver.find_element(By.ID, "error").text == "", how

        driver.find_element(By.ID, "filepath").send_keys("retrieval/hostile.jsonl")
        driver.find_element(By.ID, "loadpath").click()
        check("load path")
        driver.execute_script("document.getElementById('pane1').replaceChildren()")
        driver.find_element(By.ID, "localfile").send_keys(str(tmp_path / "hostile.jsonl"))
        check("local file")


def test_hostile_evaluation_renders_as_text_in_headless_chromium(evaluated):
    """The browse view over an evaluation whose relation, bucket, prompt, target, model
    completion, method label and query count and proponent texts hold markup: no handler
    runs, the markup is the cells' and headings' literal text."""
    _browser_or_skip()
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    workdir, engine, _ = evaluated
    queries, recs, table = _eval_files(workdir)
    payload = '<img src=x onerror="window.__pwned=1">'
    for q in queries:
        q.update(relation=payload, bucket=payload, target=payload, prompt=payload + q["prompt"])
    for row in table["rows"]:
        row.update(label=payload, num_queries=payload)  # the old page escaped the label, not the count
    evil = workdir / "evil"
    (evil / "retrievals").mkdir(parents=True)
    dump = lambda rows: "".join(json.dumps(x) + "\n" for x in rows)  # noqa: E731
    (evil / "queries.jsonl").write_text(dump(queries))
    (evil / "table.json").write_text(json.dumps(table))
    for m, recs_m in recs.items():
        for x in recs_m:
            x.update(model_completion=payload, proponents=[payload + t for t in x["proponents"]])
        (evil / "retrievals" / f"{m}.jsonl").write_text(dump(recs_m))
    try:
        with _page_in_chromium(engine) as driver:
            wait = WebDriverWait(driver, 60, ignored_exceptions=(StaleElementReferenceException,))
            driver.find_element(By.ID, "browse").click()
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#evalname option[value=evil]"))
            Select(driver.find_element(By.ID, "evalname")).select_by_value("evil")
            cells = lambda d: [c.text for c in d.find_elements(By.CSS_SELECTOR, "#evalqueries tr.q td:nth-child(2)")]  # noqa: E731
            wait.until(lambda d: cells(d) == [payload] * len(queries))
            driver.find_element(By.CSS_SELECTOR, "#evalqueries tr.q").click()
            items = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#evaldetail .item"))
            time.sleep(0.3)  # let an <img> that slipped in fail to load and fire its handler
            assert driver.execute_script("return window.__pwned") is None
            assert driver.find_elements(By.CSS_SELECTOR, "img, [onerror]") == []
            assert driver.find_element(By.CSS_SELECTOR, "#evaldetail h3").text.startswith(payload)
            assert [c.text for c in driver.find_elements(By.CSS_SELECTOR, "#metrics td")[:2]] == [payload, payload]
            assert {o.text for o in driver.find_elements(By.CSS_SELECTOR, "#f-relation option, #f-bucket option")} == {
                "(all)",
                payload,
            }
            assert any(payload in i.text for i in items)
            assert driver.find_element(By.ID, "error").text == ""
    finally:
        shutil.rmtree(evil)


def test_evaluation_plots_in_headless_chromium(evaluated, tmp_path):
    """The browse view shows evaluate's rows.png as a loaded <img> (natural width > 0) with no
    CSP violation; an evaluation whose name is markup and whose plots are a hostile non-PNG and a
    link out of its folder shows two error lines and no image, and runs nothing."""
    _browser_or_skip()
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    workdir, engine, _ = evaluated
    payload = '<img src=x onerror="window.__pwned=1">'
    evil = workdir / payload
    shutil.copytree(workdir / "eval", evil)
    for f in browse.PLOT_FILES:
        (evil / f).unlink(missing_ok=True)
    (evil / "rows.png").write_bytes(b'<svg xmlns="http://www.w3.org/2000/svg" onload="window.__pwned=2"/>')
    os.symlink(workdir / "eval" / "rows.png", evil / "lambda.png")
    shown = lambda d: [  # noqa: E731
        (i.get_attribute("data-file"), d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", i))
        for i in d.find_elements(By.CSS_SELECTOR, "#evalplots img")
    ]
    try:
        with _page_in_chromium(engine) as driver:
            driver.execute_script(
                "window.__csp = []; document.addEventListener('securitypolicyviolation',"
                " (e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI))"
            )
            wait = WebDriverWait(driver, 60, ignored_exceptions=(StaleElementReferenceException,))
            driver.find_element(By.ID, "browse").click()
            # Loaded, or replaced by its error line (a CSP or server refusal): either ends the wait.
            wait.until(
                lambda d: (
                    d.find_elements(By.CSS_SELECTOR, "#evalplots .plot-error")
                    or (shown(d) and all(w for _, w in shown(d)))
                )
            )
            assert driver.execute_script("return window.__csp") == []
            assert driver.find_elements(By.CSS_SELECTOR, "#evalplots .plot-error") == []
            assert [f for f, _ in shown(driver)] == ["rows.png"] and shown(driver)[0][1] > 0
            img = driver.find_element(By.CSS_SELECTOR, "#evalplots img")
            assert img.is_displayed() and img.size["width"] > 0
            assert driver.execute_script("return window.__csp") == []
            assert driver.find_element(By.ID, "error").text == ""
            driver.save_screenshot(str(tmp_path / "plots.png"))
            Select(driver.find_element(By.ID, "evalname")).select_by_value(payload)
            errors = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#evalplots .plot-error"))
            time.sleep(0.3)  # let an <img> that slipped in load or fail and fire its handler
            assert [e.text.split(": ")[0] for e in errors] == [f"{payload}/rows.png", f"{payload}/lambda.png"]
            assert "not a PNG" in errors[0].text and "symbolic link" in errors[1].text
            assert driver.find_elements(By.CSS_SELECTOR, "#evalplots img, [onerror], svg") == []
            assert driver.execute_script("return window.__pwned") is None
            assert driver.execute_script("return window.__csp") == []
            assert driver.find_element(By.ID, "error").text == ""
    finally:
        shutil.rmtree(evil)
