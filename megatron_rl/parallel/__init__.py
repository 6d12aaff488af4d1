"""Process groups (state.py), the CPU compatibility layer for megatron-core (compat.py) and the
generic collectives used for global loss statistics (collectives.py)."""
