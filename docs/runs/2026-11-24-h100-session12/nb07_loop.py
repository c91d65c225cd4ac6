"""Run notebook 07 full size on the GPU several times; print each run's checks and plan."""
import json, os, sys, time
from pathlib import Path
from offload_examples.instruments.notebooks import execute_notebook
out = Path(os.environ.get("OUT", "/tmp")); root = Path.cwd()
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
for i in range(int(sys.argv[1])):
    res = out / f"nb07_{i}.json"; t = time.time()
    try:
        execute_notebook(root / "notebooks/07_planner.ipynb", {"device": "cuda", "size": "full", "results_json": str(res)},
                         out / f"nb07_{i}.ipynb", timeout=900)
        r = json.loads(res.read_text())
        ok = all(r["checks"].values())
        print(i, f"{time.time() - t:.0f}s", "OK" if ok else "FAILED", r["checks"], r["plan"].get("choices"), flush=True)
        if ok:
            (out / f"nb07_{i}.ipynb").unlink()
    except Exception as e:
        print(i, "ERROR", type(e).__name__, str(e)[-3000:], flush=True)
