"""Everything a run needs before its first step, built from a RunConfig: distributed init, data,
tokenizer, learner (initialised from the warm start), rollout engines and client, weight-sync
transport, calibrated clipper, metrics sinks, and resume from the newest checkpoint.

The controller (global rank 0) owns the engines, the client and the sinks; other ranks hold None.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_rl.algo.clipper import CalibratedClipper, make_clipper as clipper_for
from megatron_rl.config import RunConfig, dump_config
from megatron_rl.config.run import check_config_for_world
from megatron_rl.data.jsonl import PromptRow
from megatron_rl.data.sources import load_prompts
from megatron_rl.data.tasks import malformed_checker
from megatron_rl.parallel import state
from megatron_rl.phases.health import HealthGuard
from megatron_rl.phases.rollout import PromptStream
from megatron_rl.reward import RewardFn, get_reward_fn


@dataclass
class RunSession:
    """Handles shared by the phases of the loop."""

    cfg: RunConfig
    """The resolved config."""
    run_dir: Path
    """Output directory."""
    tokenizer: Any
    """HF tokenizer."""
    train_rows: list[PromptRow]
    """RL prompts."""
    eval_rows: list[PromptRow]
    """Held-out prompts."""
    reward_fn: RewardFn
    """Reward function."""
    learner: Any
    """megatron Learner."""
    clipper: Optional[CalibratedClipper]
    """Calibrated clipper (None when calibration is off)."""
    hf_dir: str
    """HF directory (config + tokenizer) engines are started from."""
    cluster: Any = None
    """Embedded engines (controller, embedded mode)."""
    client: Any = None
    """Rollout HTTP client (controller)."""
    transport: Any = None
    """Weight-sync transport (controller and every pipeline stage's sender)."""
    reference: Any = None
    """Frozen reference policy for the KL term (None when algo.kl.coef == 0)."""
    start_step: int = 0
    """First step to run (> 0 when resumed)."""
    rl_state: dict = field(default_factory=dict)
    """Restored RL state (eval before RL, wall time of earlier sessions, etc.)."""
    prompts: Any = None
    """PromptStream of the training prompts (its cursor is checkpointed)."""
    health: Any = None
    """HealthGuard of the run (its counters are checkpointed)."""
    is_malformed: Optional[Callable[[str], bool]] = None
    """The task's answer-format check behind the malformed/* metrics (None: the prompts record no task with a format)."""
    kv_cache: Any = None
    """phases/kv_cache.py KvCacheScales: the recalibrated FP8 KV cache scales (None unless precision recalibrates them)."""
    started: float = field(default_factory=time.perf_counter)
    """perf_counter() when this session (process) started building the run."""

    def wall_time(self) -> float:
        """Seconds spent on this run: earlier sessions up to their last checkpoint plus this session so far."""
        return float(self.rl_state.get("wall_s", 0.0)) + time.perf_counter() - self.started

    def kv_scales(self) -> Optional[torch.Tensor]:
        """[L, 2] FP8 KV cache scales every weight sync carries (None: the engines keep SGLang's 1.0)."""
        return self.kv_cache.scales() if self.kv_cache is not None else None

    def sessions(self) -> int:
        """How many sessions (the first run and each resume) this run has taken, this one included."""
        return int(self.rl_state.get("sessions", 0)) + 1

    def close(self) -> None:
        """Leave weight-update groups, stop engines."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def seed_everything(seed: int) -> None:
    """Seed python, torch (CPU and CUDA) for reproducible runs."""
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Python and torch RNG states (for checkpoints)."""
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    """Restore `rng_state()` output."""
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])


def needs_task_data(cfg: RunConfig) -> bool:
    """True when some data (train/eval rows or the tokenizer) is generated for the synthetic task into the run dir."""
    d = cfg.data
    return d.train_file is None or d.tokenizer_dir is None or (d.eval_file is None and d.num_eval_prompts > 0)


def check_data_paths(cfg: RunConfig) -> None:
    """DataFileNotFoundError naming the field when a configured data file or tokenizer directory does not exist."""
    from megatron_rl.data.jsonl import DataFileNotFoundError

    d = cfg.data
    for name, path in (("data.train_file", d.train_file), ("data.eval_file", d.eval_file)):
        if path is not None and not Path(path).is_file():
            raise DataFileNotFoundError(f"{name}: file not found: {path}")
    if d.tokenizer_dir is not None and not Path(d.tokenizer_dir).is_dir():
        raise DataFileNotFoundError(f"data.tokenizer_dir: directory not found: {d.tokenizer_dir}")


def load_datasets(cfg: RunConfig, run_dir: Path):
    """(tokenizer, train rows, eval rows): from files, or generated for the synthetic task into the run dir.

    Every row is read and encoded once here, so a missing file, a bad line or a character outside the
    tokenizer's vocabulary, or a row the warm start's teacher cannot rewrite (`sft.teacher_carry_drop`), is a
    DataFormatError naming the config field or file:line before any work.
    """
    from megatron_rl.data.jsonl import DataFormatError
    from megatron_rl.data.prepare import prepare_task_data
    from megatron_rl.data.tokenizer import check_encodable, load_tokenizer

    d = cfg.data
    check_data_paths(cfg)
    paths = prepare_task_data(cfg.data, run_dir / "data") if needs_task_data(cfg) else {}
    tokenizer_dir = d.tokenizer_dir or paths["tokenizer"]
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise DataFormatError(f"data.tokenizer_dir: {exc}") from None
    train = load_prompts(d.train_file or paths["train"], d, tokenizer, tokenizer_dir, generated=d.train_file is None)
    eval_path = d.eval_file or paths.get("eval")
    evals = load_prompts(eval_path, d, tokenizer, tokenizer_dir, generated=d.eval_file is None) if eval_path else []
    check_encodable(tokenizer, train + evals)
    if cfg.sft.teacher_carry_drop and not cfg.model.init_checkpoint:  # the warm start will rewrite them: all must be sums
        from megatron_rl.data.tasks import teacher_drops_units_carry

        for row in train:
            teacher_drops_units_carry(row, cfg.sft.teacher_carry_drop, d.seed)
    return tokenizer, train, evals


def read_data_before_writing(cfg: RunConfig):
    """Read and check the user's data files while nothing is written yet; the rows when every file is given.

    A bad line, byte or character is then a DataFormatError naming file:line before the run directory
    exists. When the tokenizer or some prompts are generated, the user's files are checked against a
    copy generated in a temporary directory (None is returned: the run reads them again beside the
    generated files it writes into <run_dir>/data).
    """
    import tempfile

    from megatron_rl.data.jsonl import DataFormatError

    d = cfg.data
    if not needs_task_data(cfg):
        return load_datasets(cfg, Path(cfg.run_dir))  # nothing is generated, so nothing is written
    if d.train_file is None and d.eval_file is None and d.tokenizer_dir is None:
        return None  # everything is generated: nothing of the user's to check
    with tempfile.TemporaryDirectory(prefix="megatron_rl_data_check_") as tmp:
        try:
            load_datasets(cfg, Path(tmp))
        except DataFormatError as exc:  # name the generated files where the run will write them
            raise DataFormatError(str(exc).replace(str(Path(tmp)), str(Path(cfg.run_dir) / "data"))) from None
    return None


def make_clipper(cfg: RunConfig) -> Optional[CalibratedClipper]:
    """The calibrated clipper when algo.calibration.enabled (RunConfig has checked there is an off-policy update to calibrate on)."""
    return clipper_for(cfg.algo)


def start_rollout(cfg: RunConfig, hf_dir: str, run_dir: Path):
    """(cluster, client, transport) on the controller: engines we start (embedded or SGLang) or external URLs.

    Generation goes to the router (or is spread over the engines); weights go to the engines only,
    through a transport whose targets are health-checked before every sync (rollout/topology.py).
    """
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.launcher import launch_from_config
    from megatron_rl.rollout.sync import build_transport
    from megatron_rl.rollout.topology import EnginePool, PooledTransport, resolve_external

    r = cfg.rollout
    cluster = None
    sync_dir = r.weight_sync.sync_dir or str(run_dir / "weights")
    if r.engine == "external":
        gen_urls, worker_urls = resolve_external(r.urls, r.weight_update_urls, api_key=r.api_key)
    else:
        from megatron_rl.rollout.sglang_launcher import trainer_local_gpus

        cluster = launch_from_config(r, hf_dir, tokenizer_path=hf_dir, log_dir=str(run_dir / "logs"),
                                     precision=cfg.precision, launch_dir=sync_dir,
                                     learner_gpus=trainer_local_gpus() if r.engine == "sglang" else None)
        gen_urls, worker_urls = cluster.generate_urls, cluster.worker_urls
    client = RolloutClient.from_config(r, gen_urls)
    client.wait_until_healthy_sync(r.startup_timeout_s)
    transport = build_transport(r.weight_sync, worker_urls, hf_dir, sync_dir, api_key=r.api_key)
    pool = EnginePool(worker_urls, cluster, restart=r.restart_dead_engines,
                      generation_client=client if len(gen_urls) > 1 else None)
    return cluster, client, PooledTransport(transport, pool)


def attach_weight_senders(session: "RunSession") -> None:
    """Give every pipeline stage's sender (TP/DP/CP rank 0 of its stage) a transport to the controller's engines;
    colocated, every learner rank on an engine's device instead, fed to that engine (`attach_colocated_feeders`)."""
    from megatron_rl.parallel.comm import broadcast_from_controller
    from megatron_rl.rollout.sync import build_transport
    from megatron_rl.trainer.weight_export import StreamingExporter

    urls = broadcast_from_controller(session.transport.urls if state.is_controller() else None)
    r = session.cfg.rollout
    if r.placement == "colocated":
        attach_colocated_feeders(session, urls)
        return
    if not state.is_controller() and StreamingExporter(session.learner).is_sender:
        session.transport = build_transport(r.weight_sync, urls, session.hf_dir,
                                            r.weight_sync.sync_dir or str(session.run_dir / "weights"), api_key=r.api_key)


def attach_colocated_feeders(session: "RunSession", urls: list[str]) -> None:
    """rollout.placement=colocated: each learner rank on an engine's device gets a tensor transport fed to that engine's
    TP rank on its device (rollout/colocation.py decides which, once; phases/colocated.py sends). Collective; a layout
    that cannot work (an engine device without a learner rank, engines in an unknown order) is a ValueError on every rank."""
    from megatron_rl.phases.colocated import share_feeds
    from megatron_rl.rollout.colocation import colocated_engines
    from megatron_rl.rollout.sync import build_transport

    r = session.cfg.rollout
    engines, error = None, None
    if state.is_controller():
        try:
            if (r.engine == "external" and r.num_engines > 1 and not r.weight_update_urls
                    and sorted(urls) != sorted(u.rstrip("/") for u in r.urls)):
                raise ValueError(f"rollout.placement=colocated with rollout.num_engines={r.num_engines} external engines "
                                 "behind a router: list them in rollout.weight_update_urls in the order they were started "
                                 "(engine i runs on the i-th group of devices; a router's worker list has no order)")
            engines = colocated_engines(r, urls)
            # the layout says where each engine should run; the engines say where they do (an engine started by hand
            # or by another launcher may hold other devices, and would exit on the handles its feeders send)
            session.transport.check_colocated_devices(engines)
        except ValueError as exc:
            error = str(exc)
    feed = share_feeds(engines, error)
    if state.is_controller():
        session.transport.set_feed(feed)
    elif feed is not None:
        session.transport = build_transport(r.weight_sync, urls, session.hf_dir,
                                            r.weight_sync.sync_dir or str(session.run_dir / "weights"), api_key=r.api_key)
        session.transport.set_feed(feed)


def check_external_rollout(cfg: RunConfig) -> None:
    """Fail fast (RolloutServerError) when external engines are unreachable, before any warm start or model build."""
    from megatron_rl.rollout.client import RolloutClient, RolloutServerError

    try:
        RolloutClient.from_config(cfg.rollout).wait_until_healthy_sync(cfg.rollout.startup_timeout_s)
    except RolloutServerError as exc:
        raise RolloutServerError(f"{exc} (rollout.engine=external: start the servers first or fix rollout.urls)") from None


def check_rollout_engines(cfg: RunConfig) -> None:
    """Fail fast, before any warm start or model build: external servers answer and no weight target is a router; SGLang can start here."""
    if cfg.rollout.engine == "external":
        from megatron_rl.rollout.topology import resolve_external

        check_external_rollout(cfg)
        resolve_external(cfg.rollout.urls, cfg.rollout.weight_update_urls, api_key=cfg.rollout.api_key)
    elif cfg.rollout.engine == "sglang":
        from megatron_rl.rollout.sglang_launcher import check_sglang_python, engine_gpu_groups, trainer_local_gpus, visible_gpu_count

        engine_gpu_groups(cfg.rollout, visible_gpu_count(), trainer_local_gpus())
        check_sglang_python(cfg.rollout.sglang_executable)


def open_session(cfg: RunConfig) -> RunSession:
    """Build the whole run; resumes from the newest checkpoint of run_dir when cfg.checkpoint.resume."""
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import (check_model_sources, ensure_warm_start, initialize_learner, model_vocab_size,
                                        needs_warm_start)

    started = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    # Paths, the starting weights' architecture and the user's data files are checked before any distributed or
    # model work (errors within seconds) and before anything is written (a bad input leaves nothing behind).
    check_data_paths(cfg)
    check_model_sources(cfg, run_dir)
    given_data = read_data_before_writing(cfg)
    state.init_distributed(cfg.parallel, cfg.train.seed)
    check_config_for_world(cfg, state.dp_size(), sft=needs_warm_start(cfg, run_dir))
    seed_everything(cfg.train.seed)
    if state.is_controller():
        check_rollout_engines(cfg)
    if state.is_controller():
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
    tokenizer, train_rows, eval_rows = given_data or _controller_first(lambda: load_datasets(cfg, run_dir))
    hf_dir = ensure_warm_start(cfg, run_dir, tokenizer, train_rows)
    learner = Learner(cfg.model, cfg.parallel, cfg.optim, cfg.precision, vocab_size=model_vocab_size(hf_dir, tokenizer),
                      seed=cfg.train.seed, total_steps=cfg.train.optimizer_steps)
    hf_dir = initialize_learner(learner, hf_dir, tokenizer, run_dir)
    session = RunSession(cfg=cfg, run_dir=run_dir, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
                         reward_fn=get_reward_fn(cfg.data.reward), learner=learner, clipper=make_clipper(cfg), hf_dir=hf_dir,
                         prompts=PromptStream(train_rows, cfg.data.seed),
                         is_malformed=malformed_checker(train_rows),
                         health=HealthGuard(cfg.train.health, learner.arch.vocab_size, cfg.train.ppo_epochs * cfg.train.num_minibatches,
                                            rollout_lag=1 if cfg.rollout.overlap == "one_step_off" else 0),
                         started=started)
    if cfg.algo.kl.coef > 0:
        from megatron_rl.phases.logprobs import ReferencePolicy

        session.reference = ReferencePolicy(learner)
    _maybe_resume(session)
    from megatron_rl.phases import kv_cache

    session.kv_cache = kv_cache.start(session)  # restored, or measured on the first prompts before the first sync
    if state.is_controller():
        session.cluster, session.client, session.transport = start_rollout(cfg, hf_dir, run_dir)
    attach_weight_senders(session)
    return session


def _controller_first(fn):
    """Run `fn` on the controller first (it may write files), then on the other ranks."""
    from megatron_rl.parallel.comm import barrier

    if state.is_controller():
        out = fn()
        barrier()
        return out
    barrier()
    return fn()


def checkpoint_root(session: RunSession) -> str:
    """<run_dir>/checkpoints."""
    return str(session.run_dir / "checkpoints")


def _maybe_resume(session: RunSession) -> None:
    """Load the newest complete checkpoint (model, optimizer, RL state) when resuming is on."""
    if not session.cfg.checkpoint.resume:
        return
    from megatron_rl.trainer.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(checkpoint_root(session))
    if path is None:
        return
    rl_state = load_checkpoint(session.learner, path)
    session.start_step = int(rl_state["step"]) + 1
    # checkpoints from before DAPO refills advanced the cursor by exactly prompts_per_step per step
    session.prompts.cursor = int(rl_state.get("prompt_cursor", session.start_step * session.cfg.train.prompts_per_step))
    if rl_state.get("health") is not None:
        session.health.load_state_dict(rl_state["health"])
    if session.clipper is not None and rl_state.get("clipper") is not None:
        session.clipper.load_state_dict(rl_state["clipper"])
    # load_checkpoint restores per-rank RNG under the same layout; the controller's python/torch
    # streams (prompt order, sampling seeds) are the ones that shape the run, so restore them too.
    if state.is_controller():
        set_rng_state(rl_state["rng"])
    session.rl_state = rl_state
    if state.is_controller():
        print(f"resumed from {path} at step {session.start_step}", flush=True)


def finished_run(cfg: RunConfig) -> Optional[str]:
    """For a run whose final checkpoint already exists (rerunning it has nothing to do): print a one-line notice
    and return it; else None.

    Reads files only (no distributed init, no engines): every rank of a torchrun job reaches the same answer,
    and torchrun's RANK says which one prints.
    """
    from megatron_rl.trainer.checkpoint import checkpoint_meta, latest_checkpoint

    run_dir = Path(cfg.run_dir)
    path = latest_checkpoint(str(run_dir / "checkpoints")) if cfg.checkpoint.resume else None
    done = int(checkpoint_meta(path)["step"]) + 1 if path is not None else 0
    if done == 0 or done < cfg.train.steps:
        return None
    summary = run_dir / "summary.txt"
    where = f"its summary is {summary}" if summary.exists() else f"no {summary} (the run stopped before writing it)"
    notice = (f"run already complete: {run_dir} finished its {done} steps ({Path(path).name}); {where}. "
              f"To start over add checkpoint.resume=false (overwrites it) or pick a new run_dir=...; "
              f"to train further raise train.steps.")
    if os.environ.get("RANK", "0") == "0":
        print(notice, flush=True)
    return notice


def save(session: RunSession, step: int, extra: dict) -> None:
    """Checkpoint model, optimizer and RL state after `step`."""
    from megatron_rl.trainer.checkpoint import save_checkpoint

    # the clipper's state is the last pipeline stage's: StepCalibration.finish copies it to every stage each step
    rl_state = {"step": step, "rng": rng_state(), "clipper": session.clipper.state_dict() if session.clipper else None,
                "prompt_cursor": session.prompts.cursor, "health": session.health.state_dict(),
                "wall_s": session.wall_time(), "sessions": session.sessions(),
                "kv_cache_scales": session.kv_cache.state_dict() if session.kv_cache is not None else None, **extra}
    save_checkpoint(session.learner, checkpoint_root(session), step, rl_state, keep_last=session.cfg.checkpoint.keep_last,
                    protect=vouched_checkpoint(session))


def vouched_checkpoint(session: RunSession) -> Optional[str]:
    """The newest checkpoint whose weights' own rollouts passed the health checks (retention keeps it: a later stop may
    condemn every newer one); meaningful on the controller, which judges."""
    from megatron_rl.trainer.checkpoint import list_checkpoints

    vouched = [path for step, path in list_checkpoints(checkpoint_root(session)) if step + 1 <= session.health.vouched_version]
    return str(vouched[-1]) if vouched else None
