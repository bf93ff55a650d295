"""Loads our retrieval jsonl files in the paper authors' own viewer (PAIR-code/pretraining-tda).

A developer check, not a test: the viewer is their code (Apache-2.0), so it is not vendored
here; point `--viewer` at the `docs/demo` folder of a checkout of
github.com/PAIR-code/pretraining-tda (its prebuilt `index.html` + `bundle.js`). The folder and
our files are served from a temporary directory on localhost, the page is opened in headless
Chromium with `?jsonl_path=...&sxs_jsonl_path=...&example_id=...` (the URL parameters of the
viewer's `app.ts`), and this prints one JSON report:

- `parsed`: the viewer's own console line "DataLoaderService: parsed N examples from ..." for
  each file, against the number of lines in it;
- `shown`: whether the selected example's prompt and each of its proponents' text (both files in
  side-by-side mode) appear in the rendered page (text collected through the shadow roots);
- `viewer_metrics` / `our_metrics`: the recall@10, precision@10 and MRR the viewer computes over
  the main file (its `metrics.ts`) and ours (`evaluation.metrics.ground_truth_metrics`) on the
  same lines, to the viewer's 3 decimals;
- `errors`: SEVERE console entries other than failed font downloads (the machine is offline).

    python tools/pair_viewer_check.py --viewer=<checkout>/docs/demo \\
        --jsonl=runs/smollm2_table1/eval/retrievals/trackstar.jsonl \\
        --sxs=runs/smollm2_table1/eval/retrievals/bm25.jsonl --example_id=0 --screenshot=/tmp/pair.png

Needs chromium, chromedriver and selenium (as `tests/test_serve.py`'s browser tests).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import pathlib
import re
import shutil
import socketserver
import sys
import tempfile
import threading
import time

from trackstar_jax.evaluation import metrics

# All text of the page, through open shadow roots (the viewer is lit elements).
DEEP_TEXT_JS = """
function walk(n, out) {
  if (n.nodeType === Node.TEXT_NODE) { out.push(n.textContent); return; }
  if (n.shadowRoot) walk(n.shadowRoot, out);
  for (const c of n.childNodes) walk(c, out);
}
const out = []; walk(document.body, out); return out.join(' ');
"""


def _norm(text: str) -> str:
    return " ".join(text.split())


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one JSON report on stdout, no access log
        pass


@contextlib.contextmanager
def _serve(root: pathlib.Path):
    handler = functools.partial(_Quiet, directory=str(root))
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}"
        finally:
            httpd.shutdown()


def _driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1200"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def check(viewer: pathlib.Path, jsonl: pathlib.Path, sxs: pathlib.Path | None, example_id: int, screenshot: str | None):
    files = {"main.jsonl": jsonl} | ({"sxs.jsonl": sxs} if sxs else {})
    lines = {k: [json.loads(x) for x in p.read_text().splitlines() if x.strip()] for k, p in files.items()}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        shutil.copytree(viewer, root, dirs_exist_ok=True)
        for name, p in files.items():
            shutil.copy(p, root / name)
        with _serve(root) as base, contextlib.closing(_driver()) as driver:
            url = f"{base}/index.html?jsonl_path=/main.jsonl&example_id={example_id}"
            if sxs:
                url += "&sxs_jsonl_path=/sxs.jsonl"
            driver.get(url)
            logs, text, deadline = [], "", time.time() + 60
            want = [_norm(lines["main.jsonl"][example_id]["inputs_plaintext"])]
            while time.time() < deadline:  # the viewer loads asynchronously
                logs += driver.get_log("browser")
                text = _norm(driver.execute_script(DEEP_TEXT_JS))
                if all(w in text for w in want) and len(re.findall("parsed \\d+ examples", str(logs))) >= len(files):
                    break
                time.sleep(1)
            time.sleep(2)
            logs += driver.get_log("browser")
            text = _norm(driver.execute_script(DEEP_TEXT_JS))
            if screenshot:
                driver.save_screenshot(screenshot)
    parsed = {}
    for name in files:
        m = re.search(rf"parsed (\d+) examples from [^\"]*/{re.escape(name)}", " ".join(e["message"] for e in logs))
        parsed[name] = {"viewer": int(m.group(1)) if m else None, "lines": len(lines[name])}
    shown = {
        name: {
            "prompt": _norm(recs[example_id]["inputs_plaintext"]) in text,
            "proponents": sum(_norm(p) in text for p in recs[example_id]["proponents"]),
            "of": len(recs[example_id]["proponents"]),
        }
        for name, recs in lines.items()
    }
    # The viewer's own metrics (its metrics.ts, over all examples of the main file) against ours
    # (`evaluation.metrics.ground_truth_metrics`, a port of it) on the same lines.
    shown_metrics = {
        name: float(m.group(1))
        for name in ("recall@10", "precision@10", "mrr_first")
        if (m := re.search(rf"{re.escape(name)}\s+([0-9.]+)", text))
    }
    recs = [r for r in lines["main.jsonl"] if "proponent_correct" in r]
    ours = [metrics.ground_truth_metrics(r["proponent_correct"]) for r in recs]
    our_metrics = {
        name: round(sum(o[key] for o in ours) / max(len(ours), 1), 3)
        for name, key in (("recall@10", "recall_at_10"), ("precision@10", "precision_at_10"), ("mrr_first", "mrr"))
    }
    errors = [
        e["message"]
        for e in logs
        if e["level"] == "SEVERE" and not re.search(r"fonts\.(googleapis|gstatic)\.com|favicon", e["message"])
    ]
    ok = (
        all(v["viewer"] == v["lines"] for v in parsed.values())
        and all(s["prompt"] and s["proponents"] == s["of"] for s in shown.values())
        and not errors
        and all(abs(shown_metrics.get(k, -1.0) - v) <= 0.0015 for k, v in our_metrics.items())
    )
    return {
        "ok": ok,
        "parsed": parsed,
        "shown": shown,
        "viewer_metrics": shown_metrics,
        "our_metrics": our_metrics,
        "errors": errors,
        "example_id": example_id,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--viewer", required=True, type=pathlib.Path, help="docs/demo of a pretraining-tda checkout")
    ap.add_argument("--jsonl", required=True, type=pathlib.Path)
    ap.add_argument("--sxs", type=pathlib.Path, default=None, help="a second file, side by side (rows paired by line)")
    ap.add_argument("--example_id", type=int, default=0, help="line number of the example to open")
    ap.add_argument("--screenshot", default=None)
    a = ap.parse_args(argv)
    if not (a.viewer / "index.html").is_file() or not (a.viewer / "bundle.js").is_file():
        ap.error(f"--viewer={a.viewer}: no index.html and bundle.js there (use <checkout>/docs/demo)")
    report = check(a.viewer, a.jsonl, a.sxs, a.example_id, a.screenshot)
    print(json.dumps(report, indent=1, ensure_ascii=False))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
