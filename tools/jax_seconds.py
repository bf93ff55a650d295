"""A pytest plugin that says where each test's JAX time goes: tracing, lowering to MLIR, and
backend compile (in a warm run, loading the executable from the persistent cache), per test, from
JAX's own `jax.monitoring` duration events. It measured session 41's split of the warm suite
(BUILD_NOTES §14); nothing in the package or the suite depends on it.

Usage (every process of the run appends its lines, xdist workers included):

    TRACKSTAR_JAX_SECONDS=/tmp/jax_seconds.tsv PYTHONPATH=. \\
        bash launch/test.sh -q -p no:cacheprovider -p tools.jax_seconds
    python tools/jax_seconds.py /tmp/jax_seconds.tsv      # totals, then the heaviest tests

A line is `worker<TAB>kind<TAB>seconds<TAB>events<TAB>node id`; `kind` is trace, lower or compile.
"""

from __future__ import annotations

import atexit
import collections
import os
import pathlib
import sys

ENV = "TRACKSTAR_JAX_SECONDS"
# JAX's event names (jax._src.dispatch) and the short kind each is reported as
KINDS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_seconds: collections.Counter = collections.Counter()
_events: collections.Counter = collections.Counter()
_node = ["<collection>"]  # the running test's node id; events outside a test go to collection


def _listen(event: str, duration: float, **_) -> None:
    kind = KINDS.get(event)
    if kind:
        _seconds[_node[0], kind] += duration
        _events[_node[0], kind] += 1


def _write() -> None:
    path = os.environ.get(ENV)
    if not path or not _seconds:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(path, "a") as f:  # one write per process: lines of two workers do not interleave
        f.write("".join(f"{worker}\t{k}\t{s:.4f}\t{_events[n, k]}\t{n}\n" for (n, k), s in _seconds.items()))


def pytest_configure(config) -> None:
    if not os.environ.get(ENV):
        raise SystemExit(f"tools.jax_seconds: set {ENV} to the file its lines go to")
    import jax  # noqa: PLC0415  (after conftest has set JAX's environment)

    jax.monitoring.register_event_duration_secs_listener(_listen)
    atexit.register(_write)


def pytest_runtest_protocol(item, nextitem) -> None:
    _node[0] = item.nodeid


def summary(text: str, top: int = 20) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """`({kind: seconds summed over every test}, [(seconds, node id)] of the `top` heaviest tests)`
    from the plugin's lines."""
    kinds: collections.Counter = collections.Counter()
    tests: collections.Counter = collections.Counter()
    for line in text.splitlines():
        _, kind, seconds, _, node = line.split("\t", 4)
        kinds[kind] += float(seconds)
        tests[node] += float(seconds)
    return dict(kinds), [(s, n) for n, s in tests.most_common(top)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    kinds, heaviest = summary(pathlib.Path(argv[1]).read_text())
    print("  ".join(f"{k} {s:.1f} s" for k, s in sorted(kinds.items())))
    for s, node in heaviest:
        print(f"{s:7.2f} s  {node}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
