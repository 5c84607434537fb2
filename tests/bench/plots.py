"""PNG plots of benchmark results, written next to their JSON by `make bench` (matplotlib, no display).

    python -m tests.bench.plots            # redraw bench-results/*.png from the JSON already there

serve: output tokens/s and TTFT p50/p99 against concurrency; fairness: each tenant's service rate
over time in the overload phase, one panel per policy; loader: accelerator utilization per epoch,
the clairvoyant loader against torch's; sizes: one stream's decode against the bytes a step reads, both
engines and the bandwidth roofline; fair_locality: throughput, hit rate, service gap (with DLPM's bound)
and a light tenant's TTFT per policy or router. Each figure names the machine the numbers came from.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def machine() -> str:
    """CPU model and core count, e.g. 'AMD EPYC 7B13, 2 cores' (what a reader needs to weigh the numbers)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
            model = names[0] if names else model
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _title(fig: Figure, result: dict) -> None:
    fig.suptitle(f"{result.get('title', result.get('name', ''))}\n{result.get('machine', '')}", fontsize=9)


def serve(result: dict) -> Figure | None:
    rows = [r for r in result.get("rows", []) if str(r.get("workload", "")).startswith("concurrency ")]
    if not rows:
        return None
    concurrency = [int(r["workload"].split()[1]) for r in rows]
    fig, (throughput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    throughput.plot(concurrency, [r["output tok/s"] for r in rows], marker="o", label="server (HTTP)")
    offline = [r for r in result["rows"] if str(r.get("workload", "")).startswith("offline engine")]
    if offline:
        throughput.axhline(
            offline[0]["output tok/s"], linestyle="--", color="gray", label=offline[0]["workload"]
        )
    throughput.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput")
    ttft.plot(concurrency, [r["TTFT p50 ms"] / 1000 for r in rows], marker="o", label="p50")
    ttft.plot(concurrency, [r["TTFT p99 ms"] / 1000 for r in rows], marker="s", label="p99")
    ttft.set(xscale="log", xlabel="concurrent requests", ylabel="seconds", title="Time to first token")
    for ax in (throughput, ttft):
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.grid(alpha=0.3)
        ax.legend()
    _title(fig, result)
    fig.tight_layout()
    return fig


PHASES = {"overload": "A at 2x capacity, B at 0.5x", "proportional": "three tenants at rates 1:2:6"}


def _service_since_start(samples: list[dict], tenant: str) -> tuple[list[float], list[float]]:
    """Tokens served to `tenant` since the phase began (the server's counter, which persists across
    phases, minus its first sample), at each /metrics sample."""
    key = f"tenant_service_tokens_total[{tenant}]"
    points = [(s["t"], s[key]) for s in samples if key in s]
    if not points:
        return [], []
    return [t for t, _ in points], [v - points[0][1] for _, v in points]


def fairness(result: dict) -> Figure | None:
    runs = {
        (phase, policy): result[f"{phase}_{policy}_metrics"]
        for phase in PHASES
        for policy in ("vtc", "fcfs")
        if result.get(f"{phase}_{policy}_metrics")
    }
    if not runs:
        return None
    phases = [p for p in PHASES if any(phase == p for phase, _ in runs)]
    fig, axes = plt.subplots(len(phases), 2, figsize=(10, 3.6 * len(phases)), squeeze=False)
    for row, phase in enumerate(phases):
        for col, policy in enumerate(("vtc", "fcfs")):
            ax, samples = axes[row][col], runs.get((phase, policy), [])
            tenants = sorted(
                {
                    k[k.index("[") + 1 : -1]
                    for s in samples
                    for k in s
                    if k.startswith("tenant_service_tokens_total[")
                }
            )
            for tenant in tenants:
                times, served = _service_since_start(samples, tenant)
                if served and served[-1] > 0:  # tenants of other phases keep a flat counter: not drawn
                    ax.plot(times, served, label=f"tenant {tenant}")
            ax.set(
                title=f"{policy}, {phase} ({PHASES[phase]})",
                xlabel="seconds into the phase",
                ylabel="tokens served (cumulative)",
            )
            ax.grid(alpha=0.3)
            if ax.get_lines():
                ax.legend()
    _title(fig, result)
    fig.tight_layout()
    return fig


def loader(result: dict) -> Figure | None:
    rows = [r for r in result.get("rows", []) if r.get("utilization") is not None and "config" in r]
    if not rows:
        return None
    configs = list(dict.fromkeys(r["config"] for r in rows))
    columns = min(2, len(configs))
    lines = -(-len(configs) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5 * columns, 3.6 * lines), sharey=True, squeeze=False)
    for ax in axes.flat[len(configs) :]:
        ax.set_visible(False)
    for ax, config in zip(axes.flat, configs):
        for label in ("torch", "loader"):
            mine = [r for r in rows if r["config"] == config and r["loader"] == label]
            if mine:
                ax.plot(
                    [r["epoch"] for r in mine],
                    [r["utilization"] for r in mine],
                    marker="o",
                    label="torch DataLoader" if label == "torch" else "loader.DataLoader",
                )
        ax.set(title=config, xlabel="epoch", ylabel="accelerator utilization", ylim=(0, 1.05))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    _title(fig, result)
    fig.tight_layout()
    return fig


def sizes(result: dict) -> Figure | None:
    """One stream's decode tokens/s against the bytes a step reads (ours: the engine's weights; llama.cpp:
    the file), each engine and level a series, with the bandwidth roofline (bandwidth / bytes)."""
    raw = result.get("raw") or []
    bandwidth = result.get("bandwidth")
    if not raw or not bandwidth:
        return None
    import statistics

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[tuple[float, float, str]]] = {}
    for entry in raw:
        label = f"{entry['size']} {entry['type']}"
        for level, runs in entry["ours"].items():
            mb = statistics.median(r["weight_bytes"] for r in runs) / 1e6
            series.setdefault(f"Prescient ({level})", []).append(
                (mb, statistics.median(r["x1"] for r in runs), label)
            )
        for key, name in (
            ("llama_cpp", "llama.cpp (built for this CPU)"),
            ("llama_cpp_avx2", "llama.cpp (AVX2)"),
        ):
            if entry.get(key):
                series.setdefault(name, []).append(
                    (entry["file_bytes"] / 1e6, statistics.median(r["x1"] for r in entry[key]), label)
                )
    for name, points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", linestyle="", label=name)
    for mb, rate, label in series[next(iter(series))]:
        ax.annotate(label, (mb, rate), textcoords="offset points", xytext=(4, 4), fontsize=7)
    every = [p[0] for points in series.values() for p in points]
    xs = [min(every) * 0.9 + (max(every) * 1.1 - min(every) * 0.9) * i / 50 for i in range(51)]
    ax.plot(xs, [bandwidth / (x * 1e6) for x in xs], color="gray", linestyle="--", label="bandwidth roofline")
    ax.set(
        xlabel="MB of weights a decode step reads",
        ylabel="decode tokens/s, 1 stream",
        title="Decode against model bytes",
        xscale="log",
        yscale="log",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _title(fig, result)
    fig.tight_layout()
    return fig


def fair_locality(result: dict) -> Figure | None:
    """One bar per policy (one server) or router (replicas): throughput, prefix hit rate, the largest
    weighted-service gap with DLPM's bound, and the well-behaved tenant's TTFT p50."""
    rows = [r for r in result.get("rows", []) if "max weighted gap" in r]
    if not rows:
        return None
    names = [r.get("policy") or r.get("router") for r in rows]
    throughput = "total tok/s" if "total tok/s" in rows[0] else "output tok/s"
    ttft, scale = ("W TTFT p50 ms", 1e-3) if "W TTFT p50 ms" in rows[0] else ("W TTFT p50 s", 1.0)
    panels = (
        (throughput, throughput.replace("tok/s", "tokens/s"), 1.0, "Throughput"),
        ("prefix hit rate", "prefix-cache hit rate", 1.0, "Prefix hit rate"),
        ("max weighted gap", "weighted tokens", 1.0, "Largest service gap (backlogged)"),
        (ttft, "seconds", scale, "Well-behaved tenant's TTFT p50"),
    )
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, (key, unit, k, title) in zip(axes, panels):
        ax.bar(names, [(r.get(key) or 0.0) * k for r in rows], color="tab:blue")
        ax.set(title=title, ylabel=unit)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    bound = result.get("bound_replicas") or result.get("bound")
    if bound:
        axes[2].axhline(bound, linestyle="--", color="tab:red", label="DLPM's bound")
        axes[2].legend()
    _title(fig, result)
    fig.tight_layout()
    return fig


PLOTS = {
    "serve": serve,
    "fairness": fairness,
    "loader": loader,
    "sizes": sizes,
    "fair_locality": fair_locality,
}


def write(name: str, result: dict, out_dir: Path) -> Path | None:
    """Draw `name`'s figure (if it has one and the result holds its data) to out_dir/name.png."""
    draw = PLOTS.get(name)
    fig = draw(result) if draw else None
    if fig is None:
        return None
    path = Path(out_dir) / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(out_dir: str = "bench-results") -> int:
    for name in PLOTS:
        source = Path(out_dir) / f"{name}.json"
        if source.exists():
            path = write(name, json.loads(source.read_text()), Path(out_dir))
            print(f"{source} -> {path}" if path else f"{source}: nothing to plot")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
