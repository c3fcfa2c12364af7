"""bench/balance_sweep.py as users run it: a script that writes per-cell rows and a per-R summary."""

import json
import subprocess
import sys


def _sweep(repo_root, *args):
    return subprocess.run([sys.executable, str(repo_root / "bench" / "balance_sweep.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_sweep_summary_counts_match_the_rows(repo_root, tmp_path):
    out = tmp_path / "sweep.json"
    proc = _sweep(repo_root, "--prompts", "6", "--samples", "4", "--replicas", "2,3", "--iccs", "0.3,0.8",
                  "--caps", "8192", "--json", str(out))
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(out.read_text())
    assert data["cells"] == len(data["rows"]) == 4
    for replicas, entry in data["summary"].items():
        rows = [r["ratios"] for r in data["rows"] if r["replicas"] == int(replicas)]
        assert entry["cells"] == len(rows) == 2
        for other in ("round_robin", "verl_default", "tail_aware_placement"):
            assert entry[other]["lower"] == sum(r["tail_aware"] < r[other] for r in rows)
            assert 0 < entry[other]["geo_mean"]
    assert "per R, paired over cells" in proc.stdout
    assert proc.returncode == (0 if data["passed"] == data["cells"] else 1)


def test_sweep_rejects_a_bad_list(repo_root):
    proc = _sweep(repo_root, "--iccs", "0.3,high")
    assert proc.returncode != 0
    assert "--iccs='0.3,high'" in proc.stderr
