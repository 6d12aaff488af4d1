"""The phases of one RL step, each a small function the loop calls by name (see loop.py)."""
