"""Refreshes ``.ci/test_durations.json`` (seconds per test file, which conftest.py uses to start
the longest files first) from pytest's ``--durations=0`` report read on stdin, e.g.

    python -m pytest plugins -q --durations=0 | python .ci/durations.py

Files in the report replace their entries; the others keep theirs, so the suite can be measured
in pieces. Whole seconds are enough: the numbers only order the files."""
import json
import re
import sys
from pathlib import Path

PATH = Path(__file__).with_name("test_durations.json")
LINE = re.compile(r"^\s*([\d.]+)s\s+(setup|call|teardown)\s+(\S+?)::")


def main() -> None:
    seen: dict[str, float] = {}
    for line in sys.stdin:
        m = LINE.match(line)
        if m:
            seen[m.group(3)] = seen.get(m.group(3), 0.0) + float(m.group(1))
    table = json.loads(PATH.read_text()) if PATH.exists() else {}
    table.update({f: round(s) for f, s in seen.items()})
    PATH.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
    print(f"{len(seen)} files measured, {len(table)} in {PATH.name}")


if __name__ == "__main__":
    main()
