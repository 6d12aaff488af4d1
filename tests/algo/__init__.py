"""Tests of megatron_rl/algo (pure tensor math) and its configs."""
