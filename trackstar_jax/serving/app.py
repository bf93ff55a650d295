"""The proponent explorer's HTTP API (Starlette) and its static page.

Routes (JSON in and out; every refusal is a 4xx with `{"error": message}`, and the server
keeps serving):

Every request passes `guard.Guard` first (Host allow-list, same-origin / JSON-only POSTs,
streamed body limit, CSP): see `trackstar_jax.serving.guard`.

- `GET /` : the page (`static/index.html`, plain JS).
- `GET /api/methods` : the methods on offer (`Engine.describe`).
- `POST /api/query` : `{"prompt", "target"?, "k", "method"}` -> `{"completion", "target",
  "proponents": [{"example_id", "score", "text"}], "opponents", "method", "seconds", "record"}`.
  No target: the model's greedy completion is the target ("debugging incorrect predictions").
- `GET /api/file?path=<relative to the workdir>` : a retrieval jsonl as a JSON list (each
  record's known fields type-checked, `browse.RECORD_FIELDS`; NaN scores become null), read in
  a worker thread; over `MAX_FILE_BYTES` a 413 (the page's local-file picker reads any size).
- `GET /api/eval?name=eval&relation=&bucket=&correct=` : an evaluation's metrics table, its
  filter values and the queries that pass the filters, each with its gold passages, the
  model's completion / correctness, and per method the 1-based rank of the first gold passage
  and the tail-patch deltas (`browse.Browser.summary`; 404 when the run has no such
  evaluation, 400 for an unknown filter or value).
- `GET /api/eval/query?name=eval&query_id=&k=` : one evaluation query's proponents per method
  with gold labels and tail-patch deltas, and its raw records (`browse.Browser.query_detail`).
- `GET /api/eval/plot?name=eval&file=rows.png` : one of the evaluation's pictures
  (`browse.PLOT_FILES`, written by `evaluation.plots` beside table.md) as `image/png`
  (`browse.Browser.plot`): any other file name, or one not written, is a 404; a symlink a 403;
  a file that is not a PNG a 500 naming it, none of its bytes sent. `GET /api/eval` lists the
  pictures the page can show (`plots`).

`name` is an evaluation folder `browse.list_evals` lists; without it, the served settings'
evaluation folder (`evaluation.report.eval_dir`) when it is one, else `eval`. An evaluation
whose records have fields of the wrong type (string proponent ids, say) is a 400 naming
`<name>/<file>:<line>` and the field.

Every endpoint reads files under one rule, `browse.servable`: relative to the workdir, staying
in it, and no symbolic link on the path below the workdir (folder or file), wherever it
points: a 403 naming the link.
"""

from __future__ import annotations

import json
import pathlib
from typing import Sequence

from starlette import applications, concurrency, middleware, requests, responses, routing
from starlette.staticfiles import StaticFiles

from trackstar_jax import files
from trackstar_jax.evaluation import report as report_lib
from trackstar_jax.evaluation import results as results_lib
from trackstar_jax.serving import browse as browse_lib
from trackstar_jax.serving import engine as engine_lib
from trackstar_jax.serving import guard as guard_lib

STATIC_DIR = pathlib.Path(__file__).parent / "static"
MAX_BODY_BYTES = 1 << 20  # a query is a few hundred bytes; refuse anything silly before parsing
MAX_FILE_BYTES = 16 << 20  # /api/file: a retrieval file of ~1,000 queries x 10 proponents; larger ones are 413s


def _error(status: int, message: str) -> responses.JSONResponse:
    return responses.JSONResponse({"error": message}, status_code=status)


def read_jsonl(workdir: pathlib.Path, rel: str) -> list[dict]:
    """`GET /api/file`: the records of the retrieval jsonl `rel` (`browse.read_servable`: the one
    symlink rule, at most `MAX_FILE_BYTES`), each `browse.check_record`-ed, non-finite numbers
    as None. Runs in a worker thread (a large file never stalls the event loop).

    Raises:
      PermissionError (403) / FileNotFoundError (404) / browse.TooLargeError (413) / ValueError
      (400: not a .jsonl, not a regular file, or the first malformed line as `rel:line`; the
      server's own paths stay out of messages).
    """
    path = browse_lib.servable(workdir, rel)
    if path.suffix != ".jsonl":
        raise ValueError(f"path {rel!r}: only retrieval .jsonl files are served")
    try:
        data = browse_lib.read_servable(workdir, rel, MAX_FILE_BYTES)
    except browse_lib.TooLargeError as e:
        raise browse_lib.TooLargeError(
            f"{e}: /api/file sends at most {MAX_FILE_BYTES >> 20} MiB; open a larger file with the page's "
            "local-file picker (read in the browser)"
        ) from None
    out = []
    try:
        for where, rec in files.read_jsonl(rel, data):
            why = browse_lib.check_record(rec)
            if why is not None:
                raise ValueError(f"{where}: {why}")
            out.append(browse_lib.finite(rec))
    except files.InputError as e:
        raise ValueError(str(e)) from None
    return out


def make_app(engine: engine_lib.Engine, *, hosts: Sequence[str] = guard_lib.LOOPBACK_HOSTS) -> applications.Starlette:
    """The Starlette app over a loaded engine, answering requests whose Host is in `hosts`
    (`guard.allowed_hosts`: loopback, the bound address, names given by the user)."""
    page = (STATIC_DIR / "index.html").read_bytes()  # served from memory: its CSP hash stays its own

    async def methods(request: requests.Request) -> responses.Response:
        return responses.JSONResponse(engine.describe())

    def run_query(body: dict) -> dict:
        return engine.query(
            body.get("prompt"),
            body.get("target"),
            body.get("k", 10),
            body.get("method", engine.describe()["default"]),
            token_scores=body.get("token_scores", False),
        )

    async def query(request: requests.Request) -> responses.Response:
        raw = await request.body()  # at most MAX_BODY_BYTES: the guard counts them as they arrive
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # not JSON / UTF-8, an int of >4300 digits, deep nesting
            return _error(400, f"request body is not JSON: {type(e).__name__}: {str(e)[:200]}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object {prompt, target?, k, method}")
        unknown = sorted(set(body) - {"prompt", "target", "k", "method", "token_scores"})
        if unknown:
            return _error(
                400, f"unknown fields {unknown}; expected prompt, target (optional), k, method, token_scores (optional)"
            )
        try:
            # Runs in a worker thread (the device work blocks); the engine's lock serializes queries.
            out = await concurrency.run_in_threadpool(run_query, body)
        except engine_lib.QueryError as e:
            return _error(400, str(e))
        return responses.JSONResponse(out)

    async def file(request: requests.Request) -> responses.Response:
        rel = request.query_params.get("path", "")
        try:
            return responses.JSONResponse(await concurrency.run_in_threadpool(read_jsonl, engine.workdir, rel))
        except PermissionError as e:
            return _error(403, str(e))
        except FileNotFoundError as e:
            return _error(404, str(e))
        except browse_lib.TooLargeError as e:
            return _error(413, str(e))
        except ValueError as e:
            return _error(400, str(e))

    browser = browse_lib.Browser(engine.workdir, engine.run.corpus.texts)
    own = report_lib.eval_dir(engine.settings, engine.workdir)
    default_eval = own.name if own.parent == engine.workdir else results_lib.EVAL_DIR

    def _single(request: requests.Request, allowed: tuple[str, ...]) -> dict[str, str]:
        """The query parameters, each given at most once and each in `allowed` (BrowseError otherwise)."""
        params = request.query_params
        unknown = sorted(set(params.keys()) - set(allowed))
        if unknown:
            raise browse_lib.BrowseError(f"unknown parameters {unknown}; expected some of {list(allowed)}")
        repeated = sorted(key for key in params.keys() if len(params.getlist(key)) > 1)
        if repeated:
            raise browse_lib.BrowseError(f"parameters {repeated} given more than once")
        return dict(params.items())

    async def _browse(call, request: requests.Request, allowed: tuple[str, ...]) -> responses.Response:
        try:
            params = _single(request, allowed)
            out = await concurrency.run_in_threadpool(call, params.pop("name", default_eval), params)
        except browse_lib.BrowseError as e:  # also: records of the wrong type in the evaluation's files
            return _error(400, str(e))
        except FileNotFoundError as e:
            return _error(404, str(e))
        except PermissionError as e:  # `browse.servable`: a link
            return _error(403, str(e))
        except (ValueError, files.InputError) as e:  # anything else that does not read back: still JSON
            return _error(500, str(e))
        return responses.JSONResponse(out)

    async def evaluation(request: requests.Request) -> responses.Response:
        return await _browse(browser.summary, request, ("name",) + browse_lib.FILTERS)

    def _detail(name: str, params: dict) -> dict:
        k = browse_lib.parse_int("k", params.get("k", "10"), 1, engine.max_k)
        if "query_id" not in params:
            raise browse_lib.BrowseError("query_id: missing")
        return browser.query_detail(name, params["query_id"], k)

    async def eval_query(request: requests.Request) -> responses.Response:
        return await _browse(_detail, request, ("name", "query_id", "k"))

    async def plot(request: requests.Request) -> responses.Response:
        try:
            params = _single(request, ("name", "file"))
            data = await concurrency.run_in_threadpool(
                browser.plot, params.get("name", default_eval), params.get("file", "")
            )
        except browse_lib.BrowseError as e:
            return _error(400, str(e))
        except FileNotFoundError as e:
            return _error(404, str(e))
        except PermissionError as e:
            return _error(403, str(e))
        except (ValueError, OSError) as e:  # not a PNG / regular file: nothing of it is sent
            return _error(500, str(e))
        # The guard adds nosniff (a browser never reads it as anything but a PNG); no-store: a rerun rewrites it.
        return responses.Response(data, media_type="image/png", headers={"Cache-Control": "no-store"})

    async def index(request: requests.Request) -> responses.Response:
        return responses.Response(page, media_type="text/html")

    return applications.Starlette(
        routes=[
            routing.Route("/", index),
            routing.Route("/api/methods", methods),
            routing.Route("/api/query", query, methods=["POST"]),
            routing.Route("/api/file", file),
            routing.Route("/api/eval", evaluation),
            routing.Route("/api/eval/query", eval_query),
            routing.Route("/api/eval/plot", plot),
            routing.Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
        ],
        middleware=[
            middleware.Middleware(
                guard_lib.Guard, hosts=hosts, max_body_bytes=MAX_BODY_BYTES, csp=guard_lib.page_csp(page)
            )
        ],
    )
