"""Exploratory (issue 25): Nsight Compute's PC samples of `scripts/ncu_prefill.py N vs512` (kernel 0: VS(1000, 512),
kernel 1: block top-100) per unit of tile area, grouped by how often a SASS line runs, from the source page:

    ncu --clock-control none --profile-from-start off --kernel-name regex:_ws_prefill --section WarpStateStats \
        --section SourceCounters --import-source no -o /tmp/stall python3 scripts/ncu_prefill.py 65536 vs512
    ncu -i /tmp/stall.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz
    python3 scripts/stall_groups.py source.csv.gz [more.csv.gz ...]

A line's executed count says which steps run it: every step (> 3e6 warp instructions at 64K), the producer's
(7e5-9e5), the strip steps' (1.2e5-1.7e5: VS only) and the masked steps' (1.9e5-2.4e5). Prints JSON per file and
kernel: samples per unit (samples / physical density, thousands), long-scoreboard samples among them, lines per
group (kernels/NOTES.md, sessions 44-45)."""
import collections
import csv
import gzip
import io
import json
import sys

DENSITY = {0: 0.19737667979717088, 1: 0.18586828814257594}  # VS(1000, 512), block top-100 at 64K (the bench's inputs)
GROUPS = (("every_step", 3e6, float("inf")), ("producer", 7e5, 9e5), ("masked_steps", 1.9e5, 2.4e5),
          ("strip_steps", 1.2e5, 1.7e5))


def kernels(path: str) -> list[list[dict[str, str]]]:
    """The source page's rows per profiled kernel, in launch order."""
    text = gzip.open(path, "rt").read() if path.endswith(".gz") else open(path).read()
    return [list(csv.DictReader(io.StringIO("\n".join(part.splitlines()[1:]))))
            for part in text.split('"Kernel Name"')[1:]]


def summary(rows: list[dict[str, str]], density: float) -> dict:
    """Samples per unit of tile area (thousands), in total and per executed-count group."""
    per = collections.defaultdict(lambda: [0, 0, 0])  # samples, long scoreboard, lines
    for r in rows:
        count = int(r["Instructions Executed"])
        group = next((name for name, lo, hi in GROUPS if lo <= count <= hi), "other")
        for key in (group, "total"):
            per[key][0] += int(r["Warp Stall Sampling (All Samples)"])
            per[key][1] += int(r["stall_long_sb"])
            per[key][2] += 1
    return {k: {"samples_k": round(s / density / 1e3), "long_sb_k": round(sb / density / 1e3), "lines": n}
            for k, (s, sb, n) in per.items()}


if __name__ == "__main__":
    print(json.dumps({path: {("vs512", "block")[i]: summary(rows, DENSITY[i]) for i, rows in enumerate(kernels(path))}
                      for path in sys.argv[1:]}, indent=1))
