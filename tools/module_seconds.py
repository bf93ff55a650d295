"""Writes tests/module_seconds.json, the measured seconds of each test module, from the output of
`bash launch/test.sh -q -p no:cacheprovider --durations=0` (every setup, call and teardown line).

conftest hands modules to the xdist workers heaviest first (longest-processing-time order), so
that neither worker is left running a long module alone at the end; the figures only order the
modules and never change a result. Usage: `python tools/module_seconds.py LOG`.
"""

import collections
import json
import pathlib
import re
import sys

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "module_seconds.json"
LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+tests/(\S+?\.py)::")


def module_seconds(text: str) -> dict[str, float]:
    """`{module file: summed seconds}` of a `--durations=0` report, heaviest first."""
    seconds: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if m := LINE.match(line):
            seconds[m[2]] += float(m[1])
    return {name: round(s, 1) for name, s in seconds.most_common()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = module_seconds(pathlib.Path(argv[1]).read_text())
    if not seconds:
        print(f"{argv[1]}: no duration lines (run pytest with --durations=0)", file=sys.stderr)
        return 1
    OUT.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{OUT}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
