"""rollout.weight_sync: moved keys are named, values that cannot work are refused at load time, every transport builds.

Run: pytest -q tests/test_weight_sync_config.py
"""
from __future__ import annotations

import pytest

from megatron_rl.config import load_config
from megatron_rl.config.run import ConfigError
from megatron_rl.rollout.sync import TRANSPORTS, build_transport


@pytest.mark.parametrize("overrides, message", [
    (["rollout.sync_dir=/tmp/x"], "rollout.sync_dir moved: use rollout.weight_sync.sync_dir"),
    (["rollout.weight_sync=distributed"], "use rollout.weight_sync.transport=distributed"),
    (["rollout.weight_sync.transport=nccl"], "rollout.weight_sync.transport"),
    (["rollout.weight_sync.bucket_mb=0"], "rollout.weight_sync.bucket_mb: Input should be greater than 0"),
    (["rollout.weight_sync.timeout_s=-1"], "rollout.weight_sync.timeout_s: Input should be greater than 0"),
    (["rollout.weight_sync.timeout_s=.inf"], "rollout.weight_sync.timeout_s: Input should be a finite number"),
    (["rollout.weight_sync.master_port=70000"], "rollout.weight_sync.master_port: Input should be less than or equal"),
    (["rollout.weight_sync.keep_last=0"], "rollout.weight_sync.keep_last: Input should be greater than or equal to 1"),
    (["rollout.weight_sync.group_name=a/b"], "rollout.weight_sync.group_name"),
    (["rollout.weight_sync.pause_mode=retract"], "rollout.weight_sync.pause_mode"),
    (["rollout.weight_sync.transport=tensor", "rollout.engine=external", "rollout.urls=[http://10.1.2.3:30000]"],
     "transport=tensor .* only an engine on this host"),
])
def test_bad_values_are_named_at_load_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_every_transport_builds_from_config(tmp_path):
    from megatron_rl.engine.testing import make_tiny_model

    make_tiny_model(str(tmp_path / "hf"), seed=0)
    for name, cls in TRANSPORTS.items():
        cfg = load_config(None, [f"rollout.weight_sync.transport={name}", "rollout.engine=external",
                                 "rollout.urls=[http://localhost:30000]", "rollout.weight_sync.bucket_mb=2"])
        transport = build_transport(cfg.rollout.weight_sync, cfg.rollout.urls, str(tmp_path / "hf"), str(tmp_path / "w"))
        assert isinstance(transport, cls) and transport.bucket_bytes == 2 * 1024 * 1024
        assert transport.urls == ["http://localhost:30000"]
        transport.close()
