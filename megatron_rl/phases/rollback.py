"""After a health stop: set aside the checkpoints holding condemned weights, and put engines that outlive the run
back on the newest healthy weights.

A health signal judges the weights that produced its evidence (phases/health.py): rewards judge the weights
that generated the step's samples, which were synced and possibly checkpointed one (or, under one_step_off,
two) steps ago. When a stop condemns weight version v, every checkpoint holding v or a later version (step
>= v-1) is renamed `rejected_step_<N>` with the reason (trainer/checkpoint.py `reject_checkpoints`), so a
resume starts from the newest checkpoint whose weights' own rollouts passed. Engines that the run started
stop with it; external engines (rollout.engine=external) keep serving after the run, so when they hold a
condemned version the learner loads the newest remaining checkpoint (or the initial weights) and syncs it.

    raise TrainingHealthError(after_stop(session, verdict, served_version))   # every rank (collective)
"""
from __future__ import annotations

from typing import Optional

from megatron_rl.parallel import state
from megatron_rl.parallel.comm import barrier, broadcast_from_controller


def after_stop(session, verdict, served_version: int) -> str:
    """Collective on a stop: act on `verdict.condemned` and return the one-line stop message (what was condemned,
    newest checkpoint left, what the engines serve)."""
    from megatron_rl.runtime import checkpoint_root
    from megatron_rl.trainer.checkpoint import latest_checkpoint, reject_checkpoints

    root = checkpoint_root(session)
    condemned: Optional[int] = verdict.condemned
    moved: list[str] = []
    if condemned is not None and state.is_controller():
        moved = reject_checkpoints(root, condemned - 1, verdict.stop)
    moved = broadcast_from_controller(moved)
    barrier()
    newest = latest_checkpoint(root)
    parts = [verdict.stop]
    if condemned is None or condemned > served_version:
        parts.append("this step's weights were neither synced nor saved")
    else:
        parts.append(f"weights from version {condemned} on (after step {condemned - 1}) are condemned" +
                     (f"; set aside: {', '.join(moved)}" if moved else ""))
    parts.append(f"newest checkpoint: {newest or 'none (the run restarts from its initial weights)'}")
    if condemned == 0:
        parts.append("the run's initial weights are condemned too: there are no older ones to go back to")
    elif condemned is not None and condemned <= served_version:
        if session.cfg.rollout.engine == "external":
            version = restore_newest_healthy(session, newest)
            from megatron_rl.phases.weights import sync_weights

            sync_weights(session.learner, session.transport, session.cfg.precision, weight_version=version,
                         kv_scales=session.kv_scales())
            parts.append(f"the engines serve version {version} again")
        else:
            parts.append(f"the engines that served version {served_version} stop with the run")
    return "; ".join(parts)


def restore_newest_healthy(session, newest: Optional[str]) -> int:
    """Collective: load the weights of checkpoint `newest` (or the run's initial weights) into the learner; their version."""
    if newest is not None:
        from megatron_rl.trainer.checkpoint import load_checkpoint

        rl_state = load_checkpoint(session.learner, newest, load_optimizer=False, load_rng=False)
        if session.kv_cache is not None and rl_state.get("kv_cache_scales") is not None:
            session.kv_cache.load_state_dict(rl_state["kv_cache_scales"])  # the scales those weights were served with
        return int(rl_state["step"]) + 1
    from megatron_rl.warm_start import load_initial_weights

    load_initial_weights(session.learner, session.hf_dir)
    if session.kv_cache is not None:  # measured again on the initial weights, as at the run's start
        from megatron_rl.phases.kv_cache import start

        session.rl_state.pop("kv_cache_scales", None)
        session.kv_cache.probe.close()
        session.kv_cache = start(session)
    return 0
