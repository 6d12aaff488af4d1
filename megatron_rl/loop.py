"""The RL loop: one step = rollout -> reward -> advantages -> log-probs -> train -> weight sync.

Every learner rank runs this function (torchrun); the controller (global rank 0) also talks to the
rollout engines over HTTP, scores rewards and broadcasts the step's batch. Run it with
`megatron-rl train examples/configs/tiny_fp8_grpo.yaml`.
"""
from __future__ import annotations

import math

import torch

from megatron_rl.algo.calibration_plan import CalibrationPlan
from megatron_rl.algo.metrics import add_sums, finalize_metrics
from megatron_rl.config import RunConfig
from megatron_rl.parallel import state
from megatron_rl.parallel.comm import broadcast_from_controller, reduce_loss_sums
from megatron_rl.phases import batching, error_scale, health, logprobs, overlap, placement, reward, rollback, rollout, weights
from megatron_rl.phases.calibrate import StepCalibration
from megatron_rl.phases.loss import RLLoss, with_sequence_rollout_weights
from megatron_rl.runtime import RunSession, finished_run, open_session, save
from megatron_rl.tracking import MetricsWriter, Timers
from megatron_rl.tracking.report import Progress, write_run_report
from megatron_rl.tracking.wandb_sink import open_sinks


def evaluate(session: RunSession, when: str) -> dict[str, float]:
    """Held-out greedy evaluation through the rollout engines (controller; nan elsewhere), as RL-state entries:
    {"eval_<when>": accuracy, "eval_malformed_<when>": malformed fraction (tasks with an answer format)}."""
    if not state.is_controller():
        return {f"eval_{when}": math.nan}
    rows = session.eval_rows[: session.cfg.train.eval_max_prompts]
    out = rollout.greedy_eval(session.client, session.tokenizer, rows, session.reward_fn,
                              session.cfg.rollout.sampling.max_new_tokens, session.is_malformed)
    return {f"eval_{when}": out["accuracy"], **({f"eval_malformed_{when}": out["malformed"]} if "malformed" in out else {})}


def controller_rollout(session: RunSession, step: int, timers: Timers):
    """Controller: generate and score groups (DAPO dynamic sampling: until the step holds train.prompts_per_step
    groups with reward spread), compute advantages, pad into the step's TrainBatch."""
    cfg = session.cfg
    groups = reward.GroupCollector(cfg.train.prompts_per_step, cfg.algo.dapo)
    while groups.needs_more():
        with timers("rollout"):
            samples = rollout.generate_samples(session.client, session.tokenizer, session.prompts.take(cfg.train.prompts_per_step),
                                               cfg.rollout, seed=rollout.round_seed(cfg.rollout.seed, step, groups.rounds))
        with timers("reward"):
            groups.add(samples, reward.score(samples, session.reward_fn, cfg.algo, cfg.rollout.sampling.max_new_tokens,
                                              session.is_malformed))
    samples, metrics = groups.result()
    with timers("advantages"):
        adv, adv_metrics = reward.advantages(samples, cfg.algo)
        batch = batching.build_train_batch(samples.samples, adv, session.tokenizer.pad_token_id,
                                           batching.seq_multiple(cfg.parallel, cfg.precision), session.learner.arch.max_seq_len)
    return batch, {**metrics, **adv_metrics}, samples.samples[: cfg.tracking.log_samples]


def train_on_batch(session: RunSession, batch, step: int, timers: Timers) -> dict:
    """Old log-probs (+ shadow rows), PPO epochs over mini-batches at the plan's bounds, the step's calibration; finalized metrics."""
    cfg, learner, mbs = session.cfg, session.learner, session.cfg.train.micro_batch_size
    # strength=decision (targeted) decides this step's clips on high-precision ratios of every (every targeted) row
    gate_open = error_scale.gate_open(session.clipper, cfg.precision.recipe)
    on_policy_only = batching.on_policy_only_rows(batch.batch_size, cfg.train.num_minibatches, cfg.train.ppo_epochs,
                                                  cfg.train.seed, step)
    plan = CalibrationPlan.build(step, cfg.algo.calibration, cfg.train, batch.batch_size, skip_rows=on_policy_only,
                                 whole_shadow=gate_open)
    probed = health.probe_rows(learner, mbs) if cfg.train.health.check_updated_policy else None
    with timers("logprobs"):
        batch, metrics = logprobs.old_logprobs(learner, batch, mbs, plan=plan, reference=session.reference, probe_rows=probed,
                                               kv_cache=session.kv_cache,
                                               row_groups=batching.old_logprob_row_groups(batch.batch_size, cfg.train, step))
        batch = with_sequence_rollout_weights(batch, cfg.algo)
        batch = error_scale.with_targeted_rows(batch, session.clipper, gate_open, on_policy_only)
        metrics.update(error_scale.targeted_metrics(batch, on_policy_only))
        # no-op unless a decision needs it
        batch = error_scale.with_old_logprobs_hp(learner, batch, mbs, cfg.algo, gate_open, on_policy_only)
    calib = StepCalibration(session.clipper, plan, cfg, session.run_dir)
    sums, learner_metrics = None, {}
    with timers("train"):
        for epoch in range(cfg.train.ppo_epochs):
            for k, mb in enumerate(batching.minibatches(batch, cfg.train.num_minibatches, batching.minibatch_seed(cfg.train.seed, step, epoch))):
                mb = batching.dp_shard(batching.with_token_weights(mb, cfg.algo.policy_loss.agg_mode, batching.agg_max_len(cfg)), state.dp_rank(), state.dp_size())
                mb, bounds, tap = calib.before_update(learner, mb, epoch, k)
                mb = error_scale.with_logprobs_hp(learner, mb, mbs, cfg.algo, first_update=epoch == 0 and k == 0,
                                                  gate_open=gate_open)
                loss_fn = RLLoss(cfg.algo, bounds, tap, off_policy=plan.off_policy(epoch, k), gate_open=gate_open)
                out = learner.train_step(mb, loss_fn, mbs)
                sums = add_sums(sums, loss_fn.sums or {})
                learner_metrics = add_sums(learner_metrics, {k: _t(v) for k, v in out.items()})
    with timers("calibrate"):
        metrics.update(calib.finish())
    if session.clipper is not None and session.clipper.decides_on_high_precision():
        metrics["calib/hp_decision"] = float(gate_open)  # what decided this step's clips (0 under precision.recipe=none)
    n_updates = cfg.train.ppo_epochs * cfg.train.num_minibatches
    metrics.update(finalize_metrics(reduce_loss_sums(sums), cfg.algo.ratio_hist_log_range))
    metrics.update({f"learner/{k}": float(v) / n_updates for k, v in learner_metrics.items()})
    return metrics


def run(cfg: RunConfig) -> dict:
    """Run (or resume) the RL job described by `cfg`; returns the summary on the controller."""
    notice = finished_run(cfg)
    if notice is not None:  # rerunning a finished run starts nothing and leaves its outputs as they are
        return {"finished": True, "notice": notice}
    session = open_session(cfg)
    timers, is_controller = Timers(), state.is_controller()
    writer = MetricsWriter(session.run_dir, cfg.tracking.jsonl, cfg.tracking.tensorboard,
                           resume_step=session.start_step if session.start_step else None,
                           sinks=open_sinks(cfg, session.run_dir)) if is_controller else None
    rollouts = overlap.RolloutSchedule(cfg.rollout.overlap, lambda s, t: controller_rollout(session, s, t),
                                       pending=session.rl_state.get("pending_rollout"), enabled=is_controller)
    memory = placement.EngineMemory(session.transport, cfg.rollout.placement, is_controller=is_controller,
                                    learner=session.learner, offload=cfg.rollout.colocate_offload)
    try:
        memory.resume(timers)  # colocated: the learner frees what it can before the engines fill up
        weights.sync_weights(session.learner, session.transport, cfg.precision, weight_version=session.start_step,
                             kv_scales=session.kv_scales())
        before = {k: v for k, v in session.rl_state.items() if k.startswith(("eval_before", "eval_malformed_before"))}
        if not (session.start_step and before):
            before = evaluate(session, "before")
        progress = Progress(cfg.train.steps, session.start_step, enabled=is_controller and cfg.tracking.progress_bar)
        verdict, served = health.Verdict(ok=True), session.start_step  # served: the weight version the engines hold
        for step in range(session.start_step, cfg.train.steps):
            batch, metrics, shown = rollouts.batch(step, timers)
            rollouts.prefetch(step + 1, cfg.train.steps)  # one_step_off: step+1 generates (weights v=step) while this step trains
            memory.release(timers)  # colocated: the engines free the devices before any rank trains
            batch = broadcast_from_controller(batch)
            metrics.update(train_on_batch(session, batch, step, timers))
            with timers("health"):
                verdict = session.health.check(session.learner, batch, cfg.train.micro_batch_size, metrics, step)
                metrics.update(verdict.metrics)
            metrics.update(rollouts.settle(timers))  # generation ahead ends before the engines' weights change
            memory.resume(timers)  # colocated: engines take their memory (last synced weights) back
            if verdict.ok:  # an unhealthy step's weights never reach the engines
                with timers("weight_sync"):
                    metrics.update(weights.sync_weights(session.learner, session.transport, cfg.precision, weight_version=step + 1,
                                                        kv_scales=session.kv_scales()))
                served = step + 1
            if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
                ev = evaluate(session, "now")
                metrics["accuracy/eval"] = ev["eval_now"]
                if "eval_malformed_now" in ev:
                    metrics["malformed/eval"] = ev["eval_malformed_now"]
            metrics.update(timers.pop())
            if is_controller:
                writer.write(step, {**metrics, "samples": [s.response_text for s in shown]})
                progress.update(metrics)
            if verdict.stop:  # condemned weights that already left the learner are taken back (phases/rollback.py)
                raise health.TrainingHealthError(rollback.after_stop(session, verdict, served))
            if verdict.ok and cfg.checkpoint.save_every and (step + 1) % cfg.checkpoint.save_every == 0 and step + 1 < cfg.train.steps:
                with memory.learner_resident(timers):
                    save(session, step, {**before, **rollouts.state_dict()})
        progress.close()
        after = evaluate(session, "after")
        if verdict.ok:  # the last step's weights passed the health checks
            with memory.learner_resident(timers):
                save(session, cfg.train.steps - 1, {**before, **after})
        if not is_controller:
            return {}
        writer.close()
        from megatron_rl.tracking import read_metrics

        from megatron_rl.cpu_kernels import kernel_report
        from megatron_rl.warm_start import warm_start_summary

        context = [("warm start", warm_start_summary(cfg, session.run_dir)), ("CPU kernels (this run)", kernel_report())]
        text = write_run_report(session.run_dir, read_metrics(writer.path), before["eval_before"], after["eval_after"],
                                session.wall_time(), session.sessions(), plots=cfg.tracking.plots, context=context)
        return {**before, **after, "summary": text}
    finally:
        rollouts.close()
        session.close()


def _t(v) -> torch.Tensor:
    return torch.as_tensor(float(v), dtype=torch.float64)
