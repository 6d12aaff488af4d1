"""Rollout: the SGLang-protocol HTTP client, the embedded CPU engine/server, its launcher, and weight sync.

Importing this package is cheap: submodules (engine and sync need torch; client needs only aiohttp)
are imported on use.
"""
