"""Per-layer host time of diag25, paired within each round: the median over the rounds of (variant - none)
for every layer's forward, and their sums over the offloaded layers (0-1), the layers the schedule releases
at (18-19) and the rest (2-17). Run here on the stored diag25.json; writes diag25_layers.json."""
import json, statistics
from pathlib import Path
here = Path(__file__).parent
rows = json.loads((here / "diag25.json").read_text())["rows"]
out = {}
for name, rs in rows.items():
    if name == "none":
        continue
    per = [statistics.median(a["host_layers"][j] - b["host_layers"][j] for a, b in zip(rs, rows["none"]))
           for j in range(len(rs[0]["host_layers"]))]
    out[name] = {"per_layer_ms": [round(x, 3) for x in per], "layers_0_1_ms": round(sum(per[:2]), 3),
                 "layers_2_17_ms": round(sum(per[2:18]), 3), "layers_18_19_ms": round(sum(per[18:]), 3)}
(here / "diag25_layers.json").write_text(json.dumps(out, indent=1) + "\n")
for name, v in out.items():
    print(f"{name:14s} layers 0-1 {v['layers_0_1_ms']:+.2f} ms, 2-17 {v['layers_2_17_ms']:+.2f} ms, 18-19 {v['layers_18_19_ms']:+.2f} ms")
