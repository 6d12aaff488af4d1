#!/usr/bin/env bash
# Miniature scaling study on the CPU box: the tiny FP8 GRPO config under torchrun with world 1, 2 and 4 (DP = world,
# one process per "node"), in three precision arms (BF16, FP8, FP8 + Calibrated Clipping), 4 steps each (the first
# is left out as warm-up). Regenerates benchmarks/scaling_cpu/scaling.md and scaling.png:
#   bash benchmarks/scaling_cpu.sh
# The machine's 2 cores are shared by all processes, so the measured efficiency shows the CPU box's contention,
# not the framework's scaling on a cluster; the point is the tooling (sweep -> runs -> report) on real runs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/scaling_cpu
work=$out/sweep            # generated: warm start, runs, manifest (git-ignored)
config=examples/configs/tiny_fp8_grpo.yaml
export OMP_NUM_THREADS=1
py=.venv/bin/python
if [ ! -f "$work/warm/sft/hf/model.safetensors" ]; then
  $py -m megatron_rl.cli sft $config run_dir=$work/warm sft.steps=200 sft.eval_every=0 sft.stop_accuracy=null data.num_train_prompts=2000 \
    data.num_eval_prompts=8 tracking.progress_bar=false
fi
$py tools/scaling_sweep.py $config --launcher local --gpu cpu --gpus-per-node 1 --nodes 1 2 4 --layouts dp \
  --precisions bf16 fp8 fp8_calib --steps 4 --prompt-tokens 6 --out $work \
  model.init_checkpoint=$work/warm/sft/hf data.train_file=$work/warm/data/train.jsonl \
  data.eval_file=$work/warm/data/eval.jsonl data.tokenizer_dir=$work/warm/data/tokenizer data.num_eval_prompts=8 \
  train.eval_max_prompts=8 train.micro_batch_size=16 algo.calibration.calibrate_every=2
bash $work/run_all.sh
$py tools/scaling_report.py $work/manifest.json --out $out --skip-steps 1 --title "CPU miniature scaling study" \
  --note "Regenerate: \`bash benchmarks/scaling_cpu.sh\` (2-core CPU box, torchrun world 1/2/4, tiny FP8 GRPO config, DP only). The plan column uses the nominal \`cpu\` device of megatron_rl/plan/hardware.py: an analytic model, expected to be far below the measurement, which is dominated by Python, HTTP and gloo overheads at this size. Caveat of the committed numbers: they were measured while other jobs kept the box at load average ~23, so phases that do not depend on the world size (rollout: one controller, one engine) still vary up to 4x between cells; read the efficiencies as noise-dominated and rerun on an idle box for real ratios. On CPU the FP8 arms pay the fake-quant emulation (train and logprobs phases)."
