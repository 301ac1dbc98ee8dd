"""PNG plots of a bench run (matplotlib, Agg backend; nothing is shown on screen).

* occupancy: one panel per Carpool policy, one lane per seat, steps on the x axis; each request's
  stay in a seat is a bar in its own colour (the article's timeline, drawn from the recorded run).
  Hatched, faded bars are static-batch padding: the request has finished but its row is still
  computed until the slowest member of its batch ends.
* latency: each request's latency (seconds from arrival to its last token) side by side for
  every policy and baseline of the run.
* sweep: continuous ÷ static, measured (tok/s) and in steps, for each length cap of the variance sweep.
"""

from __future__ import annotations

from pathlib import Path

from cluster.bench.engine.runner import RunResult, run_result_from_dict

POLICY_COLOURS = {
    "continuous": "#1f77b4",
    "static": "#ff7f0e",
    "transformers-static": "#7f7f7f",
    "transformers-continuous": "#2ca02c",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_path(prefix: str | Path, kind: str) -> Path:
    """Where ``--plot PATH`` writes the ``kind`` plot: ``PATH-<kind>.png`` (a trailing ``.png``
    of PATH is dropped), or ``PATH/<kind>.png`` when PATH is an existing directory."""
    prefix = Path(prefix)
    if prefix.is_dir():
        return prefix / f"{kind}.png"
    if prefix.suffix.lower() == ".png":
        prefix = prefix.with_suffix("")
    return prefix.parent / f"{prefix.name}-{kind}.png"


def _request_colours(ids: list[str]) -> dict[str, tuple]:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if len(ids) <= 10 else "tab20")
    return {rid: cmap(i % cmap.N) for i, rid in enumerate(ids)}


def plot_occupancy(results: list[RunResult], path: str | Path, title: str = "") -> Path:
    """Seat lanes over steps, one panel per run that recorded occupancy (Carpool's policies)."""
    plt = _plt()
    runs = [r for r in results if r.occupancy]
    if not runs:
        raise ValueError("no run recorded seat occupancy")
    ids = [q.id for q in runs[0].requests]
    colours = _request_colours(ids)
    seats = max(r.num_seats or 1 for r in runs)
    last = max(r.num_steps or 1 for r in runs)
    label = len(ids) <= 12
    lane = max(0.11, min(0.3, 3.6 / seats))  # inches per seat: a 32-seat panel stays about 4 in tall
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(12, 0.8 + len(runs) * (0.5 + lane * seats)), sharex=True, squeeze=False, layout="constrained"
    )
    for ax, run in zip(axes[:, 0], runs):
        for seg in run.occupancy:
            width = seg.end_step - seg.start_step + 1
            ax.broken_barh(
                [(seg.start_step - 0.5, width)],
                (seg.seat - 0.4, 0.8),
                facecolors=colours.get(seg.id, "grey"),
                alpha=0.3 if seg.padding else 1.0,
                hatch="///" if seg.padding and seats <= 8 else None,
                edgecolor="white" if not seg.padding else "none",
                linewidth=0.3,
            )
            if label and not seg.padding and width >= last / 40:
                ax.text(seg.start_step - 0.5 + width / 2, seg.seat, seg.id, ha="center", va="center", fontsize=9, color="white", weight="bold")
        ax.set_ylim(-0.6, seats - 0.4)
        ax.set_yticks(range(seats) if seats <= 8 else range(0, seats, max(1, seats // 8)))
        ax.set_ylabel("seat")
        ax.invert_yaxis()
        ax.set_title(
            f"{run.policy}: {run.num_steps} steps, {run.output_tokens_per_s:.0f} tok/s, {run.wall_s:.1f} s",
            loc="left",
            fontsize=10,
        )
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].set_xlim(0.5, last + 0.5)
    fig.suptitle(title or "Seat occupancy per step (faded, hatched: finished, kept as padding)", fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_latency(results: list[RunResult], path: str | Path, title: str = "") -> Path:
    """Per-request latency side by side for every run: grouped bars, or markers beyond 30 requests."""
    plt = _plt()
    ids = [q.id for q in results[0].requests]
    n = len(results)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(12 if len(ids) > 12 else 9, 4.6), layout="constrained")
    markers = "os^Dv<>p"
    for k, run in enumerate(results):
        by_id = {q.id: q.latency_s for q in run.requests}
        colour = POLICY_COLOURS.get(run.policy)
        label = f"{run.policy} (mean {run.latency_s['mean']:.1f} s)"
        values = [by_id.get(rid, 0.0) for rid in ids]
        if len(ids) <= 30:  # bars side by side per request
            xs = [i - 0.4 + width * (k + 0.5) for i in range(len(ids))]
            ax.bar(xs, values, width=width, color=colour, label=label)
        else:  # too many for bars: one marker per request and run
            ax.scatter(range(len(ids)), values, s=14, marker=markers[k % len(markers)], color=colour, label=label, alpha=0.85)
        ax.axhline(run.latency_s["mean"], color=colour, linestyle="--", linewidth=0.8)
    if len(ids) <= 30:
        ax.set_xticks(range(len(ids)), ids)
    ax.set_xlabel("request")
    ax.set_ylabel("latency (s, arrival to last token)")
    ax.set_xlim(-0.6, len(ids) - 0.4)
    ax.legend(fontsize=9, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(n, 4), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title or "Per-request latency", fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_sweep(points: list[dict], path: str | Path, title: str = "") -> Path:
    """Continuous ÷ static per length cap: measured tok/s ratio and step ratio, with the lengths' CV."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    xs = range(len(points))
    series = [
        ("speedup", "tok/s ratio (measured)", POLICY_COLOURS["continuous"], -0.2),
        ("step_speedup", "step ratio (static steps ÷ continuous steps)", "#aec7e8", 0.2),
    ]
    for key, label, colour, offset in series:
        values = [p[key] for p in points]
        bars = ax.bar([x + offset for x in xs], values, width=0.4, color=colour, label=label)
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{value:.2f}×", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), [f"cap {p['cap']}\nCV {p['length_cv']:.2f}" for p in points])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylim(0, 1.3 * max(max(p["speedup"], p["step_speedup"]) for p in points))  # room for the legend
    ax.set_ylabel("continuous ÷ static")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title or "Gain of continuous batching as output lengths vary more", fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_run_plots(results: list[RunResult], prefix: str | Path, what: str) -> list[Path]:
    """The occupancy and latency PNGs of one run of a workload (``what`` goes into the titles)."""
    return [
        plot_occupancy(results, plot_path(prefix, "occupancy"), f"Seat occupancy per step ({what}; faded: finished, kept as padding)"),
        plot_latency(results, plot_path(prefix, "latency"), f"Per-request latency ({what})"),
    ]


def replot(json_path: str | Path, prefix: str | Path) -> list[Path]:
    """Draw the plots again from a ``--json`` file (e.g. after changing a plot), without rerunning."""
    import json

    summary = json.loads(Path(json_path).read_text())
    what = f"{Path(summary['workload']).name}, {summary['num_requests']} requests, {summary['max_num_seqs']} seats"
    if "points" in summary:
        return [plot_sweep(summary["points"], plot_path(prefix, "sweep"), f"Continuous ÷ static, {what}")]
    return write_run_plots([run_result_from_dict(r) for r in summary["results"]], prefix, what)
