"""Run the benchmarks: `make bench` or `python -m tests.bench [name ...] [--option value ...]`.

Each `tests/bench/bench_<name>.py` defines `run() -> dict` returning
`{"title": str, "rows": [dict, ...], "notes": [str, ...]}`; rows are printed as
a table and the whole result is written to `bench-results/<name>.json`, with a PNG plot next to it
where tests/bench/plots.py draws one (serve, fairness, loader).
Every benchmark measures its own baseline in the same run (torch's DataLoader,
transformers, the roofline), because this machine is shared and noisy.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path

import tests.bench as package
from runtime.progress import Progress
from tests.bench import plots

OUT_DIR = Path("bench-results")


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return "" if value is None else str(value)

    table = [columns] + [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _options(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Bench names, and `--name value` options passed to each bench's run() (e.g. --replicas 4)."""
    names, options, i = [], {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            key, _, value = argv[i][2:].partition("=")
            if not value:
                i += 1
                value = argv[i] if i < len(argv) else ""
            options[key.replace("-", "_")] = value
        else:
            names.append(argv[i])
        i += 1
    return names, options


def main(argv: list[str]) -> int:
    argv, options = _options(argv)
    names = sorted(
        m.name[len("bench_") :] for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("bench_")
    )
    wanted = argv or names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {names}", file=sys.stderr)
        return 2
    OUT_DIR.mkdir(exist_ok=True)
    for name in wanted:
        module = importlib.import_module(f"tests.bench.bench_{name}")
        started = time.time()
        progress = Progress(f"bench {name} ({wanted.index(name) + 1}/{len(wanted)})").ticking()
        try:
            result = module.run(**options)
        finally:
            progress.close(keep=False)
        result.setdefault("name", name)
        result.setdefault("machine", plots.machine())
        result["wall_seconds"] = round(time.time() - started, 1)
        print(f"\n== {result.get('title', name)} ({result['wall_seconds']} s)")
        print(format_table(result.get("rows", [])))
        for note in result.get("notes", []):
            print(f"  * {note}")
        path = OUT_DIR / f"{name}.json"
        path.write_text(json.dumps(result, indent=2, default=str))
        print(f"  -> {path}")
        picture = plots.write(name, result, OUT_DIR)
        if picture:
            print(f"  -> {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
