"""Charts (PNG, matplotlib) from the JSON files the benchmark scripts write.

Reads from ``--results-dir`` (default: ``results``) whichever of these exist and writes one chart each into
``--out-dir`` (default: the results folder):

- ``bench_memory*.json``  -> ``bench_memory.png``: KV bytes reserved vs used per cache (one ragged batch);
- ``bench_memory*.json``  -> ``bench_concurrency.png``: requests admitted under the KV budget per cache;
- ``bench_decode*.json``, ``bench_beam*.json`` -> ``bench_throughput.png``: PagedCache / DynamicCache speed
  ratios per scenario (wall clock, and per CPU second);
- ``bench_beam*.json``    -> ``bench_beam.png``: beam-search KV bytes and speed, Paged vs Dynamic;
- ``bench_cb*.json``      -> ``bench_cb.png``: useful tokens/s and KV memory, generate vs continuous batching;
- ``bench_serving*.json`` -> ``bench_serving.png``: output tokens/s and time to first token per contender;
- ``bench_http*.json``    -> ``bench_http.png``: the same over HTTP, plus inter-token latency, per contender.

Command::

    python scripts/bench/plot_bench.py --results-dir results --out-dir results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

MIB = 2**20
COLORS = MappingProxyType({"dynamic": "#8c8c8c", "paged": "#1f77b4", "paged_sdpa": "#2ca02c", "cb": "#ff7f0e",
                           "ours": "#1f77b4", "transformers": "#ff7f0e", "batcher": "#2ca02c"})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", default="results", help="folder of the JSON files (default: results)")
    parser.add_argument("--out-dir", default=None, help="where to write PNGs (default: --results-dir)")
    return parser.parse_args(argv)


def load_all(folder: Path, pattern: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) | {"_file": p.name} for p in sorted(folder.glob(pattern))]


def machine_line(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    threads = m.get("torch_threads", "?")
    return f"{data.get('dtype', '')} on {m.get('device_name', '?')}, {threads} thread(s), {m.get('date', '')[:10]}"


def save(fig: plt.Figure, path: Path) -> Path:
    """Write `fig` to `path` (PNG, laid out tightly) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory(data: dict[str, Any], out: Path) -> Path:
    caches = data["caches"]
    labels = [c["label"].replace(" (", "\n(") for c in caches]
    x = range(len(caches))
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.bar([i - 0.2 for i in x], [c["reserved_bytes"] / MIB for c in caches], 0.4, label="reserved", color="#d62728")
    used = [c["used_bytes"] / MIB for c in caches]
    ax.bar([i + 0.2 for i in x], used, 0.4, label="holding real tokens", color="#2ca02c")
    for i, c in enumerate(caches):
        ax.annotate(f"{c['utilization']:.1%}", (i, c["reserved_bytes"] / MIB), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KV cache MiB (log scale)")
    w = data["workload"]
    ax.set_title(
        f"KV memory, {w['num_requests']} ragged requests (prompts {w['prompt_stats']['min']}-"
        f"{w['prompt_stats']['max']}), {data['new_tokens']} new tokens; labels = utilization\n{machine_line(data)}",
        fontsize=9,
    )
    ax.legend()
    return save(fig, out / "bench_memory.png")


def plot_concurrency(data: dict[str, Any], out: Path) -> Path:
    rows = data["budget"]["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    colors = ["#d62728", "#9467bd", COLORS["dynamic"], COLORS["paged"]]
    bars = ax.barh([r["label"] for r in rows], [r["admitted"] for r in rows], color=colors[: len(rows)])
    for bar, r in zip(bars, rows, strict=True):
        ax.annotate(str(r["admitted"]), (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("requests admitted as one batch")
    b = data["budget"]
    proof = b.get("proof") or {}
    proven = "; Paged count proven by running it" if proof.get("ok") else ""
    ax.set_title(f"{b['budget']} KV budget, {b['new_tokens']} new tokens per request{proven}\n"
                 f"{machine_line(data)}", fontsize=9)
    return save(fig, out / "bench_concurrency.png")


def plot_throughput(decodes: list[dict[str, Any]], beams: list[dict[str, Any]], out: Path) -> Path:
    """PagedCache / DynamicCache speed per scenario: wall-clock ratio, and CPU-time ratio beside it."""
    names, wall, cpu, colors = [], [], [], []
    order = {"greedy": 0, "beam": 1, "sample": 2}
    scenarios = sorted(
        (scenario for data in decodes for scenario in data["scenarios"]),
        key=lambda sc: (order.get(sc["mode"], 3), sc["batch_size"]),
    )
    for scenario in scenarios:
        for variant, s in scenario["summary"].items():
            if "ratio_decode_tokens_per_s" in s:
                names.append(f"{scenario['scenario']}\n{variant}\n(decode)")
                wall.append(s["ratio_decode_tokens_per_s"])
                cpu.append(s.get("ratio_decode_tokens_per_cpu_s", float("nan")))
                colors.append(COLORS.get(variant, "#1f77b4"))
    for data in beams:
        a = data["args"]
        names.append(f"beam{a['num_beams']} {a['prompt_len']}+{a['new_tokens']}\npaged\n(end to end)")
        wall.append(data["speed_ratio"])
        cpu.append(data.get("cpu_time_speed_ratio", float("nan")))
        colors.append(COLORS["paged"])
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(names) + 2), 4.8))
    ax.bar([i - 0.2 for i in x], wall, 0.4, color=colors, label="wall-clock tokens/s")
    ax.bar([i + 0.2 for i in x], cpu, 0.4, color=colors, alpha=0.45, hatch="//", label="tokens per CPU second")
    for i, (w, c) in enumerate(zip(wall, cpu, strict=True)):
        ax.annotate(f"{w:.2f}", (i - 0.2, w), ha="center", va="bottom", fontsize=7)
        ax.annotate(f"{c:.2f}", (i + 0.2, c), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.95, color="#d62728", linestyle="--", linewidth=0.8, label="greedy target 0.95")
    ax.set_xticks(list(x), names, fontsize=7)
    ax.set_ylabel("PagedCache / DynamicCache")
    source = decodes[0] if decodes else beams[0]
    ax.set_title("Speed relative to DynamicCache, median of alternated repeats\n" + machine_line(source), fontsize=9)
    ax.legend(fontsize=7)
    return save(fig, out / "bench_throughput.png")


def plot_beam(data: dict[str, Any], out: Path) -> Path:
    s = data["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    variants = list(s)
    x = range(len(variants))
    left.bar([i - 0.2 for i in x], [s[v]["kv_bytes_end"] / MIB for v in variants], 0.4, label="at end", color="#1f77b4")
    left.bar([i + 0.2 for i in x], [s[v]["kv_high_water_bytes"] / MIB for v in variants], 0.4, label="high-water",
             color="#aec7e8")
    left.set_xticks(list(x), variants)
    left.set_ylabel("KV MiB")
    left.set_title(f"KV bytes (paged/dynamic at end: {data['kv_bytes_ratio']:.2f})", fontsize=9)
    left.legend(fontsize=8)
    right.bar(list(x), [s[v]["tokens_per_s"] for v in variants], color=[COLORS.get(v, "#1f77b4") for v in variants])
    right.set_xticks(list(x), variants)
    right.set_ylabel("tokens/s (returned sequences)")
    right.set_title(f"speed (paged/dynamic: {data['speed_ratio']:.2f})", fontsize=9)
    a = data["args"]
    fig.suptitle(f"Beam search, {a['num_beams']} beams, {a['batch_size']}x{a['prompt_len']} prompt, "
                 f"{a['new_tokens']} new tokens   {machine_line(data)}", fontsize=9)
    return save(fig, out / "bench_beam.png")


def plot_cb(runs: list[dict[str, Any]], out: Path) -> Path:
    fig, axes = plt.subplots(len(runs), 2, figsize=(9, 3.4 * len(runs)), squeeze=False)
    for (speed, memory), data in zip(axes, runs, strict=True):
        s = data["summary"]
        engines = list(s)
        colors = [COLORS.get(e, "#1f77b4") for e in engines]
        speed.bar(engines, [s[e]["tokens_per_s"] for e in engines], color=colors)
        speed.set_ylabel("useful tokens/s")
        for i, e in enumerate(engines):
            value = s[e]["tokens_per_s"]
            speed.annotate(f"{value:.1f}", (i, value), ha="center", va="bottom", fontsize=8)
        a = data["args"]
        speed.set_title(f"{a['num_requests']} requests, outputs: {a['outputs']}", fontsize=9)
        x = range(len(engines))
        memory.bar([i - 0.2 for i in x], [s[e]["kv_allocated_bytes"] / MIB for e in engines], 0.4, label="allocated",
                   color="#d62728")
        memory.bar([i + 0.2 for i in x], [s[e]["kv_high_water_bytes"] / MIB for e in engines], 0.4,
                   label="used (high-water)", color="#2ca02c")
        memory.set_xticks(list(x), engines)
        memory.set_ylabel("KV MiB")
        memory.set_ylim(0, 1.3 * max(s[e]["kv_allocated_bytes"] / MIB for e in engines))  # room for the legend
        memory.legend(fontsize=8, ncols=2, loc="upper left")
    fig.suptitle(f"generate (Dynamic / Paged) vs transformers continuous batching   {machine_line(runs[0])}",
                 fontsize=9)
    return save(fig, out / "bench_cb.png")


def plot_serving(data: dict[str, Any], out: Path) -> Path:
    c = data["contenders"]
    names = list(c)
    labels = [n.replace("_", "\n") for n in names]  # "batcher_unpacked" on two lines, clear of its neighbours
    colors = [COLORS.get(n, "#1f77b4") for n in names]
    fig, (speed, latency) = plt.subplots(1, 2, figsize=(9, 3.8))
    speed.bar(labels, [c[n]["tokens_per_s"] for n in names], color=colors)
    for i, n in enumerate(names):
        low, high = c[n]["tokens_per_s_range"]
        speed.plot([i, i], [low, high], color="black", linewidth=1)
        speed.annotate(f"{c[n]['tokens_per_s']:.1f}", (i, high), ha="center", va="bottom", fontsize=8)
    speed.set_ylabel("output tokens/s (median, range)")
    x = range(len(names))
    latency.bar([i - 0.2 for i in x], [c[n]["ttft_p50_s"] for n in names], 0.4, label="p50", color="#2ca02c")
    latency.bar([i + 0.2 for i in x], [c[n]["ttft_p95_s"] for n in names], 0.4, label="p95", color="#98df8a")
    latency.set_xticks(list(x), labels)
    latency.set_ylabel("time to first token, s")
    latency.legend(fontsize=8)
    for axis in (speed, latency):
        axis.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{data['num_requests']} requests, {data['output_tokens']} output tokens, KV budget "
                 f"{data['budget_bytes'] / MIB:.0f} MiB, {data['threads']} threads   {machine_line(data)}", fontsize=9)
    return save(fig, out / "bench_serving.png")


def plot_http(data: dict[str, Any], out: Path) -> Path:
    c = data["contenders"]
    names = list(c)
    x = range(len(names))
    fig, (speed, first, gaps) = plt.subplots(1, 3, figsize=(max(11, 2.6 * len(names)), 3.8))
    speed.bar(names, [c[n]["tokens_per_s"] for n in names], color=[COLORS.get(n, "#1f77b4") for n in names])
    for i, n in enumerate(names):
        low, high = c[n]["tokens_per_s_range"]
        speed.plot([i, i], [low, high], color="black", linewidth=1)
        speed.annotate(f"{c[n]['tokens_per_s']:.1f}", (i, high), ha="center", va="bottom", fontsize=8)
    speed.set_ylabel("output tokens/s (median, range)")
    for axis, key, scale, unit in ((first, "ttft", 1, "time to first token, s"),
                                   (gaps, "itl", 1e3, "inter-token latency, ms")):
        axis.bar([i - 0.2 for i in x], [c[n][f"{key}_p50_s"] * scale for n in names], 0.4, label="p50",
                 color="#2ca02c")
        axis.bar([i + 0.2 for i in x], [c[n][f"{key}_p95_s"] * scale for n in names], 0.4, label="p95",
                 color="#98df8a")
        axis.set_xticks(list(x), names)
        axis.set_ylabel(unit)
        axis.legend(fontsize=8)
    for axis in (speed, first, gaps):
        axis.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{data['num_requests']} streamed requests, {data['concurrency']} clients, {data['output_tokens']} "
                 f"output tokens, KV budget {data['budget_bytes'] / MIB:.1f} MiB, {data['threads']} threads   "
                 f"{machine_line(data)}", fontsize=9)
    return save(fig, out / "bench_http.png")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    folder = Path(args.results_dir)
    out = Path(args.out_dir) if args.out_dir else folder
    out.mkdir(parents=True, exist_ok=True)
    memory = load_all(folder, "bench_memory*.json")
    decodes = load_all(folder, "bench_decode*.json")
    beams = load_all(folder, "bench_beam*.json")
    cbs = load_all(folder, "bench_cb*.json")
    serving = load_all(folder, "bench_serving*.json")
    http = load_all(folder, "bench_http*.json")
    written: list[Path] = []
    if memory:
        written += [plot_memory(memory[-1], out), plot_concurrency(memory[-1], out)]
    if decodes or beams:
        written.append(plot_throughput(decodes, beams, out))
    if beams:
        written.append(plot_beam(beams[-1], out))
    if cbs:
        written.append(plot_cb(cbs, out))
    if serving:
        written.append(plot_serving(serving[-1], out))
    if http:
        written.append(plot_http(http[-1], out))
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"no bench_*.json files in {folder}")
    return {"written": [str(p) for p in written]}


if __name__ == "__main__":
    main()
