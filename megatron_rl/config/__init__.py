"""Typed configs: one pydantic section per component; `load_config` is the only parser."""
from megatron_rl.config.run import ConfigError, RunConfig, apply_override, dump_config, load_config

__all__ = ["ConfigError", "RunConfig", "apply_override", "dump_config", "load_config"]
