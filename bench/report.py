"""Turn a bench run's results into ``report.md`` and PNG plots (matplotlib, Agg).

``python -m bench.report bench/results/<date>`` re-renders from ``results.json``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from .stats import added, first_over

QS = (50.0, 90.0, 99.0)


def _f(v: float | None, nd: int = 2) -> str:
    return "—" if v is None else f"{v:.{nd}f}"


def _plots(res: dict[str, Any], outdir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[str] = []
    a = res.get("a", {}).get("closed", {})
    if a:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, rows in a.items():
            cs = sorted(int(c) for c in rows)
            for ax, q in zip(axes, ("p50", "p99"), strict=True):
                ys = [rows[str(c)]["total_ms"][q] for c in cs]
                ax.plot(cs, ys, marker="o", label=name)
                ax.set_title(f"(a) total time {q} vs concurrency")
                ax.set_xlabel("concurrency (closed loop)")
                ax.set_ylabel("ms (log)")
                ax.set_yscale("log")
                ax.set_xscale("log", base=2)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(outdir / "a_latency_vs_concurrency.png", dpi=110)
        plt.close(fig)
        made.append("a_latency_vs_concurrency.png")
        direct = a.get("direct")
        if direct:
            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            for ax, c in zip(axes, ("1", "16"), strict=True):
                qs = [q / 2 for q in range(1, 200)]
                for name, rows in a.items():
                    ref = _ref(res["a"], name, c)
                    if name == "direct" or c not in rows or ref is None:
                        continue
                    xs = added(rows[c].get("ttft_raw_ms", []), ref.get("ttft_raw_ms", []), qs)
                    pts = [(x, q / 100) for x, q in zip(xs, qs, strict=True) if x is not None]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
                ax.set_title(f"(a) CDF of added TTFT (system - direct), c={c}")
                ax.set_xlabel("added time to first token, ms (symlog)")
                ax.set_xscale("symlog", linthresh=1.0)
                ax.set_ylabel("fraction of requests")
                ax.grid(alpha=0.3)
            axes[0].legend()
            fig.tight_layout()
            fig.savefig(outdir / "a_added_ttft_cdf.png", dpi=110)
            plt.close(fig)
            made.append("a_added_ttft_cdf.png")
    b = res.get("b", {}).get("sweep", {})
    if b:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rows in b.items():
            cs = sorted(int(c) for c in rows)
            ax.plot(cs, [rows[str(c)]["gap_ms"]["p99"] for c in cs], marker="o", label=name)
        ax.axhline(25, ls="--", color="grey", lw=1, label="20 ms pacing + 5 ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("p99 inter-chunk gap, ms (log)")
        ax.set_title("(b) 64 deltas paced 20 ms")
        ax.legend()
        fig.tight_layout()
        fig.savefig(outdir / "b_gap_vs_concurrency.png", dpi=110)
        plt.close(fig)
        made.append("b_gap_vs_concurrency.png")
    c = res.get("c", {})
    if c.get("timeline"):
        t = [s[0] for s in c["timeline"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(t, [s[1] for s in c["timeline"]], color="C0")
        ax.set_xlabel("s")
        ax.set_ylabel("gateway worker RSS, MiB", color="C0")
        ax2 = ax.twinx()
        ax2.plot(t, [s[2] for s in c["timeline"]], color="C1")
        ax2.set_ylabel("open upstream streams (sim)", color="C1")
        ax.set_title(f"(c) {c['streams']} idle streams on one worker")
        fig.tight_layout()
        fig.savefig(outdir / "c_idle_streams.png", dpi=110)
        plt.close(fig)
        made.append("c_idle_streams.png")
    return made


def _ref(a: dict[str, Any], name: str, c: str) -> dict[str, Any] | None:
    """The ``direct`` run that ``name`` at concurrency ``c`` is compared with.

    The paired baseline measured right before it when there is one, else the
    ``direct`` system's own run.
    """
    paired = a.get("paired", {}).get(name, {}).get(c)
    if paired is not None:
        return dict(paired)
    d = a.get("closed", {}).get("direct", {}).get(c)
    return None if d is None else dict(d)


def _a_tables(res: dict[str, Any]) -> list[str]:
    a = res.get("a")
    if not a:
        return []
    closed = a["closed"]
    L = ["## (a) Overhead: zero-delay upstream, 16 short deltas, closed loop, HTTP/1.1", ""]
    L.append("| system | c | req/s | TTFT p50 | TTFT p99 | total p50 | total p99 | added TTFT p50 / p99 | added total p99 | errors |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, rows in closed.items():
        for c in sorted(rows, key=int):
            r = rows[c]
            d = _ref(a, name, c)
            if d and name != "direct":
                at = added(r["ttft_raw_ms"], d["ttft_raw_ms"], (50.0, 99.0))
                tt = added(r["total_raw_ms"], d["total_raw_ms"], (99.0,))
                add = f"{_f(at[0])} / {_f(at[1])}"
                addt = _f(tt[0])
            else:
                add, addt = "—", "—"
            L.append(
                f"| {name} | {c} | {r['rps']:.0f} | {_f(r['ttft_ms']['p50'])} | {_f(r['ttft_ms']['p99'])} | "
                f"{_f(r['total_ms']['p50'])} | {_f(r['total_ms']['p99'])} | {add} | {addt} | "
                f"{sum(r['errors'].values())} |"
            )
    L += ["", "Times in ms. Added = the system's percentile minus `direct`'s at the same concurrency, "
          "measured in a paired run straight before the system's (the machine is shared; the `direct` rows are the system's own run).", ""]
    if a.get("open"):
        L += ["Open loop (fixed arrival rate 100/s, timed from the scheduled start):", ""]
        L += ["| system | sent | ok | TTFT p50 | TTFT p99 | total p99 | errors |", "|---|---|---|---|---|---|---|"]
        for name, r in a["open"].items():
            L.append(f"| {name} | {r['requests']} | {r['ok']} | {_f(r['ttft_ms']['p50'])} | {_f(r['ttft_ms']['p99'])} | {_f(r['total_ms']['p99'])} | {sum(r['errors'].values())} |")
        L.append("")
    if a.get("h2"):
        L += ["HTTP/2 cleartext (h2load, 3,000 streamed requests, 4 connections x 4 streams):", ""]
        L += ["| system | req/s | succeeded | failed | request time min / mean / max |", "|---|---|---|---|---|"]
        for name, r in a["h2"].items():
            L.append(f"| {name} | {_f(r.get('rps'), 0)} | {r.get('succeeded', '—')} | {r.get('failed', '—')} | {' / '.join(r.get('req_min_mean_max', [])) or r.get('error', '—')} |")
        L.append("")
    for n in a.get("notes", []):
        L.append(f"- {n}")
    return L


def _targets(res: dict[str, Any]) -> list[str]:
    a = res.get("a", {}).get("closed", {})
    b = res.get("b", {}).get("sweep", {})
    c = res.get("c", {})
    L = ["## Targets", "", "| target | measured | holds? |", "|---|---|---|"]
    gw = a.get("aiserve")
    d = a.get("direct")
    lite = a.get("litellm")
    ceil_ = a.get("ceiling")
    full = res.get("a", {})

    def add(name: str, c: str, key: str) -> float | None:
        ref = _ref(full, name, c)
        rows = a.get(name, {})
        if ref is None or c not in rows:
            return None
        return added(rows[c][key], ref[key], (99.0,))[0]

    if gw and d:
        x = add("aiserve", "1", "ttft_raw_ms")
        L.append(f"| added p99 TTFT at c=1 ≤ 1 ms over direct | {_f(x)} ms | {'yes' if x is not None and x <= 1 else 'no' + (f' (by {x - 1:.2f} ms)' if x is not None else '')} |")
    if gw and d and lite:
        for cc in ("16", "64"):
            if cc in gw and cc in lite:
                g = add("aiserve", cc, "total_raw_ms")
                li = add("litellm", cc, "total_raw_ms")
                ok = g is not None and li is not None and g <= li / 10
                L.append(f"| c={cc}: added p99 total ≤ 1/10 of LiteLLM's | aiserve {_f(g)} ms vs LiteLLM {_f(li)} ms (ratio {_f(li / g if g and li else None, 1)}x) | {'yes' if ok else 'no'} |")
                ratio = gw[cc]["rps"] / lite[cc]["rps"] if lite[cc]["rps"] else None
                L.append(f"| c={cc}: streams/s ≥ 10x LiteLLM's | {gw[cc]['rps']:.0f} vs {lite[cc]['rps']:.0f} ({_f(ratio, 1)}x) | {'yes' if ratio and ratio >= 10 else 'no'} |")
    elif gw and d:
        L.append("| vs LiteLLM (≤ 1/10 added p99, ≥ 10x streams/s) | LiteLLM not measured in this run | — |")
    if gw and "16" in gw and "64" in gw:
        r16, r64 = gw["16"]["rps"], gw["64"]["rps"]
        L.append(f"| no collapse from c=16 to c=64 | {r16:.0f} → {r64:.0f} req/s | {'yes' if r64 >= 0.8 * r16 else 'no'} |")
    if gw and ceil_:
        worst = min(gw[k]["rps"] / ceil_[k]["rps"] for k in gw if k in ceil_ and ceil_[k]["rps"])
        L.append(f"| (a) throughput ≥ 80 % of ceiling | worst {100 * worst:.0f} % ({', '.join('c={}: {:.0f}/{:.0f}'.format(k, gw[k]['rps'], ceil_[k]['rps']) for k in sorted(gw, key=int) if k in ceil_)}) | {'yes' if worst >= 0.8 else f'no (by {80 - 100 * worst:.0f} points)'} |")
    if c.get("load"):
        errs = sum(c["load"]["errors"].values())
        rss = c.get("worker_rss_peak_mb") or c.get("rss_peak_mb") or 0
        ok = rss <= 400 and errs == 0 and c["streams"] >= 10000
        why = [] if ok else [f"RSS over by {rss - 400:.0f} MB"] if rss > 400 else []
        if errs:
            why.append(f"{errs} errors")
        L.append(f"| (c) {c['streams']:,} streams, RSS ≤ 400 MB, zero errors | worker RSS peak {rss:.0f} MB, {errs} errors, peak open {c.get('open_peak')} | {'yes' if ok else 'no (' + ', '.join(why or ['fewer than 10,000 streams']) + ')'} |")
    if b:
        ref = b.get("direct", {})
        for name, rows in b.items():
            if name == "direct":
                continue
            pts = {
                int(k): (v["gap_ms"]["p99"] - ref[k]["gap_ms"]["p99"])
                if k in ref and v["gap_ms"]["p99"] is not None and ref[k]["gap_ms"]["p99"] is not None
                else None
                for k, v in rows.items()
            }
            over = first_over(pts, 5.0)
            held = [k for k, x in sorted(pts.items()) if x is not None and x <= 5.0]
            L.append(f"| (b) {name}: p99 gap inflation <= 5 ms | holds up to c={held[-1] if held else '-'}; first over at c={over if over else '- (not within the sweep)'} | info |")
    L.append("")
    return L


def _b_table(res: dict[str, Any]) -> list[str]:
    b = res.get("b")
    if not b:
        return []
    L = ["## (b) Streaming: 64 deltas paced 20 ms, closed-loop concurrency sweep", ""]
    L += ["`direct` is swept over every point; another system stops at the first concurrency whose p99 inter-chunk gap exceeds direct's p99 at the same concurrency by more than 5 ms (or that has errors). Gap inflation = system p99 gap - direct p99 gap.", ""]
    L += ["| system | c | streams/s | TTFT p50 | TTFT p99 | gap p50 | gap p99 | gap max | total p99 | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in b["sweep"].items():
        for c in sorted(rows, key=int):
            r = rows[c]
            g = r["gap_ms"]
            L.append(f"| {name} | {c} | {r['rps']:.1f} | {_f(r['ttft_ms']['p50'])} | {_f(r['ttft_ms']['p99'])} | {_f(g['p50'])} | {_f(g['p99'])} | {_f(g['max'])} | {_f(r['total_ms']['p99'], 0)} | {sum(r['errors'].values())} |")
    L.append("")
    for n in b.get("notes", []):
        L.append(f"- {n}")
    return L


def _c_table(res: dict[str, Any]) -> list[str]:
    c = res.get("c")
    if not c or "load" not in c:
        return []
    L = [
        "## (c) Idle streams on one gateway worker",
        "",
        f"Streams opened at {c['ramp_per_s']:.0f}/s, each {c['tokens']} tokens {c['itl_ms']} ms apart "
        "(memory bus). RSS is the serving worker's (hypercorn's parent and multiprocessing's "
        "resource tracker add ~43 MB more; the tree's peak is in the last column). "
        f"Hard fd limit here: {c.get('fd_hard_limit')}: with HTTP/1.1 to the upstream the gateway "
        "holds two descriptors per stream, so the 10,000-stream run speaks h2c to the simulator "
        "(100 streams per connection); the 2,000-stream rows give the memory per stream of the "
        "bare relay (`ceiling`) and of the gateway over HTTP/1.1.",
        "",
        "| system | upstream | streams | completed | errors | peak open upstream | worker RSS idle | worker RSS peak | KB per stream | TTFT p50 / p99 | tree RSS peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [("aiserve", c), *c.get("refs", {}).items()]
    for name, x in rows:
        r = x["load"]
        L.append(
            f"| {name} | {x.get('upstream', 'HTTP/1.1')} | {r['requests']:,} | {r['ok']:,} | {r['errors'] or 0} | "
            f"{x.get('open_peak')} | {_f(x.get('worker_rss_idle_mb'), 0)} MB | {_f(x.get('worker_rss_peak_mb'), 0)} MB | "
            f"{_f(x.get('kb_per_stream'), 1)} | {_f(r['ttft_ms']['p50'], 1)} / {_f(r['ttft_ms']['p99'], 1)} ms | "
            f"{_f(x.get('rss_peak_mb'), 0)} MB |"
        )
    return [*L, ""]


def _d_table(res: dict[str, Any]) -> list[str]:
    d = res.get("d")
    if not d:
        return []
    L = ["## (d) P99 sensitivity matrix (gateway stage histograms)", ""]
    L.append(
        f"Each cell: closed loop, 16 connections; reply {d['reply_tokens']} tokens sent as {d['reply_tokens']}/chunk SSE "
        "events, the first after prefill (1 ms + 0.02 ms/prompt token) + chunk/rate, then one every chunk/rate seconds (the sim sends one token's text per event, so the event *rate* is modelled, "
        "not the bytes). Stage P99 from the diff of `pipeline_stage_latency_seconds` buckets before/after the cell "
        "(interpolated inside a bucket, so as fine as the buckets). Milliseconds."
    )
    L.append("")
    stages = sorted({s for cell in d["cells"] for s in cell["stage_p99_s"]})
    L.append("| prompt tok | rate tok/s | chunk tok | n | " + " | ".join(f"{s} p99" for s in stages) + " | client TTFT p99 | client total p99 |")
    L.append("|---|---|---|---|" + "---|" * len(stages) + "---|---|")
    for cell in d["cells"]:
        vals = [(_f(cell["stage_p99_s"].get(s) * 1000 if cell["stage_p99_s"].get(s) is not None else None, 1)) for s in stages]
        L.append(f"| {cell['prompt']} | {cell['rate']} | {cell['chunk']} | {cell['requests']} | " + " | ".join(vals) + f" | {_f(cell['ttft_p99'], 1)} | {_f(cell['total_p99'], 0)} |")
    L.append("")
    return L


def _profile(res: dict[str, Any]) -> list[str]:
    p = res.get("a", {}).get("profile")
    if not p:
        return []
    if "error" in p:
        return ["## Profile", "", p["error"], ""]
    L = ["## Profile: aiserve worker at c=16, scenario (a) (py-spy, 200 Hz)", "", f"{p['samples']} samples.", ""]
    L += ["Own time (leaf frames):", "", "| % | frame |", "|---|---|"]
    L += [f"| {pct:.1f} | `{f}` |" for f, pct in p["own"]]
    L += ["", "Inclusive time in aiserve_trio frames:", "", "| % | frame |", "|---|---|"]
    L += [f"| {pct:.1f} | `{f}` |" for f, pct in p["ours_inclusive"]]
    L.append("")
    return L


def _short(cmd: str) -> str:
    """A long ``--prompt 'hello hello ...'`` as the shell expression that makes it."""

    def repl(m: re.Match[str]) -> str:
        words = m[1].split()
        if len(set(words)) != 1:
            return m[0]
        return f'--prompt "$(yes {words[0]} | head -n {len(words)} | paste -sd " ")"'

    return re.sub(r"--prompt '([^']{60,})'", repl, cmd)


def write_report(res: dict[str, Any], outdir: Path) -> Path:
    """Write ``report.md`` and the plots into ``outdir``; return the report's path."""
    plots = _plots(res, outdir)
    m = res["machine"]
    L = [f"# aiserve-trio bench — {m.get('started', '')}", ""]
    L += [
        f"- Machine: {m['cores']} cores ({m['cpu']}), {m['platform']}, Python {m['python']}",
        f"- Packages: {', '.join(f'{k} {v}' for k, v in m['packages'].items())}",
        f"- Git: {m['git']} (working tree at the time of the run)",
        f"- CPU pinning: {m['pinning']}",
        f"- Load average at start / end: {', '.join(f'{x:.1f}' for x in m['loadavg_start'])} / {', '.join(f'{x:.1f}' for x in m.get('loadavg_end', []))}",
        f"- Wall time: {m.get('wall_s', 0):.0f} s; fd limit {m['nofile']}",
        f"- Command: `{' '.join(m['argv'])}`",
    ]
    for r in m.get("reruns", []):
        L.append(f"- Re-run merged in: `{' '.join(r['argv'])}` at {r['started']}, git {r['git']}, load average {', '.join(f'{x:.1f}' for x in r['loadavg_start'])}")
    L.append("")
    notes = outdir / "notes.md"
    if notes.exists():
        # The hand-written reading of this run (what missed, by how much, and why).
        L += [notes.read_text().rstrip(), ""]
    L += _targets(res)
    L += _a_tables(res)
    L += _b_table(res)
    L += _c_table(res)
    L += _d_table(res)
    L += _profile(res)
    if plots:
        L += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    L += ["## Exact commands", "", "Processes started:", "", "```", *m.get("commands", []), "```", ""]
    seen: dict[str, int] = {}
    for cmd in m.get("load_commands", []):
        cmd = _short(cmd)
        seen[cmd] = seen.get(cmd, 0) + 1
    L += ["Load runs:", "", "```"] + [f"{c}" + (f"   # x{n}" if n > 1 else "") for c, n in seen.items()] + ["```", ""]
    for r in m.get("reruns", []):
        seen = {}
        for cmd in r.get("load_commands", []):
            cmd = _short(cmd)
            seen[cmd] = seen.get(cmd, 0) + 1
        L += [f"Re-run `{' '.join(r['argv'])}`: processes and load runs:", "", "```", *r.get("commands", [])]
        L += [f"{c}" + (f"   # x{n}" if n > 1 else "") for c, n in seen.items()] + ["```", ""]
    path = outdir / "report.md"
    path.write_text("\n".join(L))
    return path


def main(argv: list[str] | None = None) -> int:
    """Re-render a results folder."""
    args = sys.argv[1:] if argv is None else argv
    outdir = Path(args[0])
    res = json.loads((outdir / "results.json").read_text())
    print(write_report(res, outdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
