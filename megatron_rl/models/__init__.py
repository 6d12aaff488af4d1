"""Architecture presets (presets.py) and the HF <-> Megatron weight mapping."""
