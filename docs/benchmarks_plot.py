"""The benchmark plot of benchmarks.md, drawn at build time from benchmarks.csv.

Each bar is ggmlopt's time divided by its baseline's, measured in the same run (below 1:
ggmlopt is faster).  The ratios in the CSV must agree with its times (checked here, so a
figure edited in one column but not the other fails the build).
"""
import csv
import os
import sys

import matplotlib.pyplot as plt

here = os.path.dirname(os.path.abspath(sys.argv[0]))
with open(os.path.join(here, "benchmarks.csv"), newline="") as f:
    rows = list(csv.DictReader(f))

for row in rows:
    ratio = float(row["ggmlopt"]) / float(row["baseline"])
    if abs(ratio - float(row["ratio"])) > 0.006:
        raise ValueError(f"benchmarks.csv: {row['case']}: ratio {row['ratio']} but the times "
                         f"give {ratio:.3f}")

titles = {"epoch": "training epochs", "layer": "layers", "kernel": "kernels"}
colours = {"epoch": "#3b75af", "layer": "#519e3e", "kernel": "#ef8636"}
labels = [f"{r['case']}\n(vs {r['baseline is']})" for r in rows]
ratios = [float(r["ggmlopt"]) / float(r["baseline"]) for r in rows]

fig, ax = plt.subplots(figsize=(10.0, 0.42 * len(rows) + 1.2), layout="constrained")
y = range(len(rows))[::-1]
ax.barh(list(y), ratios, color=[colours[r["group"]] for r in rows])
ax.axvline(1.0, color="black", linewidth=1)
ax.set_xscale("log")
ax.set_xticks([0.05, 0.1, 0.2, 0.5, 1, 2], labels=["0.05", "0.1", "0.2", "0.5", "1", "2"])
ax.set_xlim(0.04, 2.5)
ax.set_yticks(list(y), labels=labels, fontsize=7)
for yi, ratio in zip(y, ratios):
    ax.text(ratio * 1.04, yi, f"{ratio:.2f}x", va="center", fontsize=7)
ax.set_xlabel("ggmlopt time / baseline time, same run (log scale; < 1: ggmlopt is faster)")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
ax.legend(handles, titles.values(), loc="lower right", fontsize=8)
