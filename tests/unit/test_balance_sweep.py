"""bench/balance_sweep.py as users run it: a script that writes per-cell rows and a per-step-model summary."""

import json
import math
import subprocess
import sys


def _sweep(repo_root, *args):
    return subprocess.run([sys.executable, str(repo_root / "bench" / "balance_sweep.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_sweep_summary_matches_the_rows(repo_root, tmp_path):
    out = tmp_path / "sweep.json"
    proc = _sweep(repo_root, "--prompts", "6", "--samples", "4", "--replicas", "2,3", "--iccs", "0.3",
                  "--caps", "8192", "--seeds", "1", "--verl-seeds", "3", "--step-models", "default,kv_heavy",
                  "--jobs", "1", "--oracle", "--hindsight", "--json", str(out), "--plot", str(tmp_path / "live.png"))
    assert proc.returncode in (0, 1), proc.stderr
    assert (tmp_path / "live.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    rows, summary = data["rows"], data["summary"]
    assert len(rows) == 4 and {r["step_model"] for r in rows} == {"default", "kv_heavy"}
    for row in rows:
        assert len(row["verl_default_runs_s"]) == 3
        assert math.isclose(row["makespan_s"]["verl_default"], sum(row["verl_default_runs_s"]) / 3)
        assert row["makespan_s"]["tail_aware"] >= row["t_dl_s"] * (1 - 1e-9)
    for name, entry in summary["per_step_model"].items():
        cells = [r["vs_verl"]["tail_aware"] for r in rows if r["step_model"] == name]
        assert entry["cells"] == len(cells) == 2
        assert math.isclose(entry["vs_verl_worst"], max(cells))
        assert math.isclose(entry["vs_verl_geo"], math.exp(sum(map(math.log, cells)) / 2))
    oracle = [r["vs_verl"]["oracle_lpt"] for r in rows]  # --oracle: true-length LPT beside them
    assert math.isclose(summary["overall"]["oracle_vs_verl_geo"], math.exp(sum(map(math.log, oracle)) / 4))
    assert "oracle/verl" in proc.stdout
    # --hindsight: tail_aware knowing survivors' lengths, per cell and in every summary row.
    hindsight = [r["vs_verl"]["tail_aware_hindsight"] for r in rows]
    assert math.isclose(summary["overall"]["hindsight_vs_verl_geo"], math.exp(sum(map(math.log, hindsight)) / 4))
    assert "hindsight/verl" in proc.stdout
    # Per R too: each R's row holds its own cells.
    for replicas, entry in summary["per_replicas"].items():
        cells = [r["vs_verl"]["tail_aware"] for r in rows if r["replicas"] == int(replicas)]
        assert entry["cells"] == len(cells) == 2 and math.isclose(entry["vs_verl_worst"], max(cells))
    assert "\nR=2 " in proc.stdout and "\nR=3 " in proc.stdout
    overall = summary["overall"]
    assert overall["pass"] == (overall["cells_above_1"] == 0 and overall["vs_verl_geo"] <= 0.92)
    assert proc.returncode == (0 if overall["pass"] else 1)
    assert "TA/T*dl geo" in proc.stdout and ("PASS:" in proc.stdout or "FAIL:" in proc.stdout)


def test_compare_pairs_cells_with_another_sweep(repo_root, tmp_path):
    small = ["--prompts", "6", "--samples", "4", "--replicas", "2", "--iccs", "0.3", "--seeds", "1",
             "--verl-seeds", "2", "--jobs", "1"]
    first = tmp_path / "true.json"
    _sweep(repo_root, *small, "--policy-model", "true", "--no-clock", "--json", str(first))
    same = _sweep(repo_root, *small, "--policy-model", "true", "--no-clock", "--compare", str(first))
    assert "all                3  1.0000  1.0000  1.0000" in same.stdout  # the same runs: exactly 1
    assert "policies given the true step model, no clock" in same.stdout
    assert "oracle/verl" not in same.stdout  # the control of --oracle: no oracle row unless asked
    assert "hindsight/verl" not in same.stdout and "\nR=2 " not in same.stdout  # one R: no per-R row
    off = _sweep(repo_root, *small, "--policy-model", "off", "--prior-error", "2.5", "--compare", str(first))
    assert "(x2.5 alternating), calibrated from the clock" in off.stdout
    assert "tail_aware here / tail_aware in --compare" in off.stdout
    assert _sweep(repo_root, "--prior-error", "0").stderr.strip().endswith("--prior-error=0.0; allowed: a number > 0")
    bad = _sweep(repo_root, "--round-trip-ms", "-5").stderr.strip()
    assert bad.endswith("--round-trip-ms=-5.0; allowed: a number >= 0")


def test_sweep_runs_replicas_of_unequal_speed(repo_root, tmp_path):
    out = tmp_path / "speeds.json"
    proc = _sweep(repo_root, "--prompts", "6", "--samples", "4", "--replicas", "3", "--iccs", "0.3", "--seeds", "1",
                  "--verl-seeds", "2", "--jobs", "1", "--replica-speeds", "equal,one_slow,spread", "--json", str(out))
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(out.read_text())
    assert sorted(r["replica_speeds"] for r in data["rows"]) == ["equal"] * 3 + ["one_slow"] * 3 + ["spread"] * 3
    per_speeds = data["summary"]["per_replica_speeds"]
    assert {name: e["cells"] for name, e in per_speeds.items()} == {"equal": 3, "one_slow": 3, "spread": 3}
    # The worst cell names its whole cell, speed profile included, and it is the row with the worst ratio.
    worst = data["summary"]["overall"]["worst_cell"]
    row = max(data["rows"], key=lambda r: r["vs_verl"]["tail_aware"])
    assert worst == {"step_model": row["step_model"], "replicas": 3, "icc": 0.3, "cap_tokens": 20480,
                     "seed": 0, "replica_speeds": row["replica_speeds"]}
    # Built on the fastest replica, the bounds hold where some replicas run faster than the step model.
    for row in data["rows"]:
        assert min(row["makespan_s"].values()) >= max(row["t_star_s"], row["t_dl_s"]) * (1 - 1e-9), row
    assert "speeds one_slow" in proc.stdout and "speeds equal" in proc.stdout
    # The same cells on one slow replica take longer for verl_default (control: the axis reaches the simulator).
    verl = {(r["replica_speeds"], r["step_model"]): r["makespan_s"]["verl_default"] for r in data["rows"]}
    assert all(verl[("one_slow", m)] > verl[("equal", m)] for _, m in verl)
    spread = {r["step_model"]: r["t_dl_s"] for r in data["rows"] if r["replica_speeds"] == "spread"}
    equal = {r["step_model"]: r["t_dl_s"] for r in data["rows"] if r["replica_speeds"] == "equal"}
    assert all(spread[m] < equal[m] for m in equal)  # the fastest replica there is 0.8x the step model


def test_sweep_rejects_a_bad_list(repo_root):
    proc = _sweep(repo_root, "--iccs", "0.3,high")
    assert proc.returncode != 0
    assert "--iccs='0.3,high'" in proc.stderr
    proc = _sweep(repo_root, "--step-models", "default,gpu")
    assert proc.returncode != 0 and "--step-models='default,gpu'; allowed: default, kv_heavy, per_seq_heavy" in proc.stderr
    proc = _sweep(repo_root, "--replica-speeds", "equal,fast")
    assert proc.returncode != 0 and "--replica-speeds='equal,fast'; allowed: equal, one_slow, spread" in proc.stderr


def test_replot_draws_a_saved_sweep_without_simulating(repo_root, tmp_path):
    saved = tmp_path / "sweep.json"
    _sweep(repo_root, "--prompts", "6", "--samples", "4", "--replicas", "2,3", "--iccs", "0.3,0.85", "--seeds", "1",
           "--verl-seeds", "2", "--jobs", "1", "--oracle", "--json", str(saved))
    png = tmp_path / "sweep.png"
    proc = _sweep(repo_root, "--replot", str(saved), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "cells" not in proc.stdout  # nothing simulated
    # Controls: a saved sweep with no rows, and --replot with nowhere to draw, both refuse by name.
    empty = tmp_path / "empty.json"
    empty.write_text('{"rows": []}')
    assert "no rows to draw" in _sweep(repo_root, "--replot", str(empty), "--plot", str(png)).stderr
    alone = _sweep(repo_root, "--replot", str(saved)).stderr.strip()
    assert alone.endswith(f"--replot={saved}: also give --plot PATH (the PNG to write)")
