"""Turn one pytest-benchmark JSON run of bench/ into a markdown table.

    python -m pytest bench --benchmark-only --benchmark-json=bench.json
    python bench/report.py bench.json

One row per (case, baseline): both medians, the ratio ggmlopt/baseline (below 1
means ggmlopt is faster), the target and pass/miss.  Absolute targets (ns per
item) get a row of their own; "reference" timings (the copy bandwidth) are shown
with their GB/s.  Spread is the interquartile range over the median, a measure
of how noisy the machine was during that timing.
"""
import argparse
import json
import sys


def fmt_time(seconds):
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def spread(bench):
    stats = bench["stats"]
    return stats["iqr"] / stats["median"] if stats["median"] > 0 else float("nan")


def throughput(bench):
    """GB/s when the bytes moved are known, else ns per item, else ''."""
    info, median = bench["extra_info"], bench["stats"]["median"]
    if "bytes" in info:
        return f"{info['bytes'] / median / 1e9:.1f} GB/s"
    if "items" in info:
        return f"{median / info['items'] * 1e9:.2f} ns/item"
    return ""


def load_cases(path):
    """{case: {"ggmlopt": bench, "baselines": [...], "references": [...]}} in run order."""
    with open(path) as f:
        data = json.load(f)
    cases = {}
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        if "case" not in info:
            continue
        entry = cases.setdefault(info["case"], {"ggmlopt": None, "baselines": [],
                                                "references": []})
        if info["role"] == "ggmlopt":
            entry["ggmlopt"] = bench
        elif info["role"] == "baseline":
            entry["baselines"].append(bench)
        else:
            entry["references"].append(bench)
    return data, cases


def rows(cases):
    """Yield (case, ggmlopt, baseline, ratio, target, verdict, spread, throughput)."""
    for case, entry in cases.items():
        g = entry["ggmlopt"]
        if g is None:
            continue
        gm = g["stats"]["median"]
        for b in entry["baselines"]:
            bm = b["stats"]["median"]
            ratio = gm / bm
            target = b["extra_info"].get("target_ratio")
            verdict = "" if target is None else ("pass" if ratio <= target else "**miss**")
            yield (case, f"{fmt_time(gm)}", f"{fmt_time(bm)} ({b['extra_info']['label']})",
                   f"{ratio:.3f}x", "" if target is None else f"<= {target:.3g}x", verdict,
                   f"{spread(g):.0%} / {spread(b):.0%}", throughput(g))
        max_ns = g["extra_info"].get("target_ns_per_item")
        if max_ns is not None:
            ns = gm / g["extra_info"]["items"] * 1e9
            yield (case, fmt_time(gm), "(absolute)", f"{ns:.2f} ns/item",
                   f"<= {max_ns:g} ns/item", "pass" if ns <= max_ns else "**miss**",
                   f"{spread(g):.0%}", throughput(g))
        for r in entry["references"]:
            yield (case, "", f"{fmt_time(r['stats']['median'])} ({r['extra_info']['label']})",
                   "", "", "", f"{spread(r):.0%}", throughput(r))


def machine_lines(data):
    m = data.get("machine_info", {})
    g = m.get("ggmlopt", {})
    cpu = m.get("cpu", {}).get("brand_raw", "?")
    lines = [
        (f"- CPU: {cpu}, {g.get('cpu_count', '?')} logical cores; "
        f"Python {m.get('python_version', '?')}, NumPy {g.get('numpy', '?')}, "
        f"torch {g.get('torch') or 'absent'}"),
        (f"- ggmlopt SIMD path: {g.get('simd_active', '?')} (compiled: "
        f"{', '.join(g.get('simd_compiled', []))}; GGMLOPT_SIMD override: "
        f"{g.get('simd_override')}); ggmlopt threads: {g.get('num_threads', '?')}, "
        f"torch threads: {g.get('torch_num_threads', '-')} (\"1 thread\" cases set both to 1)"),
    ]
    start, end = g.get("loadavg_at_start"), g.get("loadavg_at_end")
    if start and end:
        lines.append(f"- load average (1/5/15 min): {', '.join(f'{x:.1f}' for x in start)} at "
                     f"start, {', '.join(f'{x:.1f}' for x in end)} at the end")
    if data.get("datetime"):
        lines.append(f"- run: {data['datetime']}, commit "
                     f"{data.get('commit_info', {}).get('id', '?')[:10]}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a file written by pytest --benchmark-json")
    args = parser.parse_args(argv)
    data, cases = load_cases(args.json)
    out = machine_lines(data) + [""]
    out.append("| case | ggmlopt median | baseline median | ratio | target | result "
               "| spread (g / b) | ggmlopt throughput |")
    out.append("|---|---|---|---|---|---|---|---|")
    all_rows = list(rows(cases))
    for row in all_rows:
        out.append("| " + " | ".join(row) + " |")
    verdicts = [r[5] for r in all_rows if r[5]]
    missed = sum(v != "pass" for v in verdicts)
    out.append("")
    out.append(f"{len(verdicts) - missed} of {len(verdicts)} targets met.")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
