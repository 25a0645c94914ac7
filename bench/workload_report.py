"""Summaries, tables, the RESULTS block and the plot of the workload benchmark."""
from __future__ import annotations

import pathlib

import numpy as np

COLUMNS = ("system", "run", "offered/s", "load", "done", "canc", "rej", "fail", "goodput/s", "service/s",
           "ttuo_p50", "ttuo_p99", "short_p50", "short_queue", "encode_ms", "hit%", "useful", "padded",
           "useful%", "cpu_s", "img/cpu_s")


def pct(values, q):
    return float(np.percentile(values, q)) if len(values) else None


def fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def summarize(records: list[dict], samples: list[dict], before: dict, after: dict, schedule: list[dict],
              duration: float | None, step_classes: tuple[int, ...], cpu_s: float = 0.0) -> dict:
    """One run: counts, rates, latencies, evaluation and cache counters (Stats deltas)."""
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    done = [r for r in records if r["kind"] == "completed" and r.get("usable")]
    last = max((r.get("received", 0.0) for r in records), default=0.0)
    ttuo = sorted(r["timings"]["total_s"] for r in done)

    def per_class(steps):
        mine = [r["timings"] for r in done if r["steps"] == steps]
        return dict(n=len(mine), ttuo_p50=pct([t["total_s"] for t in mine], 50),
                    ttuo_p99=pct([t["total_s"] for t in mine], 99), queue_p50=pct([t["queue_s"] for t in mine], 50),
                    service_p50=pct([t["total_s"] - t["queue_s"] for t in mine], 50))

    def delta(key):
        return int(after.get(key, 0)) - int(before.get(key, 0))

    hits, misses = delta("embedding_cache_hits"), delta("embedding_cache_misses")
    busy = [s for s in samples if s["busy"] or s["queue"]]
    busy_s = len(busy) * 0.2
    ended = kinds.get("completed", 0) + kinds.get("canceled", 0)
    window = [s for s in samples if duration is None or s["t"] <= duration]
    encode = [1e3 * r["timings"].get("encode_s", 0.0) for r in done]
    return dict(
        requests=len(schedule), completed=len(done), canceled=kinds.get("canceled", 0),
        rejected=kinds.get("rejected", 0), failed=kinds.get("failed", 0) + kinds.get("dead", 0),
        timeouts=kinds.get("timeout", 0), unusable=kinds.get("completed", 0) - len(done),
        arrival_rate=len(schedule) / duration if duration else None,
        goodput=len(done) / last if last > 0 else 0.0,
        service_rate=ended / busy_s if busy_s else (ended / last if last else 0.0),
        ttuo_all=ttuo, ttuo_p50=pct(ttuo, 50), ttuo_p99=pct(ttuo, 99),
        per_class={str(s): per_class(s) for s in step_classes},
        encode_ms_p50=pct(encode, 50), encode_ms_mean=float(np.mean(encode)) if encode else None,
        encode_ms_max=max(encode, default=None),
        cache_hits=hits, cache_misses=misses, cache_hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        useful_evals=delta("useful_evals"), padded_evals=delta("padded_evals"),
        canceled_evals=delta("canceled_evals"),
        occupancy=[(round(s["t"], 2), s["busy"] / max(1, s["slots"])) for s in samples],
        backlog=[(round(s["t"], 2), s["queue"]) for s in window] or [(0.0, 0)],
        backlog_all=[(round(s["t"], 2), s["queue"]) for s in samples] or [(0.0, 0)],
        max_backlog=max((s["queue"] for s in samples), default=0),
        wall_s=last,
        cpu_s=cpu_s,  # CPU time the engine process (and its decode workers) got during the run
        images_per_cpu_s=len(done) / cpu_s if cpu_s else None,
    )


def table_rows(runs: dict) -> list[list[str]]:
    rows = []
    for (system, run), r in runs.items():
        useful, padded = r["useful_evals"], r["padded_evals"]
        short = r["per_class"][min(r["per_class"], key=int)]
        rows.append([system, run, fmt(r.get("offered")), fmt(r.get("load")), str(r["completed"]), str(r["canceled"]),
                     str(r["rejected"]), str(r["failed"] + r["timeouts"]), fmt(r["goodput"]), fmt(r["service_rate"]),
                     fmt(r["ttuo_p50"]), fmt(r["ttuo_p99"]), fmt(short["ttuo_p50"]), fmt(short["queue_p50"]),
                     fmt(r["encode_ms_p50"], ".1f"), fmt(100 * r["cache_hit_rate"], ".0f"), str(useful), str(padded),
                     fmt(100 * useful / (useful + padded) if useful + padded else 100.0, ".1f"),
                     fmt(r["cpu_s"], ".1f"), fmt(r["images_per_cpu_s"])])
    return rows


def print_table(runs: dict) -> None:
    rows = table_rows(runs)
    widths = [max(len(c), *(len(r[k]) for r in rows)) if rows else len(c) for k, c in enumerate(COLUMNS)]
    line = "  ".join(c.rjust(w) if k > 1 else c.ljust(w) for k, (c, w) in enumerate(zip(COLUMNS, widths)))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.rjust(w) if k > 1 else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))))


def headlines(runs: dict, capacities: dict, engine: str = "continuous+compact") -> list[str]:
    """The engine against each baseline, per run, naming the baseline and the rate."""
    out = []
    for base, mu in capacities.items():
        if base == engine or engine not in capacities or not mu:
            continue
        out.append(f"capacity (burst probe, completed/s): {engine} {capacities[engine]:.2f} vs {base} {mu:.2f} "
                   f"= {capacities[engine] / mu:.2f}x")
    for run in ("below", "above"):
        a = runs.get((engine, run))
        if not a:
            continue
        for (system, r_run), b in runs.items():
            if r_run != run or system == engine:
                continue
            short = min(a["per_class"], key=int)
            pa, pb = a["per_class"][short]["ttuo_p50"], b["per_class"][short]["ttuo_p50"]
            good = a["goodput"] / b["goodput"] if b["goodput"] else None
            per_cpu = (a["images_per_cpu_s"] / b["images_per_cpu_s"]
                       if a["images_per_cpu_s"] and b["images_per_cpu_s"] else None)
            all_p50 = b["ttuo_p50"] / a["ttuo_p50"] if a["ttuo_p50"] and b["ttuo_p50"] else None
            out.append(f"{run} capacity ({a['offered']:.2f} req/s offered): {engine} vs {system}: goodput "
                       f"{fmt(good)}x, images per engine CPU second {fmt(per_cpu)}x, p50 TTUO of {short}-step "
                       f"requests {fmt(pb / pa if pa and pb else None)}x lower, of all {fmt(all_p50)}x lower")
    return out


def results_block(runs: dict, capacities: dict, meta: dict) -> str:
    """Markdown for bench/RESULTS.md."""
    lines = [f"`{meta['command']}` ({meta['date']}, {meta['wall_s']:.0f} s wall). Machine: {meta['machine']}; "
             f"model {meta['model']}; {meta['slots']} slots; engine threads {meta['threads'] or 'torch default'}; "
             f"decode workers {meta['decode_workers']}; every system is the same `python -m engine serve` process "
             f"(same IO path, decode stage, threads{', CPUs ' + meta['cpus'] if meta['cpus'] else ''}), only the core "
             "or its flags differ.", "",
             f"Capacity probe: a burst of {meta['probe']} requests of the mix; completed/s: "
             + ", ".join(f"{k} {v:.2f}" for k, v in capacities.items()) + ".",
             f"Below capacity: {meta['rates']['below']:.2f} req/s ({meta['below']:g} x the lowest capacity); "
             f"above: {meta['rates']['above']:.2f} req/s ({meta['above']:g} x the highest), {meta['duration']:g} s "
             f"of arrivals each; steps {meta['step_classes']}.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in table_rows(runs):
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"- {h}" for h in headlines(runs, capacities)]
    return "\n".join(lines)


def write_plot(path: pathlib.Path, runs: dict, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(system for system, _ in runs))
    colors = dict(zip(systems, ("tab:red", "tab:orange", "tab:green", "tab:purple", "tab:blue", "tab:brown")))
    fig, axes = plt.subplots(2, 2, figsize=(14, 8))
    for col, run in enumerate(("below", "above")):
        ax, bx = axes[0, col], axes[1, col]
        for system in systems:
            r = runs.get((system, run))
            if not r:
                continue
            values = r["ttuo_all"]
            if values:
                x = np.concatenate([[values[0]], values])
                ax.step(x, np.arange(len(values) + 1) / len(values), where="post", color=colors[system], label=system)
            b = np.array(r["backlog_all"])
            bx.plot(b[:, 0], b[:, 1], color=colors[system], label=system, linewidth=1)
        rate = meta["rates"].get(run, 0.0)
        ax.set_xscale("log")
        ax.set_title(f"{run} capacity: {rate:.2f} req/s offered — time to usable output CDF", fontsize=10)
        ax.set_xlabel("seconds (log)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
        bx.axvline(meta["duration"], color="grey", linestyle="--", linewidth=0.8)
        bx.set_title(f"{run} capacity: queued requests (dashed: arrivals stop)", fontsize=10)
        bx.set_xlabel("seconds since the arrival window opened")
        bx.grid(alpha=0.3)
    fig.suptitle(f"mixed workload, model {meta['model']}, {meta['slots']} slots, {meta['machine']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
