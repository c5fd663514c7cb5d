"""Put LVF-only runs (lazy_1202/lvf_only.sh's JSON) in place of the stored LVF rows.

    .venv/bin/python docs/sim/issue18/replace_lvf_rows.py DIR "NOTE"
    .venv/bin/python docs/sim/issue18/must_show.py

For every must-show run file docs/sim/issue18/<name>.json that DIR has: its lvf rows become
DIR/<name>.json's, the baselines' rows stay, and config.lvf_rows_from records DIR's config
with NOTE (what changed). Refuses a DIR whose rates differ from the stored file's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ISSUE18 = Path(__file__).resolve().parent
sys.path.insert(0, str(ISSUE18))
import must_show  # noqa: E402


def main(run_dir: str, note: str) -> None:
    for name in must_show.RUNS + must_show.MIXED:
        new_path = Path(run_dir) / f"{name}.json"
        if not new_path.exists():
            continue
        stored_path = ISSUE18 / f"{name}.json"
        stored, new = json.loads(stored_path.read_text()), json.loads(new_path.read_text())
        lvf = [r for r in new["results"] if r["policy"] == "lvf"]
        old = [r for r in stored["results"] if r["policy"] == "lvf"]
        if sorted(r["rps"] for r in lvf) != sorted(r["rps"] for r in old):
            raise SystemExit(f"{new_path}: rates {[r['rps'] for r in lvf]} differ from the "
                             f"stored {[r['rps'] for r in old]}")
        by_rate = {r["rps"]: r for r in lvf}
        stored["results"] = [by_rate[r["rps"]] if r["policy"] == "lvf" else r
                             for r in stored["results"]]
        stored["config"]["lvf_rows_from"] = {**new["config"], "note": note}
        stored_path.write_text(json.dumps(stored, indent=1) + "\n")
        print(f"{stored_path}: {len(lvf)} lvf rows from {new_path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
