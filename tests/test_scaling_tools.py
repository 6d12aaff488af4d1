"""tools/scaling_sweep.py writes a planned grid of jobs; tools/scaling_report.py turns runs' metrics into a table,
efficiencies and a PNG (here on synthetic metrics with known answers; benchmarks/scaling_cpu.sh runs real ones)."""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import scaling_report  # noqa: E402
import scaling_sweep  # noqa: E402

QWEN8B = str(ROOT / "examples" / "configs" / "qwen3_8b_fp8_grpo.yaml")


def test_layout_strings():
    assert scaling_sweep.layout_overrides("tp2pp2") == ["parallel.tensor_model_parallel_size=2",
                                                        "parallel.pipeline_model_parallel_size=2",
                                                        "parallel.sequence_parallel=false"]
    assert "parallel.sequence_parallel=true" in scaling_sweep.layout_overrides("tp4sp")
    with pytest.raises(SystemExit, match="layout"):
        scaling_sweep.layout_overrides("tp2x")


def test_slurm_grid_is_planned_and_written(tmp_path):
    out = tmp_path / "sweep"
    assert scaling_sweep.main([QWEN8B, "--nodes", "1", "2", "--layouts", "tp2", "tp4", "--precisions", "bf16", "fp8_calib",
                               "--steps", "3", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    cells = {c["name"]: c for c in manifest["cells"]}
    assert len(cells) == 8
    assert cells["n1_tp2_bf16"]["plan"]["errors"] == ["no-gpus-for-learner"]  # one node: the engines take it
    ok = [c for c in cells.values() if c["plan"]["ok"]]
    assert {c["nodes"] for c in ok} == {2} and len(ok) == 4
    job = (out / "jobs" / "n2_tp4_fp8_calib.sbatch").read_text()
    assert "#SBATCH --nodes=2" in job and "slurm_disaggregated.sbatch" in job
    assert "parallel.tensor_model_parallel_size=4" in job and "algo.calibration.enabled=true" in job
    assert "precision.recipe=none" in (out / "jobs" / "n2_tp4_bf16.sbatch").read_text()
    assert len(re.findall(r"^sbatch ", (out / "submit_all.sh").read_text(), flags=re.M)) == 4


def _fake_run(cell: dict, step_s: float, steps: int = 4) -> None:
    run = Path(cell["run_dir"])
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"step": i, "time/rollout": step_s * 0.6, "time/reward": 0.0, "time/advantages": 0.0, "time/logprobs": step_s * 0.1,
             "time/train": step_s * 0.3, "time/weight_sync": 0.0, "time/step": step_s if i else 100.0,
             "rollout/response_len_mean": 5.0} for i in range(steps)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_table_efficiency_and_png(tmp_path):
    out = tmp_path / "sweep"
    tiny = str(ROOT / "examples" / "configs" / "tiny_fp8_grpo.yaml")
    assert scaling_sweep.main([tiny, "--launcher", "local", "--gpu", "cpu", "--gpus-per-node", "1", "--nodes", "1", "2", "4",
                               "--layouts", "dp", "--precisions", "fp8", "--steps", "4", "--out", str(out), "--prompt-tokens", "6",
                               "train.micro_batch_size=16"]) == 0
    cells = {c["name"]: c for c in json.loads((out / "manifest.json").read_text())["cells"]}
    assert "--nproc-per-node 4" in cells["n4_dp_fp8"]["command"]
    _fake_run(cells["n1_dp_fp8"], 4.0)
    _fake_run(cells["n2_dp_fp8"], 2.5)  # 1.6x the throughput on 2x the nodes: efficiency 0.8
    # n4 never ran: reported as "no metrics", not dropped
    assert scaling_report.main([str(out / "manifest.json"), "--out", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "scaling.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| n2_dp_fp8"))
    fields = [f.strip() for f in row.strip("|").split("|")]
    assert fields[4] == f"{128 / 2.5:.2f}" and fields[6] == "0.80", row  # warm-up step (100 s) left out
    assert "| n4_dp_fp8 | 4 | 4 | no metrics |" in md
    png = (tmp_path / "report" / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20000
