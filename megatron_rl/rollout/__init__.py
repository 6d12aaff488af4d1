"""Rollout: the SGLang-protocol HTTP client, engine launchers and topology, and weight sync (rollout/sync/).

The embedded SGLang-compatible engine these talk to on CPU is its own package (megatron_rl/engine/).
Importing this package is cheap: submodules (sync needs torch; client needs only aiohttp) are imported on use.
"""
