"""The GRPO trainer: the loop (train, then checkpoints, evaluation, health and stop votes around each step) and
one step, train_step, on every rank, read top to bottom as its stages with the step's data passed between them:

    graded = source.next_batch(step)   prompts, rollout, grade (dynamic sampling: more rounds; curriculum
                                       statistics): batch_source.py, from this rank's rollout engine
                                       (ColocatedSource) or from the rollout ranks (RolloutRankSource, async)
    state = StepState(graded)          learner.py: the step's data, passed from stage to stage
    learner.learn(state)               advantage, select rows, log-probs, update (learner.py)
    metrics                            all-reduced over ranks by name (step_metrics.py)

Collectives happen only in the engine (FSDP forwards/backwards, clipping, checkpoints) and in a few all-reduces;
every rank runs the same number of forward/backward passes (micro-batch counts are agreed first, short ranks run
empty micro-batches), so no path can deadlock.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo_dist import checkpoint as ckpt
from grpo_dist import distributed as gdist
from grpo_dist import nonfinite
from grpo_dist import watchdog
from grpo_dist.async_rollout import AsyncRollouts, replica_engine
from grpo_dist.batch_source import ColocatedSource, RolloutRankSource, StepBatch
from grpo_dist.build import build_models, build_rollouts, check_prompt_lengths, load_split
from grpo_dist.checkpointer import Checkpointer, Counters, RunInfo, Scheduler
from grpo_dist.checkpointer import resolve as resolve_resume
from grpo_dist.completions import CompletionLog, format_sample
from grpo_dist.config import ConfigError, GRPOConfig
from grpo_dist.curriculum import Curriculum
from grpo_dist.data import DataError, PromptSampler
from grpo_dist.graded import sampling_spec
from grpo_dist.environments import build_environment, step_metrics as environment_metrics
from grpo_dist.health import CANNOT_LEARN_EXIT_CODE, HealthMonitor
from grpo_dist.interrupts import PREEMPTED_EXIT_CODE, GracefulStop
from grpo_dist.learner import Learner, StepState
from grpo_dist.metrics import MetricsLogger, MetricsWriteError
from grpo_dist.models import load_tokenizer, reward_dtype
from grpo_dist.nonfinite import NONFINITE_EXIT_CODE, NonFiniteError  # noqa: F401  (train.py reads them here)
from grpo_dist.rewards import RewardComputer
from grpo_dist.rewards.batch import argument_problems
from grpo_dist.rollout import RolloutBatch, eos_token_ids
from grpo_dist.rollout_engines import SamplingSpec, require_vllm
from grpo_dist.sft import SFTMixer, load_sft_examples
from grpo_dist.step_metrics import flops_metrics, reward_means, sampler_metrics, step_metrics, timing_metrics

class Timer:
    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        watchdog.set_phase(name)  # what a peer names if this rank stops or hangs in this stage
        t0 = time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


class GRPOTrainer:
    def __init__(self, cfg: GRPOConfig, ctx: gdist.DistContext):
        self.cfg, self.ctx = cfg, ctx
        if cfg.distributed.cpu_offload and ctx.device.type == "cpu":
            raise ConfigError("config key 'distributed.cpu_offload' = true does not apply to a CPU-only run: the "
                              "parameters and optimizer state are in host memory already; set it false")
        # sampling_noise=rank (and vLLM, dropout): each rank its own stream; per_prompt rollouts do not read it
        ckpt.seed_everything(cfg.seed + ctx.rank)
        # Data and reward functions first: their mistakes are named before minutes of model loading.
        self.train_examples = load_split(cfg, "train", ctx.is_main)
        self.eval_examples = load_split(cfg, "eval", ctx.is_main) if cfg.eval_steps or cfg.full_eval_steps else []
        if (cfg.eval_steps or cfg.full_eval_steps) and not self.eval_examples:
            key = "eval_steps" if cfg.eval_steps else "full_eval_steps"
            raise ConfigError(f"config key '{key}' = {getattr(cfg, key)}, but the eval split is empty (no "
                              f"data.eval_path, and data.preset gives no held-out set here); set data.eval_path")
        # difficulty-aware sampling: the column check of curriculum.mode=static runs here, before any model loads
        self.curriculum = Curriculum(cfg.curriculum, self.train_examples, cfg.prompts_per_rank * ctx.world_size,
                                     cfg.seed) if cfg.curriculum.mode != "none" else None
        self.sampler = PromptSampler(self.train_examples, cfg.prompts_per_rank, ctx.rank, ctx.world_size, cfg.seed,
                                     self.curriculum)
        # the checkpoint to resume from and its trainer_state.json, before any model loads
        self._resume = resolve_resume(cfg, ctx, self.curriculum is not None)
        sft_examples = load_sft_examples(cfg, self.train_examples, ctx.is_main) if cfg.sft_coef else None
        self.rewards = RewardComputer(cfg.rewards, num_workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s,
                                      device=ctx.device, dtype=reward_dtype(cfg),
                                      conversational=cfg.data.use_chat_template)  # reward models load here
        bad = argument_problems(self.rewards, self.train_examples)  # a column a batch function needs is missing
        if bad:
            self.rewards.close()
            raise ConfigError(bad[0], bad)
        if cfg.rollout_engine == "vllm":
            require_vllm()  # a missing or broken vLLM stops here, before any model loads
        self.tokenizer = load_tokenizer(cfg.model)
        self.environment = build_environment(cfg, self.tokenizer)  # single-turn unless config section environment
        try:  # prompts that lose their beginning: one warning, or refused (before models)
            check_prompt_lengths(cfg, ctx, self.train_examples, self.tokenizer)
        except DataError:
            self.rewards.close()
            raise
        self.sft = SFTMixer(cfg, ctx, self.tokenizer, sft_examples) if sft_examples else None  # SFT + RL
        self.models = build_models(cfg, ctx, self.tokenizer)  # policy engine, reference, replica (build.py)
        m = self.models
        self.engine, self.ref_model, self.gen_model, self.hf_model = m.engine, m.ref_model, m.gen_model, m.hf_model
        self.tied_weights, self.padding_free, self.share_prompts = m.tied_weights, m.padding_free, m.share_prompts
        self._flops_shape, self._peak_flops, self.save_format = m.flops_shape, m.peak_flops, m.save_format
        self.step = 0
        self.consecutive_nonfinite = 0
        self.nonfinite_steps = 0
        self.was_finished = False  # resumed at max_steps: nothing to train (nothing_to_do)
        self._stop_requested = False
        self.checkpointer = Checkpointer(cfg, ctx, self.models, {  # what a checkpoint holds (checkpointer.py)
            "counters": Counters(self), "sampler": self.sampler, "scheduler": Scheduler(self.engine),
            "run": RunInfo(cfg, ctx), "sft_sampler": self.sft.sampler if self.sft is not None else None,
            "curriculum": self.curriculum})
        self.checkpointer.resume(self._resume)
        if cfg.save_best:
            self.checkpointer.load_best()
        self.rollout_engine = build_rollouts(cfg, ctx, self.models, resumed=self.checkpointer.resumed_from is not None)
        resuming = bool(cfg.resume_from_checkpoint)  # then the lines of steps after self.step are redone
        self.logger = MetricsLogger(cfg.output_dir, ctx.is_main, cfg.report_to, cfg.to_dict(), cfg.max_steps,
                                    cfg.progress_bar, cfg.logging_steps, start_step=self.step, resuming=resuming)
        self.completion_log = CompletionLog(cfg.output_dir, cfg.log_completions, ctx.is_main, start_step=self.step,
                                            resuming=resuming)
        self.last_step: StepState | None = None  # the last step's state (advantages, rows, token counts, votes)
        self.health = HealthMonitor(cfg.health, cfg.max_completion_length, cfg.beta,  # on all-reduced metrics only
                                    completions_per_step=cfg.prompts_per_rank * ctx.world_size * cfg.num_generations,
                                    grad_norm_per_signal=not cfg.skip_zero_advantage_groups)
        self.on_graded = None  # optional callback(batch, rewards) after each step's grading (grpo_dist/dry_run.py)
        # rollout_ranks > 0: the rollouts come from rollout ranks (async_rollout.py); with max_staleness > 0 the
        # objective is decoupled PPO: clipped around the proximal policy (this step's weights, a no-grad pass),
        # weighted by proximal / behaviour (the sampler's log-probs), truncated at sampler_correction_cap
        self.behaviour_ratio = bool(cfg.rollout_ranks and cfg.max_staleness)
        self.source = self._batch_source()
        self.learner = Learner(cfg, ctx, self.engine, self.ref_model, self.tokenizer, self._eos_ids(),
                               padding_free=self.padding_free, share_prompts=self.share_prompts, sft=self.sft,
                               behaviour_ratio=self.behaviour_ratio, checkpoint_note=self._checkpoint_note)

    def request_stop(self, signum=None, frame=None) -> None:
        """Stop request (SIGTERM / SIGUSR1 / the first Ctrl-C, see interrupts.py): finish the current step,
        checkpoint, exit PREEMPTED_EXIT_CODE."""
        self._stop_requested = True

    # ------------------------------------------------------------------------------------------------ the loop
    def train(self) -> int:
        """Run to max_steps. Returns the process exit code: 0, PREEMPTED_EXIT_CODE after a stop request, or
        CANNOT_LEARN_EXIT_CODE when a health.stop_on condition held."""
        with GracefulStop(self.request_stop, self.ctx.is_main, lambda: self.step + 1).installed():
            return self._train_loop()

    def _train_loop(self) -> int:
        cfg = self.cfg
        exit_code = 0
        # a resumed run that is finished already trains nothing (the loop below never runs) and says so; a dry run
        # prints the table of the run as configured
        if not self.nothing_to_do() and self.ctx.is_main and not cfg.dry_run:
            from grpo_dist.run_table import run_table
            self.logger.write("\n".join(run_table(cfg, self.ctx.world_size, self.ref_model is not None)))
        try:
            self.source.start(self.step)  # rollout ranks: the first max_staleness + 1 batches go out
            while self.step < cfg.max_steps:
                metrics = self.train_step()
                self._evaluate_if_due(metrics)
                health = self._check_health(metrics)
                metrics.update(self.checkpointer.save_times(wait=False))
                watchdog.set_phase("stop-vote")
                self.logger.log(metrics)  # a failed append (full disk) is kept in logger.failed: stop together
                failed = self.logger.failed or self.completion_log.failed
                votes = gdist.all_reduce_sum_named({"stop": float(self._stop_requested),
                                                    "log_failed": float(failed is not None)},
                                                   self.ctx.device)  # every rank agrees to stop
                if float(votes["log_failed"]):
                    last = self.checkpointer.latest()  # after the save in flight, which may be the last one
                    raise MetricsWriteError(f"{failed or 'rank 0 could not append to its logs'}; "
                                            f"the last checkpoint is {last or 'none'}: free space and rerun with "
                                            f"resume_from_checkpoint=auto")
                stop = bool(float(votes["stop"]))
                self.checkpointer.after_step(metrics, stop, bool(health.stop), self.logger.write)
                exit_code = self._stop_code(stop, health.stop)
                if exit_code:
                    break
            self.checkpointer.save_times(wait=True)  # the save in flight in place (or its error raised) before exit
            self.source.finish()  # not after an error: the peers may be gone
        except BaseException as e:
            self.source.abort(e)  # rollout ranks: they stop now, naming this failure
            self.checkpointer.finish_after(e)
            raise
        finally:
            self.logger.close()
            self.completion_log.close()
            self.rewards.close()
            self.close()
        return exit_code

    def nothing_to_do(self) -> bool:
        """A resumed run whose checkpoint is at max_steps already: say so in one line (rank 0), train nothing."""
        resumed_from = self.checkpointer.resumed_from
        if resumed_from is None or self.step < self.cfg.max_steps:
            return False
        self.was_finished = True
        if self.ctx.is_main:
            print(f"[grpo_dist] nothing to do: {resumed_from} is at step {self.step} and max_steps is "
                  f"{self.cfg.max_steps}, so the run is finished; raise max_steps to train further", flush=True)
        return True

    def _evaluate_if_due(self, metrics: dict) -> None:
        from grpo_dist.evaluation import due_tiers
        for tier in due_tiers(self.cfg, self.step):  # light (eval_steps), then full (full_eval_steps)
            watchdog.set_phase("eval")
            metrics.update(self.evaluate() if tier.name == "light" else self.evaluate(tier))

    def _check_health(self, metrics: dict):
        """The health monitor on this step's all-reduced metrics (the same verdict on every rank): its flags go
        into the metrics, its start/end lines to the console."""
        health = self.health.update(metrics, self.step, self.last_step.skip_note if self.last_step else None)
        metrics.update(health.flags)
        for line in health.lines:
            self.logger.write(line)
        return health

    def _checkpoint_note(self) -> str:
        return self.checkpointer.note()

    def _stop_code(self, stop: bool, cannot_learn: str | None) -> int:
        """The exit code that ends the loop after this step (0: go on), with its one line. A requested stop wins."""
        cfg = self.cfg
        if stop:
            if self.ctx.is_main:
                print(f"[grpo_dist] stop requested: checkpoint written at step {self.step}, exiting with "
                      f"code {PREEMPTED_EXIT_CODE}", flush=True)
            return PREEMPTED_EXIT_CODE
        if cannot_learn:
            if self.ctx.is_main:
                saved = f"checkpoint written at step {self.step}" if cfg.save_steps or cfg.save_final \
                    else "no checkpoint (saving is off)"
                print(f"[grpo_dist] health: stopping on {cannot_learn} (health.stop_on): {saved}, exiting with "
                      f"code {CANNOT_LEARN_EXIT_CODE}", flush=True)
            return CANNOT_LEARN_EXIT_CODE
        return 0

    def close(self) -> None:
        """Release the rollout engine (vLLM must shut down before the process group is destroyed)."""
        self.source.close()
        self.environment.close()

    # ------------------------------------------------------------------------------------------------ the step
    def _batch_source(self):
        """Where the graded batches come from (batch_source.py): this rank's own rollout engine, or the rollout
        ranks (rollout_ranks > 0)."""
        cfg, ctx = self.cfg, self.ctx
        if not cfg.rollout_ranks:
            return ColocatedSource(cfg, ctx, self.sampler, self.curriculum, self.rollout_engine, self.tokenizer,
                                   self.rewards, self._eos_ids(), self.engine.iter_full_weights, self.environment)
        # LoRA: the adapters only, merged on the rollout ranks (async_rollout.AdapterMerge)
        push = (lambda dtype: self.engine.iter_adapter_weights()) if cfg.lora.r else self.engine.iter_full_weights
        rollouts = AsyncRollouts(cfg, ctx, self.sampler, push, self.request_stop)
        return RolloutRankSource(cfg, ctx, rollouts, self.rewards.names, self.tokenizer.pad_token_id,
                                 self.engine.iter_full_weights,
                                 lambda: replica_engine(cfg, ctx, self.tokenizer)[0])

    def _eos_ids(self) -> tuple[int, ...]:
        return tuple(eos_token_ids(self.hf_model, self.tokenizer))

    def train_step(self) -> dict:
        """One step, the stages of the module docstring in order: the next graded batch from the batch source
        (rollout and grade, rounds of them with dynamic sampling), learn (advantage to update, and the step's
        metrics), then the reward, source and timing metrics."""
        timer, t0 = Timer(), time.perf_counter()
        watchdog.set_phase("rollout", self.step + 1)
        graded = self.source.next_batch(self.step, timer)
        # the rollout engine's memory goes to the update (vLLM sleep mode); the next weight sync takes it back
        self.source.release()
        state = self._state(graded)
        metrics = self._learn(state, timer)
        self._log_completions(state)
        if self.on_graded is not None:
            self.on_graded(graded.batch, graded.rewards)
        metrics.update(reward_means(graded.per_function, self.ctx.device))
        metrics.update(graded.reward_errors)
        metrics.update(graded.sampling)
        metrics.update(environment_metrics(self.environment, self.ctx.device))  # tools/*: multi-turn only
        if self.curriculum is not None:
            metrics.update(self.curriculum.metrics(self.sampler.last_batch_number))
            if graded.global_group_sizes is not None:  # the last round's plan, the same on every rank
                metrics.update({"curriculum/group_size_min": min(graded.global_group_sizes),
                                "curriculum/group_size_max": max(graded.global_group_sizes)})
        metrics.update(self.source.after_step(self.step, time.perf_counter() - t0))  # async: the next prompts out
        metrics.update(timing_metrics(timer.times, t0, state.completion_tokens, graded.weight_sync_s))
        metrics.update(flops_metrics(self.cfg, self._flops_shape, self._peak_flops, metrics, timer.times,
                                     state.attention_pairs))
        return metrics

    def _state(self, graded: StepBatch) -> StepState:
        """The step's state from its graded batch; accuracy = the first reward function (the verifier) gave full
        marks."""
        first = next(iter(graded.per_function.values()), graded.rewards)
        state = StepState(graded, torch.tensor(graded.rewards, dtype=torch.float32),
                          torch.tensor(first, dtype=torch.float32) >= 1.0)
        state.votes.peaks = nonfinite.reward_peaks(graded.per_function, self.rewards.names, self.rewards.weights)
        return state

    def learn(self, batch: RolloutBatch, rewards: torch.Tensor, timer: Timer | None = None) -> dict:
        """The stages after grading on one rollout batch (this rank's rows), for tests that inject fixed rollouts:
        advantage, select rows, log-probs, update, metrics."""
        graded = StepBatch(batch, rewards.tolist(), {})
        return self._learn(StepState(graded, rewards.to(torch.float32), rewards >= 1.0), timer or Timer())

    def _learn(self, state: StepState, timer: Timer) -> dict:
        """The learner's stages (learner.py), the non-finite guard's count, and the step's metrics."""
        watchdog.set_phase("advantage", self.step + 1)
        self.learner.learn(state, self.step, timer)
        if state.counted:
            state.skip_note = self._track_nonfinite(state.applied == self.cfg.num_iterations,
                                                    state.votes.cause or "loss", state.votes.peaks)
        self.step += 1
        self.last_step = state
        watchdog.set_phase("metrics", self.step)
        metrics = step_metrics(self.cfg, self.ctx, state, self._eos_ids(), self.step, self.engine.current_lr(),
                               self.nonfinite_steps, self.sampler.epoch)
        metrics.update(sampler_metrics(self.cfg, self.ctx, state, self.behaviour_ratio))
        if self.sft is not None and state.sft is not None:
            metrics.update(self.sft.metrics(state.sft))
        return metrics

    def _track_nonfinite(self, all_applied: bool, cause: str = "loss",
                         peaks: list[float] | None = None) -> tuple[str, str] | None:
        """Count a skipped step; stop after max_consecutive_nonfinite in a row, naming the cause of the last.
        Returns the (what, advice) note of a skipped step for the health line."""
        if all_applied:
            self.consecutive_nonfinite = 0
            return None
        self.consecutive_nonfinite += 1
        self.nonfinite_steps += 1
        what = nonfinite.describe(cause, self.rewards.names, peaks or [], self.cfg.scale_rewards)
        advice = nonfinite.advice(cause, nonfinite.precision_advice(self.cfg))
        if self.consecutive_nonfinite >= self.cfg.max_consecutive_nonfinite:
            raise NonFiniteError(f"{cause}: {self.consecutive_nonfinite} consecutive steps had {what} (the last: "
                                 f"step {self.step + 1}); stopping. {self._checkpoint_note()}. {advice}")
        return what, advice

    def rollout(self, examples):
        """Sample and grade `examples`, the data sampler's last batch, on the policy's current weights (tests)."""
        self.source.sync_weights()
        return self.source.rollout(examples).batch

    def sampling_spec(self, greedy: bool = False, n: int | None = None) -> SamplingSpec:
        return sampling_spec(self.cfg, self._eos_ids(), greedy=greedy, n=n)

    def sync_rollout_weights(self) -> None:
        """The policy's current weights into the rollout engine. Collective: every rank runs it."""
        self.source.sync_weights()

    def _log_completions(self, state: StepState) -> None:
        """Rank 0's first log_completions rows to completions.jsonl (no collective: only rank 0 writes). The prompt
        is decoded from the batch: the text the model was given (after any truncation), whichever round of dynamic
        sampling the row came from."""
        if not self.completion_log.enabled or state.advantages is None:
            return
        batch, g = state.batch, state.graded
        n = min(self.cfg.log_completions, len(batch))
        prompts = [self.tokenizer.decode(batch.prompt_ids[i][batch.prompt_mask[i].bool()]) for i in range(n)]
        self.completion_log.write(self.step, prompts, batch.completions, batch.references, g.rewards,
                                  g.per_function, state.advantages.tolist(), batch.completion_lengths.tolist())

    # ------------------------------------------------------------------------------------------ evaluation, save
    def evaluate(self, tier=None) -> dict:
        """One evaluation tier (evaluation.eval_tiers; the light one by default): greedy accuracy (and pass@k when
        configured) on its problems, split across ranks. Collective."""
        from grpo_dist.evaluation import eval_tiers, run_tier
        tier = tier or eval_tiers(self.cfg)[0]
        self.sync_rollout_weights()
        sample: list = []  # rank 0's first evaluation completion, shown on the console
        t0 = time.perf_counter()
        out = run_tier(self.source.engine, self.tokenizer, self.eval_examples, self.cfg, self.ctx, self.rewards,
                       tier, self.step, say=self.logger.write, sample_out=sample if self.ctx.is_main else None)
        self.source.release()  # as after a rollout: the memory is training's until the next sync
        if sample:
            self.logger.write(format_sample(self.step, *sample[0]))
        what = "full eval" if tier.name == "full" else "eval"
        acc = f"{tier.prefix}accuracy"
        self.logger.write(f"[grpo_dist] {what} at step {self.step}: {acc} {out[acc]:.4f} on "
                          f"{out[tier.prefix + 'num_examples']} problems in {time.perf_counter() - t0:.1f} s")
        return out

    def save(self, background: bool = False, **where) -> Path:
        """checkpoint-<step> now (Checkpointer.save). Collective."""
        return self.checkpointer.save(background, **where)
