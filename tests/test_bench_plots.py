"""`make bench` draws its results: each plot shows the numbers it was given, and names the machine."""

from __future__ import annotations

import pytest

from tests.bench import plots

SERVE = {
    "title": "Serving",
    "machine": "Test CPU, 2 cores",
    "rows": [
        {"workload": "concurrency 1", "output tok/s": 20.0, "TTFT p50 ms": 270.0, "TTFT p99 ms": 400.0},
        {"workload": "concurrency 32", "output tok/s": 160.0, "TTFT p50 ms": 2100.0, "TTFT p99 ms": 3900.0},
        {"workload": "Poisson 1.00 req/s", "output tok/s": 90.0, "TTFT p50 ms": 500.0, "TTFT p99 ms": 800.0},
        {"workload": "offline engine, 32 at once", "output tok/s": 150.0},
    ],
}
FAIRNESS = {
    "title": "Fairness",
    "machine": "Test CPU, 2 cores",
    "overload_vtc_metrics": [
        {
            "t": t,
            "tenant_service_tokens_total[A]": 1000 + 100.0 * t,
            "tenant_service_tokens_total[B]": 50.0 * t,
            "tenant_service_tokens_total[cap]": 700.0,  # served in an earlier phase only
        }
        for t in range(0, 30, 5)
    ],
    "overload_fcfs_metrics": [
        {"t": t, "tenant_service_tokens_total[A]": 140.0 * t, "tenant_service_tokens_total[B]": 10.0 * t}
        for t in range(0, 30, 5)
    ],
}
LOADER = {
    "title": "Loader",
    "machine": "Test CPU, 2 cores",
    "rows": [
        {"config": "slow storage", "loader": loader, "epoch": epoch, "utilization": u}
        for loader, us in (("torch", (0.46, 0.47)), ("loader", (0.93, 0.96)))
        for epoch, u in enumerate(us, 1)
    ],
}

SIZES = {
    "title": "Sizes",
    "machine": "Test CPU, 2 cores",
    "bandwidth": 20e9,
    "raw": [
        {
            "size": "1b",
            "type": "q4_0",
            "file_bytes": 600e6,
            "ours": {"avx2": [{"weight_bytes": 620e6, "x1": 28.0}, {"weight_bytes": 620e6, "x1": 30.0}]},
            "llama_cpp": [{"x1": 25.0}, {"x1": 26.0}, {"x1": 24.0}],
        },
        {
            "size": "1b",
            "type": "q8_0",
            "file_bytes": 1000e6,
            "ours": {"avx2": [{"weight_bytes": 1050e6, "x1": 17.0}]},
            "llama_cpp": [{"x1": 16.0}],
        },
    ],
}


def lines(fig) -> dict[str, tuple[list, list]]:
    return {
        f"{ax.get_title()}|{line.get_label()}": (list(line.get_xdata()), list(line.get_ydata()))
        for ax in fig.axes
        for line in ax.get_lines()
    }


def test_serve_plot_shows_throughput_and_ttft_against_concurrency():
    drawn = lines(plots.serve(SERVE))
    # the Poisson and offline rows are not points on the concurrency axis
    assert drawn["Throughput|server (HTTP)"] == ([1, 32], [20.0, 160.0])
    assert drawn["Time to first token|p50"] == ([1, 32], [0.27, 2.1])
    assert drawn["Time to first token|p99"] == ([1, 32], [0.4, 3.9])
    assert drawn["Throughput|offline engine, 32 at once"][1] == [150.0, 150.0]


def test_fairness_plot_shows_each_tenants_service_since_the_phase_began_per_policy():
    drawn = lines(plots.fairness(FAIRNESS))
    vtc = "vtc, overload (A at 2x capacity, B at 0.5x)"
    assert drawn[f"{vtc}|tenant A"] == ([0, 5, 10, 15, 20, 25], [0.0, 500.0, 1000.0, 1500.0, 2000.0, 2500.0])
    assert drawn["fcfs, overload (A at 2x capacity, B at 0.5x)|tenant B"][1] == pytest.approx(
        [0, 50, 100, 150, 200, 250]
    )
    assert f"{vtc}|tenant cap" not in drawn  # no service in this phase


def test_loader_plot_sets_the_loader_against_torch_per_epoch():
    drawn = lines(plots.loader(LOADER))
    assert drawn["slow storage|torch DataLoader"] == ([1, 2], [0.46, 0.47])
    assert drawn["slow storage|loader.DataLoader"] == ([1, 2], [0.93, 0.96])


def test_sizes_plot_sets_decode_against_bytes_read_with_the_roofline():
    drawn = lines(plots.sizes(SIZES))
    title = "Decode against model bytes"
    assert drawn[f"{title}|Prescient (avx2)"] == ([620.0, 1050.0], [29.0, 17.0])  # medians of the rounds
    assert drawn[f"{title}|llama.cpp (built for this CPU)"] == ([600.0, 1000.0], [25.0, 16.0])
    xs, ys = drawn[f"{title}|bandwidth roofline"]
    assert ys == pytest.approx([20e9 / (x * 1e6) for x in xs]) and min(xs) < 600 and max(xs) > 1050


LOCALITY = {
    "title": "Locality",
    "machine": "Test CPU, 2 cores",
    "bound": 1000.0,
    "rows": [
        {
            "policy": "dlpm",
            "total tok/s": 90.0,
            "prefix hit rate": 0.8,
            "max weighted gap": 700.0,
            "W TTFT p50 ms": 400.0,
        },
        {
            "policy": "vtc",
            "total tok/s": 50.0,
            "prefix hit rate": 0.3,
            "max weighted gap": 500.0,
            "W TTFT p50 ms": 500.0,
        },
    ],
}


def test_fair_locality_plot_has_a_bar_per_policy_and_the_bound():
    fig = plots.fair_locality(LOCALITY)
    bars = {ax.get_title(): [p.get_height() for p in ax.patches] for ax in fig.axes}
    assert bars["Throughput"] == [90.0, 50.0] and bars["Prefix hit rate"] == [0.8, 0.3]
    assert bars["Well-behaved tenant's TTFT p50"] == [0.4, 0.5]  # seconds
    assert lines(fig)["Largest service gap (backlogged)|DLPM's bound"][1] == [1000.0, 1000.0]


def test_write_saves_a_png_titled_with_the_machine(tmp_path):
    for name, result in (("serve", SERVE), ("fairness", FAIRNESS), ("loader", LOADER), ("sizes", SIZES)):
        path = plots.write(name, result, tmp_path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
        assert "Test CPU, 2 cores" in getattr(plots, name)(result)._suptitle.get_text()
    assert plots.write("engine", {"rows": []}, tmp_path) is None  # no plot for it: JSON only
    assert plots.write("serve", {"rows": []}, tmp_path) is None
