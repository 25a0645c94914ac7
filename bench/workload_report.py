"""Summaries, tables, the RESULTS block and the plot of the workload benchmark."""
from __future__ import annotations

import pathlib

import numpy as np

COLUMNS = ("system", "run", "offered/s", "load", "done", "canc", "rej", "fail", "goodput/s", "service/s",
           "ttuo_p50", "ttuo_p99", "ttuo_mean", "short_p50", "short_queue", "long_p99", "encode_ms", "hit%",
           "useful", "padded", "useful%", "cpu_s", "img/cpu_s")

#: The admission policies compared, each by the system that runs it (same engine flags but
#: `--policy`); `NAME@latent` is the same system with latent outputs.
POLICY_SYSTEMS = {"fifo": "continuous+compact", "srpt": "continuous+srpt"}
#: The defaults with the decode stage named: in one worker process, on the busy loop's thread.
WORKER_SYSTEM, INLINE_SYSTEM = "continuous+worker", "continuous+inline"
LATENT = "@latent"
#: Targets (issue 23): PNG goodput / latent goodput on the above run (≥), shortest-class p50
#: TTUO on the above run / the idle short latency (≤), longest-class p99 TTUO srpt / fifo on
#: the above run (≤).
TARGETS = dict(png_over_latent_goodput=0.9, short_p50_over_idle=3.0, long_p99_srpt_over_fifo=1.5)


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
    shortest, longest = str(min(step_classes)), str(max(step_classes))

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
    classes = {str(s): per_class(s) for s in step_classes}
    return dict(
        requests=len(schedule), completed=len(done), canceled=kinds.get("canceled", 0),
        rejected=kinds.get("rejected", 0), failed=kinds.get("failed", 0) + kinds.get("dead", 0),
        timeouts=kinds.get("timeout", 0), unusable=kinds.get("completed", 0) - len(done),
        arrival_rate=len(schedule) / duration if duration else None,
        goodput=len(done) / last if last > 0 else 0.0,
        service_rate=ended / busy_s if busy_s else (ended / last if last else 0.0),
        ttuo_all=ttuo, ttuo_p50=pct(ttuo, 50), ttuo_p99=pct(ttuo, 99),
        ttuo_mean=float(np.mean(ttuo)) if ttuo else None,
        per_class=classes, shortest=int(shortest), longest=int(longest),
        short_ttuo_p50=classes[shortest]["ttuo_p50"], long_ttuo_p99=classes[longest]["ttuo_p99"],
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
        long = r["per_class"][max(r["per_class"], key=int)]
        rows.append([system, run, fmt(r.get("offered")), fmt(r.get("load")), str(r["completed"]), str(r["canceled"]),
                     str(r["rejected"]), str(r["failed"] + r["timeouts"]), fmt(r["goodput"]), fmt(r["service_rate"]),
                     fmt(r["ttuo_p50"]), fmt(r["ttuo_p99"]), fmt(r["ttuo_mean"]), fmt(short["ttuo_p50"]),
                     fmt(short["queue_p50"]), fmt(long["ttuo_p99"]), fmt(r["encode_ms_p50"], ".1f"),
                     fmt(100 * r["cache_hit_rate"], ".0f"), str(useful), str(padded),
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


def headlines(runs: dict, capacities: dict, idle: dict | None = None, engine: str = "continuous+srpt") -> list[str]:
    """The engine against each baseline (every system but the engine's policy and latent
    variants), per run, naming the baseline and the rate; then the policy and output
    headlines against their targets (`target_lines`)."""
    out = []

    def baseline(system):
        return system != engine and not system.endswith(LATENT) and system not in POLICY_SYSTEMS.values() \
            and system not in (WORKER_SYSTEM, INLINE_SYSTEM)

    for base, mu in capacities.items():
        if not baseline(base) or engine not in capacities or not mu:
            continue
        out.append(f"capacity (burst probe, completed/s): {engine} {capacities[engine]:.2f} vs {base} {mu:.2f} "
                   f"= {capacities[engine] / mu:.2f}x")
    for run in ("below", "above"):
        a = runs.get((engine, run))
        if not a:
            continue
        for (system, r_run), b in runs.items():
            if r_run != run or not baseline(system):
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
    return out + [t["line"] for t in target_lines(runs, idle or {})]


def _ratio(a, b):
    return a / b if a is not None and b else None


def _target(name: str, line: str, value, op: str, target: float, **detail) -> dict:
    """One headline measured against its target: status met / MISSED / not measured."""
    status = "not measured" if value is None else ("met" if (value >= target if op == ">=" else value <= target)
                                                   else "MISSED")
    sign = "≥" if op == ">=" else "≤"
    return dict(name=name, value=value, op=op, target=target, status=status, line=f"{line} = {fmt(value)}x "
                f"(target {sign} {target:g}x: {status})", **detail)


def target_lines(runs: dict, idle: dict) -> list[dict]:
    """The policy and output headlines (issue 23), each a dict with its `line`: per policy
    PNG goodput / latent goodput on the above run (target ≥ 0.9); per policy and output the
    above run's shortest-class p50 TTUO over the idle short latency (≤ 3); per output the
    longest-class p99 TTUO on the above run, srpt / fifo (≤ 1.5); mean TTUO of both policies
    on the below and the above run (no target). Systems not run are left out."""
    out = []
    above = {s: r for (s, run), r in runs.items() if run == "above"}
    rate = next((f"{r['offered']:.2f} req/s offered" for r in above.values() if r.get("offered")), "")
    for policy, png in POLICY_SYSTEMS.items():
        latent = png + LATENT
        a, b = above.get(png), above.get(latent)
        if a is None or b is None:
            continue
        out.append(_target(f"goodput_png_over_latent:{policy}",
                           f"above capacity ({rate}): PNG goodput / latent goodput, {policy}: {png} "
                           f"{fmt(a['goodput'])}/s / {latent} {fmt(b['goodput'])}/s",
                           _ratio(a["goodput"], b["goodput"]), ">=", TARGETS["png_over_latent_goodput"],
                           policy=policy, systems=[png, latent]))
    for suffix in ("", LATENT):
        for policy, base in POLICY_SYSTEMS.items():
            system = base + suffix
            r, quiet = above.get(system), idle.get(system)
            if r is None or quiet is None:
                continue
            short, p50, base_s = r["shortest"], r["short_ttuo_p50"], quiet.get("median_s")
            out.append(_target(f"short_p50_over_idle:{system}",
                               f"above capacity ({rate}): {short}-step p50 TTUO / idle short latency, {policy} "
                               f"({system}): {fmt(p50)} s / {fmt(base_s)} s", _ratio(p50, base_s), "<=",
                               TARGETS["short_p50_over_idle"], policy=policy, systems=[system]))
    for suffix in ("", LATENT):
        fifo, srpt = POLICY_SYSTEMS["fifo"] + suffix, POLICY_SYSTEMS["srpt"] + suffix
        a, b = above.get(srpt), above.get(fifo)
        if a is None or b is None:
            continue
        out.append(_target(f"long_p99_srpt_over_fifo{suffix}",
                           f"above capacity ({rate}): {a['longest']}-step p99 TTUO srpt / fifo ({srpt} vs {fifo}): "
                           f"{fmt(a['long_ttuo_p99'])} s / {fmt(b['long_ttuo_p99'])} s",
                           _ratio(a["long_ttuo_p99"], b["long_ttuo_p99"]), "<=", TARGETS["long_p99_srpt_over_fifo"],
                           systems=[srpt, fifo]))
    latent = above.get(POLICY_SYSTEMS["srpt"] + LATENT)
    for run in ("below", "above"):
        inline, worker = runs.get((INLINE_SYSTEM, run)), runs.get((WORKER_SYSTEM, run))
        if inline is None or worker is None:
            continue
        ratio = _ratio(worker["goodput"], inline["goodput"])
        line = (f"{run} capacity ({inline['offered']:.2f} req/s offered): decode in one worker process "
                f"({WORKER_SYSTEM}) vs on the busy loop's thread ({INLINE_SYSTEM}): goodput "
                f"{fmt(worker['goodput'])}/s vs {fmt(inline['goodput'])}/s = {fmt(ratio)}x, p50 TTUO "
                f"{fmt(worker['ttuo_p50'])} s vs {fmt(inline['ttuo_p50'])} s")
        if run == "above" and latent is not None:
            line += f"; worker PNG goodput / latent goodput {fmt(_ratio(worker['goodput'], latent['goodput']))}x"
        out.append(dict(name=f"worker_over_inline:{run}", value=ratio, systems=[WORKER_SYSTEM, INLINE_SYSTEM],
                        status="", line=line))
    for run in ("below", "above"):
        for suffix in ("", LATENT):
            fifo, srpt = POLICY_SYSTEMS["fifo"] + suffix, POLICY_SYSTEMS["srpt"] + suffix
            a, b = runs.get((fifo, run)), runs.get((srpt, run))
            if a is None or b is None:
                continue
            ratio = _ratio(b["ttuo_mean"], a["ttuo_mean"])
            out.append(dict(name=f"mean_ttuo:{run}{suffix}", value=ratio, systems=[srpt, fifo], status="",
                            line=f"{run} capacity ({a['offered']:.2f} req/s offered): mean TTUO fifo ({fifo}) "
                                 f"{fmt(a['ttuo_mean'])} s, srpt ({srpt}) {fmt(b['ttuo_mean'])} s: srpt / fifo "
                                 f"{fmt(ratio)}x"))
    return out


def results_block(runs: dict, capacities: dict, meta: dict, idle: dict | None = None) -> str:
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
             f"of arrivals each; steps {meta['step_classes']}.", ""]
    if idle:
        first = next(iter(idle.values()))
        lines[-1:-1] = [f"Idle short latency (median time to usable output of {first['n']} single "
                        f"{first['steps']}-step requests, one at a time, before the probe): "
                        + ", ".join(f"{k} {fmt(v['median_s'], '.3f')} s" for k, v in idle.items()) + "."]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in table_rows(runs):
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"- {h}" for h in headlines(runs, capacities, idle)]
    return "\n".join(lines)


def write_plot(path: pathlib.Path, runs: dict, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(system for system, _ in runs))
    palette = ("tab:red", "tab:orange", "tab:green", "tab:purple", "tab:blue", "tab:brown", "tab:pink", "tab:gray",
               "tab:olive", "tab:cyan")
    bases = list(dict.fromkeys(system.removesuffix(LATENT) for system in systems))  # @latent: its base's colour
    colors = {system: palette[bases.index(system.removesuffix(LATENT)) % len(palette)] for system in systems}
    styles = {system: "--" if system.endswith(LATENT) else "-" for system in systems}
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
                ax.step(x, np.arange(len(values) + 1) / len(values), where="post", color=colors[system],
                        linestyle=styles[system], label=system)
            b = np.array(r["backlog_all"])
            bx.plot(b[:, 0], b[:, 1], color=colors[system], linestyle=styles[system], label=system, linewidth=1)
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
