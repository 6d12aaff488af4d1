#!/usr/bin/env bash
# Print the stamp of the CPU install's inputs: a hash of every file that decides what
# scripts/setup_cpu.sh installs (setup.py, pyproject.toml, constraints/cpu.txt, the setup scripts)
# and the version of .venv's Python. setup_cpu.sh stores it in .venv/.install_stamp after a
# successful install and skips the install while it still matches.
# Usage: bash scripts/install_stamp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
{
  sha256sum setup.py pyproject.toml constraints/cpu.txt scripts/setup_cpu.sh scripts/install_stamp.sh
  if [ -x .venv/bin/python ]; then .venv/bin/python -c "import sys; print(sys.version)"; else echo "no venv"; fi
} | sha256sum | cut -d" " -f1
