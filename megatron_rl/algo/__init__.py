"""Pure tensor math of the RL objective: advantages, losses, aggregation, calibration, metrics.

Nothing here imports megatron or calls collectives itself: a global statistic takes a `group`
and hands it to megatron_rl/parallel/collectives.py.
"""
