"""The GRPO trainer: one step (train_step, then learn), on every rank, is

    prompts (this rank's shard)
      -> rollout        G completions per prompt from the rollout engine, on the current policy's weights
      -> grade          the reward functions score each completion (_rollout_and_grade)
      (dynamic sampling: rollout + grade again until enough groups have rewards that differ; _dynamic_sample)
      -> advantage      rewards less beta * KL (kl_in_reward), z-scored inside each group (groups never cross ranks)
      -> select rows    the rows that train, the step's loss normaliser, micro-batches of similar length
                        (max_tokens_per_micro_batch: rows balanced between ranks by tokens, then bin-packed by
                        token count; micro_batches.py)
      -> log-probs      reference (KL in the loss) and old (num_iterations > 1) in no-grad passes, on packed rows
                        where the model allows (padding_free; packing.py)
      -> update         token-masked clipped ratio + beta * KL, micro-batched, one optimizer step per iteration
      -> metrics        all-reduced over ranks by name (_step_metrics, _sampler_metrics, _reward_means)

Collectives happen only in the engine (FSDP forwards/backwards, clipping, checkpoints) and in a few all-reduces
here; every rank runs the same number of forward/backward passes (micro-batch counts are agreed first, short ranks
run empty micro-batches), so no path can deadlock.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo_dist import checkpoint as ckpt
from grpo_dist import distributed as gdist
from grpo_dist import faults
from grpo_dist import flops
from grpo_dist import micro_batches as mbatch
from grpo_dist import nonfinite
from grpo_dist import watchdog
from grpo_dist.advantages import dynamic_sampling_quota, group_advantages, zero_advantage_groups
from grpo_dist.build import build_models, build_rollouts, check_prompt_lengths, load_split
from grpo_dist.checkpointer import Checkpointer, Counters, RunInfo, Scheduler
from grpo_dist.checkpointer import resolve as resolve_resume
from grpo_dist.completions import CompletionLog, format_sample
from grpo_dist.config import ConfigError, GRPOConfig
from grpo_dist.curriculum import Curriculum, allocate_group_sizes, record_graded
from grpo_dist.data import (DataError, PromptSampler, render_prompt)
from grpo_dist.health import CANNOT_LEARN_EXIT_CODE, HealthMonitor
from grpo_dist.interrupts import PREEMPTED_EXIT_CODE, GracefulStop
from grpo_dist.losses import LossSpec, grpo_loss, k3_kl, kl_estimate, truncated_is_weights, uses_sequence_normaliser
from grpo_dist.metrics import MetricsLogger, MetricsWriteError
from grpo_dist.packing import PassTokens, completion_log_probs, pack_rows
from grpo_dist.prompt_sharing import group_order, prompt_groups
from grpo_dist.models import load_tokenizer, reward_dtype
from grpo_dist.rewards import RewardComputer
from grpo_dist.rewards.batch import argument_problems, rollout_context
from grpo_dist.rollout import RolloutBatch, concat_rollouts, cut_off, eos_token_ids
from grpo_dist.rollout_engines import SamplingSpec, generate_batch, require_vllm, rollout_dtype
from grpo_dist.sampling_noise import row_seed, row_seeds
from grpo_dist.sft import SFTBatch, SFTMixer, load_sft_examples
from grpo_dist.trained_prompts import record as record_prompts

PASSES = ("reference", "old", "train")  # the passes whose tokens are counted (the old pass: the policy, no grad)
EMPTY_PASS_TOKENS = 2  # the forward an empty micro-batch runs to keep the collectives in step
NONFINITE_EXIT_CODE = 3  # too many non-finite steps in a row: rerunning the same way would fail the same way


class NonFiniteError(RuntimeError):
    """Too many consecutive steps were not finite (reward, advantage, loss or gradient), or an update made the
    parameters non-finite or blew them up (grpo_dist/nonfinite.py)."""


class RewardFunctionError(RuntimeError):
    """A reward function failed on every completion of a step."""


def _detached(x):
    """A metric term as a device value without gradient (losses.py may give tensors or plain numbers)."""
    return x.detach() if isinstance(x, torch.Tensor) else x


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
        self.loss_spec = self._loss_spec()
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
        self._decode_tokens = [0, 0]  # this step's decode row-steps computed, tokens generated (all rollout rounds)
        self._prompts_cut = 0  # this step's prompts longer than max_prompt_length (all rollout rounds)
        self.weight_sync_s = 0.0
        resuming = bool(cfg.resume_from_checkpoint)  # then the lines of steps after self.step are redone
        self.logger = MetricsLogger(cfg.output_dir, ctx.is_main, cfg.report_to, cfg.to_dict(), cfg.max_steps,
                                    cfg.progress_bar, cfg.logging_steps, start_step=self.step, resuming=resuming)
        self.completion_log = CompletionLog(cfg.output_dir, cfg.log_completions, ctx.is_main, start_step=self.step,
                                            resuming=resuming)
        self.last_advantages: torch.Tensor | None = None  # this rank's advantages of the last learn() call
        self._last_reward_errors: dict = {}  # reward_errors/<name> of the current step (all ranks)
        self.health = HealthMonitor(cfg.health, cfg.max_completion_length, cfg.beta,  # on all-reduced metrics only
                                    completions_per_step=cfg.prompts_per_rank * ctx.world_size * cfg.num_generations,
                                    grad_norm_per_signal=not cfg.skip_zero_advantage_groups)
        self.on_graded = None  # optional callback(batch, rewards) after each step's grading (grpo_dist/dry_run.py)
        self._reward_peaks: list[float] = []  # max |weight x score| per function, for the non-finite guard
        self._skip_note: tuple[str, str] | None = None  # (what, advice) of this step's skip, for the health line
        self._step_flags: dict = {}  # this rank's non-finite rewards / advantages of the current step
        # group size by difficulty (curriculum.num_generations_min/_max): this round's group sizes, the global
        # batch's and this rank's slice of them; None: every group has num_generations completions
        self._global_group_sizes: list[int] | None = None
        self._group_sizes: list[int] | None = None
        self._tokens: dict[str, PassTokens] = {name: PassTokens() for name in PASSES}  # of the current step
        self._layouts: dict = {}  # (batch, rows) -> (micro-batch, packed layout) of the current step (_layout)
        # rollout_ranks > 0: the rollouts come from rollout ranks (async_rollout.py); with max_staleness > 0 the
        # objective is decoupled PPO: clipped around the proximal policy (this step's weights, a no-grad pass),
        # weighted by proximal / behaviour (the sampler's log-probs), truncated at sampler_correction_cap
        self.async_rollouts = None
        if cfg.rollout_ranks:
            from grpo_dist.async_rollout import AsyncRollouts
            self.async_rollouts = AsyncRollouts(cfg, ctx)
        self.behaviour_ratio = bool(cfg.rollout_ranks and cfg.max_staleness)

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
            if self.async_rollouts is not None:  # the first max_staleness + 1 batches go out
                self.async_rollouts.start(self)
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
            if self.async_rollouts is not None:  # not after an error: the peers may be gone
                self.async_rollouts.close()
        except BaseException as e:
            if self.async_rollouts is not None:  # the rollout ranks stop now, naming this failure (best effort)
                self.async_rollouts.abort(e)
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
        health = self.health.update(metrics, self.step, self._skip_note)
        self._skip_note = None
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
        self.rollout_engine.close()

    def train_step(self) -> dict:
        """One step, the stages of the module docstring in order: rollout and grade (rounds of them with dynamic
        sampling), learn (advantage to update, and the step's metrics), then the reward and timing metrics."""
        timer, t0 = Timer(), time.perf_counter()
        watchdog.set_phase("rollout", self.step + 1)
        self._decode_tokens = [0, 0]
        self._prompts_cut = 0
        if self.cfg.dynamic_sampling:
            batch, rewards, per_function, sampling = self._dynamic_sample(timer)
        else:
            (batch, rewards, per_function), sampling = self._rollout_and_grade(timer), {}
        # accuracy = the first reward function (the verifier) gave full marks
        first = next(iter(per_function.values()), rewards)
        self._reward_peaks = nonfinite.reward_peaks(per_function, self.rewards.names, self.rewards.weights)
        # the rollout engine's memory goes to the update (vLLM sleep mode); the next weight sync takes it back
        self.rollout_engine.release()
        metrics = self.learn(batch, torch.tensor(rewards, dtype=torch.float32), timer,
                             correct=torch.tensor(first, dtype=torch.float32) >= 1.0)
        self._reward_peaks = []
        self._log_completions(batch, rewards, per_function)
        if self.on_graded is not None:
            self.on_graded(batch, rewards)
        metrics.update(self._reward_means(per_function))
        metrics.update(self._last_reward_errors)
        metrics.update(sampling)
        if self.curriculum is not None:
            metrics.update(self.curriculum.metrics(self.sampler.last_batch_number))
            if self._global_group_sizes is not None:  # the last round's plan, the same on every rank
                metrics.update({"curriculum/group_size_min": min(self._global_group_sizes),
                                "curriculum/group_size_max": max(self._global_group_sizes)})
        if self.async_rollouts is not None:  # weights of the new version out, the next batch's prompts
            self.async_rollouts.after_step(self)
            metrics.update(self.async_rollouts.metrics(time.perf_counter() - t0))
        metrics.update(self._timing_metrics(timer, t0, metrics.pop("_completion_tokens")))
        metrics.update(self._flops_metrics(metrics, timer, metrics.pop("_attention_pairs")))
        return metrics

    # ----------------------------------------------------------------------- rollout, grade (dynamic sampling)
    def _rollout_and_grade(self, timer: Timer, refresh: bool = True):
        """(batch, total rewards, {function: rewards}) of one round of prompts_per_rank prompts."""
        if self.async_rollouts is not None:  # sampled and graded on a rollout rank
            with timer("rollout"):
                batch, rewards, per_function, self.rewards.last_errors, decode = self.async_rollouts.receive(self)
            self._decode_tokens = list(decode)
            self._prompts_cut += batch.prompts_truncated
            self._last_reward_errors = self._reward_errors(len(rewards))
            return batch, rewards, per_function
        with timer("rollout"):
            examples = self.sampler.next_batch()
            record_prompts(self.step + 1, self.ctx.rank, self.sampler)  # GRPO_DIST_TRAINED_PROMPTS (tests)
            self._plan_group_sizes()
            batch = self.rollout(examples, refresh)
        with timer("reward"):
            row_examples = examples if self._group_sizes is None else \
                [e for e, g in zip(examples, self._group_sizes) for _ in range(g)]
            rewards, per_function = self.rewards(batch.completions, batch.references,
                                                 batch.completion_lengths.tolist(), self.cfg.max_completion_length,
                                                 **rollout_context(row_examples, batch))
        # before the update: a broken function stops the run (every rank runs the same rounds: same collectives)
        errors = self._reward_errors(len(rewards))
        if self.curriculum is not None and self.cfg.curriculum.mode == "online":  # each prompt's pass statistics
            record_graded(self.curriculum, self.sampler, next(iter(per_function.values()), rewards),
                          self._global_group_sizes or self.cfg.num_generations, self.ctx.device)
        self._last_reward_errors = {k: self._last_reward_errors.get(k, 0) + v for k, v in errors.items()} \
            if refresh is False else errors
        return batch, rewards, per_function

    def _reward_errors(self, n_local: int) -> dict:
        """reward_errors/<name>: completions of this step (all ranks) each function failed on. Stops the run when a
        function failed on all of them (reward_fail_on_all_errors): that is a broken function, not a bad model."""
        names = self.rewards.names
        s = gdist.all_reduce_sum_named({**{f"errors/{k}": self.rewards.last_errors.get(k, 0) for k in names},
                                        "completions": n_local}, self.ctx.device)
        total = int(s["completions"])
        counts = {name: int(s[f"errors/{name}"]) for name in names}
        for name, count in counts.items():
            if self.cfg.reward_fail_on_all_errors and total and count == total:
                raise RewardFunctionError(
                    f"reward function '{name}' failed on all {total} completions of step {self.step + 1} (the first "
                    f"failure is printed above); fix it, or set reward_fail_on_all_errors=false to train on")
        return {f"reward_errors/{name}": count for name, count in counts.items()}

    def _dynamic_sample(self, timer: Timer):
        """DAPO dynamic sampling: rounds of prompts_per_rank prompts per rank, keeping only groups whose rewards
        differ, until all ranks together hold prompts_per_rank x world_size of them or dynamic_sampling_max_rounds
        rounds ran. Every rank runs the same rounds (the stop test is on all-reduced counts); the surplus of the
        last round is trimmed evenly (advantages.dynamic_sampling_quota). A rank may end with fewer groups than
        the others, even none."""
        cfg, G, dev = self.cfg, self.cfg.num_generations, self.ctx.device
        target = cfg.prompts_per_rank * self.ctx.world_size
        kept, rounds = [], 0
        while True:
            batch, rewards, per_fn = self._rollout_and_grade(timer, refresh=rounds == 0)  # weights are unchanged
            rounds += 1
            flat = zero_advantage_groups(torch.tensor(rewards, dtype=torch.float32), G)
            kept += [(batch, rewards, per_fn, g) for g in range(len(flat)) if not flat[g]]
            total = int(gdist.all_reduce_sum([len(kept)], dev)[0])
            if total >= target or rounds >= cfg.dynamic_sampling_max_rounds:
                break
        sampling = {"dynamic_sampling_rounds": rounds, "dynamic_sampling_prompts": rounds * target,
                    "dynamic_sampling_groups": min(total, target)}
        if total == 0:  # every group of every rank was flat: the last round, as without dynamic sampling
            return batch, rewards, per_fn, sampling
        counts = gdist.all_reduce_sum([len(kept) if r == self.ctx.rank else 0 for r in range(self.ctx.world_size)],
                                      dev)
        kept = kept[:dynamic_sampling_quota([int(c) for c in counts], target)[self.ctx.rank]]
        rows = [(b, g * G + j) for b, _, _, g in kept for j in range(G)]
        batch = concat_rollouts([b.rows([i]) for b, i in rows], self.tokenizer.pad_token_id) if rows else \
            batch.rows([])
        rewards = [r[g * G + j] for _, r, _, g in kept for j in range(G)]
        per_function = {name: [f[name][g * G + j] for _, _, f, g in kept for j in range(G)] for name in per_fn}
        return batch, rewards, per_function, sampling

    def _plan_group_sizes(self) -> None:
        """Group size by difficulty: the sizes of the global batch the sampler just drew, from the all-reduced
        statistics (the same on every rank), and this rank's slice of them."""
        c = self.cfg.curriculum
        if self.curriculum is None or c.num_generations_min is None or c.num_generations_max is None:
            return
        idx = self.sampler.last_global_indices
        self._global_group_sizes = allocate_group_sizes(
            self.curriculum.correct[idx], self.curriculum.completions[idx], len(idx) * self.cfg.num_generations,
            c.num_generations_min, c.num_generations_max)
        start = self.ctx.rank * self.cfg.prompts_per_rank
        self._group_sizes = self._global_group_sizes[start:start + self.cfg.prompts_per_rank]

    def rollout(self, examples, refresh: bool = True) -> RolloutBatch:
        """G completions of each of `examples`, the data sampler's last batch (its place keys the sampling noise);
        with group size by difficulty, each prompt's planned number of them (its prompt repeated, one each)."""
        cfg = self.cfg
        if refresh:
            self.sync_rollout_weights()
        prompts = [render_prompt(e, cfg.data, self.tokenizer) for e in examples]
        answers = [e.answer for e in examples]
        n = None
        if self._group_sizes is not None:
            prompts = [p for p, g in zip(prompts, self._group_sizes) for _ in range(g)]
            answers = [a for a, g in zip(answers, self._group_sizes) for _ in range(g)]
            n = 1
        batch = generate_batch(self.rollout_engine, self.tokenizer, prompts, answers,
                               self.sampling_spec(n=n, row_seeds=self._row_seeds(len(examples))),
                               cfg.data.max_prompt_length, self.ctx.device)
        self._prompts_cut += batch.prompts_truncated
        if batch.decode_row_steps is not None:
            self._decode_tokens[0] += batch.decode_row_steps
            self._decode_tokens[1] += int(batch.completion_mask.sum())
        return batch

    def _row_seeds(self, num_prompts: int) -> tuple[int, ...] | None:
        """sampling_noise=per_prompt: each row's noise from (seed, global batch number, place of its prompt in the
        global batch, completion index), so that no rank, batch or chunk changes what a prompt draws."""
        if self.cfg.sampling_noise != "per_prompt" or self.cfg.rollout_engine == "vllm":  # vLLM: its own sampler
            return None
        where = self.sampler.last_prompt_indices
        if len(where) != num_prompts:
            raise ValueError(f"rollout of {num_prompts} prompts, but the data sampler's last batch had {len(where)}")
        if self._group_sizes is not None:  # completion j of a prompt draws the same noise whatever its group size
            return tuple(row_seed(self.cfg.seed, self.sampler.last_batch_number, p, j)
                         for p, g in zip(where, self._group_sizes) for j in range(g))
        return tuple(row_seeds(self.cfg.seed, self.sampler.last_batch_number, where, self.cfg.num_generations))

    def sampling_spec(self, greedy: bool = False, n: int | None = None,
                      row_seeds: tuple[int, ...] | None = None) -> SamplingSpec:
        cfg = self.cfg
        return SamplingSpec(n=n or cfg.num_generations, max_tokens=cfg.max_completion_length,
                            eos_ids=tuple(eos_token_ids(self.hf_model, self.tokenizer)),
                            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, greedy=greedy,
                            row_seeds=row_seeds)

    def sync_rollout_weights(self) -> None:
        """The policy's current weights into the rollout engine, streamed one FSDP unit at a time in the compute
        dtype. Collective: every rank runs it."""
        t0 = time.perf_counter()
        weights = self.engine.iter_full_weights(rollout_dtype(self.cfg))
        self.rollout_engine.sync_weights(weights)
        if next(weights, None) is not None:  # every rank must run every unit's all-gather, and nothing is stale
            raise RuntimeError(f"the {self.rollout_engine.name} rollout engine did not take every weight")
        self.weight_sync_s = time.perf_counter() - t0

    # ------------------------------------------------------------------- advantage, select rows, log-probs, update
    def learn(self, batch: RolloutBatch, rewards: torch.Tensor, timer: Timer | None = None,
              correct: torch.Tensor | None = None) -> dict:
        """The stages after grading, on one rollout batch (this rank's rows): advantage, select rows, log-probs,
        update, metrics. Also the entry point for tests that inject fixed rollouts. correct: the rows the verifier
        gave full marks (default: reward >= 1)."""
        timer = timer or Timer()
        watchdog.set_phase("advantage", self.step + 1)
        self._tokens = {name: PassTokens() for name in PASSES}  # tokens/processed_<pass>, tokens/useful_<pass>
        self._layouts = {}  # (batch, rows) -> (micro-batch, packed layout), built once per step (_layout)
        batch = batch.to(self.ctx.device)
        with timer("logprobs"):
            shaped, seq_kl = self._kl_shaped_rewards(batch, rewards)
        watchdog.set_phase("advantage")
        advantages, flat_groups = self._advantages(shaped)
        self._step_flags = nonfinite.local_flags(rewards, advantages)
        rows = self._select_rows(batch, flat_groups)
        # the kl metric is a mean over the trained tokens: its numerator sums the KL of the trained rows only
        reward_kl = float(seq_kl[rows].sum()) if seq_kl is not None and rows else 0.0
        normaliser = self._step_normaliser(batch, rows)
        train, train_advantages, micro = self._plan_micro_batches(batch, rows, advantages)
        with timer("logprobs"):
            ref_logps, old_logps = self._reference_and_old_logps(train, micro)
        sft = self.sft.next_batch() if self.sft is not None else None  # SFT + RL: this step's solutions
        with timer("update"):
            sums, grad_norms = self._update(train, micro, train_advantages, normaliser, ref_logps, old_logps,
                                            reward_kl, sft)
        self.step += 1
        watchdog.set_phase("metrics", self.step)
        correct = rewards >= 1.0 if correct is None else correct
        metrics = self._step_metrics(batch, rewards, correct, flat_groups, rows, sums, grad_norms)
        metrics.update(self._sampler_metrics(sums, batch, rows))
        if self.sft is not None and sft is not None:
            metrics.update(self.sft.metrics(sft))
        return metrics

    # advantage
    def _kl_shaped_rewards(self, batch: RolloutBatch,
                           rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kl_in_reward: reward - beta * sum over the completion's tokens of the KL estimate between the policy
        before this update and the reference (no gradient). Returns (rewards, each row's summed KL, for the
        metric). Identity (and None) otherwise. Every rank runs the same number of scoring passes."""
        cfg = self.cfg
        if not (cfg.kl_in_reward and self.ref_model is not None):
            return rewards, None
        dev = self.ctx.device
        micro = self._micro_batches(batch, list(range(len(batch))))
        ref = self._score(self.ref_model, batch, micro, self._tokens["reference"])
        pol = self._score(self.engine.module, batch, micro, self._tokens["old"])  # the policy before the update
        seq_kl = torch.zeros(len(batch), dtype=torch.float32, device=dev)
        for idx, r, p in zip(micro, ref, pol):
            if idx:
                mask = batch.completion_mask[idx][:, :p.shape[1]].to(p.dtype)
                seq_kl[idx] = (kl_estimate(p, r, cfg.kl_estimator) * mask).sum(-1)
        shaped = rewards - cfg.beta * seq_kl.to(rewards.device)
        return shaped, seq_kl

    def _advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages of this rank's rows, which groups are flat: all rewards equal). Groups are rank-local; with
        scale_rewards=batch the std is over every rank's rewards."""
        G, scale = self._group_sizes or self.cfg.num_generations, self.cfg.scale_rewards
        batch_std = self._batch_reward_std(rewards) if scale == "batch" else None
        advantages = group_advantages(rewards, G, scale, batch_std).to(self.ctx.device)
        self.last_advantages = advantages.detach().cpu()
        return advantages, zero_advantage_groups(rewards, G)

    def _batch_reward_std(self, rewards: torch.Tensor) -> float:
        """The sample std of the rewards of all ranks (one all-reduce)."""
        s = gdist.all_reduce_sum_named({"sum": rewards.sum(), "sum_sq": (rewards.double() ** 2).sum(),
                                        "n": len(rewards)}, self.ctx.device)
        mean = s["sum"] / s["n"]
        return float(torch.sqrt((s["sum_sq"] - s["n"] * mean ** 2).clamp(min=0) / (s["n"] - 1).clamp(min=1)))

    # select rows
    def _select_rows(self, batch: RolloutBatch, flat_groups: torch.Tensor) -> list[int]:
        """The rows that train: all, less flat groups (skip_zero_advantage_groups) and cut-off completions
        (mask_truncated_completions: out of the loss and its normaliser; their group statistics stand)."""
        cfg, G = self.cfg, self.cfg.num_generations
        rows = list(range(len(batch)))
        group_of = [i // G for i in rows] if self._group_sizes is None else \
            [g for g, size in enumerate(self._group_sizes) for _ in range(size)]
        if cfg.skip_zero_advantage_groups:
            rows = [i for i in rows if not flat_groups[group_of[i]]]
        if cfg.mask_truncated_completions:
            truncated = cut_off(batch, eos_token_ids(self.hf_model, self.tokenizer))
            rows = [i for i in rows if not truncated[i]]
        return rows

    def _step_normaliser(self, batch: RolloutBatch, rows: list[int]) -> float:
        """The loss's divisor for the whole optimizer step, over all micro-batches and ranks (one all-reduce): the
        trained sequences or tokens, as loss_type says. 0 when no rank trains a row."""
        lengths = batch.completion_lengths
        local = float(len(rows)) if uses_sequence_normaliser(self.cfg.loss_type) else float(lengths[rows].sum())
        return float(gdist.all_reduce_sum([local], self.ctx.device)[0])

    def _plan_micro_batches(self, batch: RolloutBatch, rows: list[int],
                            advantages: torch.Tensor) -> tuple[RolloutBatch, torch.Tensor, list[list[int]]]:
        """(batch, advantages, micro-batches) of the log-prob and update passes. With max_tokens_per_micro_batch on
        several ranks, the training rows are first balanced between ranks by tokens (collective; the update does not
        depend on where a row trains: micro_batches.py), and the batch returned holds this rank's new rows."""
        if self.cfg.max_tokens_per_micro_batch is not None and self.ctx.world_size > 1:
            batch, advantages = mbatch.balance_ranks(batch, rows, advantages, self.tokenizer.pad_token_id,
                                                     self.ctx.rank, self.ctx.world_size, self.ctx.device,
                                                     self.share_prompts)
            rows = list(range(len(batch)))
        return batch, advantages, self._micro_batches(batch, rows)

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """rows in micro-batches (micro_batch_size slices of the length order, or bin-packed by token count under
        max_tokens_per_micro_batch), then empty ones up to the count of the rank with the most (one all-reduce):
        every rank runs the same number of passes."""
        cfg = self.cfg
        lengths = mbatch.row_lengths(batch, rows)
        if cfg.max_tokens_per_micro_batch is None:
            size = cfg.micro_batch_size
            if self.share_prompts:  # a prompt's rows together, so that they share it
                order = group_order(batch.prompt_ids, batch.prompt_mask, rows, lengths)
            else:
                order = sorted(rows, key=lambda i: sum(lengths[i]))  # similar lengths together: less padding
            micro = [order[i:i + size] for i in range(0, len(order), size)]
            n_micro = int(gdist.all_reduce_max([len(micro)], self.ctx.device)[0])
        else:
            # share_prompts: a prompt's rows as one item, its prompt counted once
            groups = prompt_groups(batch.prompt_ids, batch.prompt_mask, rows) if self.share_prompts else None

            def plan(at_least):
                return mbatch.plan_token_budget(lengths, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size,
                                                self.padding_free, at_least, groups)
            micro = plan(1)
            n_micro = int(gdist.all_reduce_max([len(micro)], self.ctx.device)[0])
            if len(micro) < n_micro:  # the passes run anyway: smaller micro-batches rather than empty ones
                smaller = plan(n_micro)
                micro = smaller if len(smaller) <= n_micro else micro
        return micro + [[] for _ in range(n_micro - len(micro))]

    # log-probs
    def _reference_and_old_logps(self, batch: RolloutBatch, micro: list[list[int]]) -> tuple[list, list]:
        """Per micro-batch, the no-grad log-probs of the reference (KL in the loss) and of the policy before the
        update (num_iterations > 1); None where not run (with one iteration the training pass's own detached
        log-probs are the old ones)."""
        unused = [None] * len(micro)
        ref = self._score(self.ref_model, batch, micro, self._tokens["reference"]) if self._kl_in_loss() else unused
        # the policy before the update: "old" for PPO epochs, the proximal policy of decoupled PPO (stale rollouts)
        wanted = self.cfg.num_iterations > 1 or self.behaviour_ratio
        old = self._score(self.engine.module, batch, micro, self._tokens["old"]) if wanted else unused
        return ref, old

    def _kl_in_loss(self) -> bool:
        return self.ref_model is not None and not self.cfg.kl_in_reward

    def _score(self, model, batch: RolloutBatch, micro: list[list[int]], count: PassTokens) -> list:
        """No-grad per-token log-probs [rows, C] of each micro-batch (for the reference, or the old policy); None
        for an empty micro-batch. count receives the pass's tokens."""
        out: list = []
        with torch.no_grad():
            for idx in micro:
                if not idx:
                    model(**self._empty_inputs())  # keep the FSDP all-gathers in step with other ranks
                    count.processed += EMPTY_PASS_TOKENS
                    out.append(None)
                    continue
                mb, packed = self._layout(batch, idx)
                out.append(completion_log_probs(model, mb, packed, count, self.cfg.temperature,
                                                self.cfg.logprob_chunk_size)[0])
        return out

    def _layout(self, batch: RolloutBatch, idx: list[int]):
        """(micro-batch, packed layout or None) of these rows, built once per step from host copies and read by the
        reference, old and training passes and every iteration (no host sync inside a pass)."""
        key = (id(batch), tuple(idx))
        if key not in self._layouts:
            mb = batch.rows(idx)
            self._layouts[key] = (batch, mb, pack_rows(mb, self.share_prompts) if self.padding_free else None)
        return self._layouts[key][1:]

    # update
    def _update(self, batch: RolloutBatch, micro: list[list[int]], advantages: torch.Tensor, normaliser: float,
                ref_logps: list, old_logps: list, reward_kl: float,
                sft: SFTBatch | None = None) -> tuple[dict, list[float]]:
        """num_iterations optimizer steps, each over every planned micro-batch (an empty one runs a zero-loss pass).
        An iteration's step is skipped on every rank when any rank's rewards, advantages, loss or gradient norm
        were not finite, or no rank trains a row; too many skipped steps in a row stop the run, and so does at once
        an applied step that leaves the parameters non-finite or >10x larger (nonfinite.py). Returns the metric sums
        and each iteration's grad norm.

        Metrics are means over the tokens trained (rows of skipped flat groups excluded); loss, policy_loss, kl
        and entropy are taken at iteration 0, ratio and clip over every iteration (iteration 0's ratio is 1). The
        kl sum starts from the reward's KL of the trained rows (kl_in_reward). With SFT + RL (sft), every
        iteration adds the SFT micro-batch's forward / backward on every rank; its step applies even when no rank
        trains an RL row."""
        cfg = self.cfg
        # metric sums stay on the device (0-dim tensors once added to) and are read once, in _step_metrics
        sums = dict(loss=0.0, pg=0.0, kl=reward_kl, clipped=0.0, ratio=0.0, entropy=0.0,
                    sampler_diff=0.0, sampler_kl=0.0, is_weight=0.0, dual_clipped=0.0)
        grad_norms, applied, cause = [], 0, None
        for it in range(cfg.num_iterations):
            bad = torch.zeros((), dtype=torch.bool, device=self.ctx.device)  # a non-finite loss, read at the vote
            for idx, ref, old in zip(micro, ref_logps, old_logps):
                if idx:
                    bad = bad | self._train_micro_batch(self._layout(batch, idx), advantages[idx], normaliser, ref,
                                                        old, it, sums)
                else:
                    self._empty_backward()
            if self.sft is not None and sft is not None:
                bad = bad | (not self.sft.backward(self.engine, sft, it == 0))
            faults.inject("kill", self.step + 1, self.ctx.rank)
            faults.inject("stop", self.step + 1, self.ctx.rank)
            faults.inject("sigint", self.step + 1, self.ctx.rank)
            faults.inject("term", self.step + 1, self.ctx.rank)
            seen = self._nonfinite_vote(bool(bad))
            skip = seen is not None or (normaliser == 0 and sft is None)
            before_sq = 0.0 if skip else nonfinite.parameter_norm_sq(self._trainable())
            result = self.engine.step(skip=skip)
            if not skip and not result.applied:
                seen = "gradient"
            if result.applied:
                self._check_update(before_sq)
            cause = cause or seen
            grad_norms.append(result.grad_norm)
            applied += int(result.applied)
        if normaliser > 0 or sft is not None:
            self._track_nonfinite(applied == cfg.num_iterations, cause or "loss")
        return sums, grad_norms

    def _nonfinite_vote(self, loss_nonfinite: bool) -> str | None:
        """The cause (nonfinite.CAUSES) seen on any rank before the optimizer step, or None: one all-reduce of the
        flags and of each reward function's largest |weight x score| (named in the message)."""
        flags = self._step_flags
        votes = gdist.all_reduce_max([float(loss_nonfinite), float(flags.get("reward", False)),
                                      float(flags.get("advantage", False)), *self._reward_peaks], self.ctx.device)
        self._reward_peaks = [float(v) for v in votes[3:]]
        return nonfinite.first_cause({"loss": votes[0] > 0, "reward": votes[1] > 0, "advantage": votes[2] > 0})

    def _trainable(self) -> list[torch.Tensor]:
        """This rank's trainable parameters (its shards under FSDP)."""
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def _check_update(self, before_sq: float) -> None:
        """Stop (exit 3) before anything saves or samples from them when the applied update left the parameters
        non-finite or absurdly larger (nonfinite.py); one all-reduce of this rank's sums of squares."""
        s = gdist.all_reduce_sum([before_sq, nonfinite.parameter_norm_sq(self._trainable())], self.ctx.device)
        problem = nonfinite.parameter_problem(float(s[0]), float(s[1]))
        if problem:
            raise NonFiniteError(
                f"parameters: {problem} at step {self.step + 1} (learning_rate {self.engine.current_lr():.3g}); "
                f"stopping before any checkpoint holds them. {self._checkpoint_note()}. "
                f"Lower learning_rate{self._precision_advice()}")

    def _train_micro_batch(self, layout, advantages: torch.Tensor, normaliser: float,
                           ref_logp: torch.Tensor | None, old_logp: torch.Tensor | None, it: int,
                           sums: dict) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch (its _layout) at iteration `it`; its metric terms are added
        to sums (on the device). Returns whether its loss was non-finite, as a device flag: nothing here waits for
        the device."""
        first = it == 0
        mb, packed = layout
        cfg = self.cfg
        want = "grad" if cfg.entropy_coef != 0.0 else ("metric" if first else None)
        logp, entropy = completion_log_probs(self.engine.module, mb, packed, self._tokens["train"], cfg.temperature,
                                             cfg.logprob_chunk_size, want)  # [rows, C]
        if first and entropy is not None:
            sums["entropy"] += (entropy.detach() * mb.completion_mask).sum()
        c = logp.shape[1]
        old = old_logp[:, :c] if old_logp is not None else logp.detach()  # stale rollouts: the proximal policy
        ref = ref_logp[:, :c] if ref_logp is not None else None
        is_weights = self._sampler_terms(mb, old, sums if first else None)
        terms = grpo_loss(logp, old, advantages, mb.completion_mask, normaliser=max(normaliser, 1.0),
                          spec=self.loss_spec, ref_logp=ref, entropy=entropy, is_weights=is_weights)
        # FSDP averages gradients over ranks; the loss is already a global mean, so undo the average.
        loss = terms.loss * self.ctx.world_size
        if faults.inject("nan", self.step + 1, self.ctx.rank):
            loss = loss * float("nan")
        bad = ~torch.isfinite(loss.detach())
        self.engine.backward(loss)
        if faults.inject("nan_grad", self.step + 1, self.ctx.rank):
            for p in self._trainable():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        if first:
            sums["loss"] += terms.loss.detach()
            sums["pg"] += _detached(terms.pg_sum)
            sums["kl"] += _detached(terms.kl_sum)
        sums["clipped"] += _detached(terms.clipped_sum)
        sums["dual_clipped"] += _detached(terms.dual_clipped_sum) if terms.dual_clipped_sum is not None else 0.0
        sums["ratio"] += _detached(terms.ratio_sum)
        return bad

    def _loss_spec(self) -> LossSpec:
        """The loss's settings from the config; beta is 0 unless the KL term is in the loss."""
        cfg = self.cfg
        return LossSpec(loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                        beta=cfg.beta if self._kl_in_loss() else 0.0, kl_estimator=cfg.kl_estimator,
                        importance_sampling_level=cfg.importance_sampling_level,
                        dual_clip_c=cfg.effective_dual_clip_c,
                        entropy_coef=cfg.entropy_coef, max_completion_length=cfg.max_completion_length)

    @torch.no_grad()
    def _sampler_terms(self, mb: RolloutBatch, old: torch.Tensor, sums: dict | None) -> torch.Tensor | None:
        """Sampler/trainer mismatch on this micro-batch's completion tokens (added to sums on the first
        iteration) and the truncated importance weights of config key sampler_correction (None when off)."""
        if mb.sampler_logprobs is None:
            if self.cfg.sampler_correction != "none":
                raise ValueError("sampler_correction needs the rollout engine's log-probs (batch.sampler_logprobs)")
            return None
        sampler, mask = mb.sampler_logprobs.to(old.dtype), mb.completion_mask.to(old.dtype)
        weights = None
        mode = self.cfg.sampler_correction
        if mode == "none" and self.behaviour_ratio:  # decoupled PPO: the behaviour weight is never off
            mode = "token"
        if mode != "none":
            weights = truncated_is_weights(old, sampler, mask, mode, self.cfg.sampler_correction_cap)
        if sums is not None:
            sums["sampler_diff"] += ((old - sampler).abs() * mask).sum()
            # KL(sampler || trainer), k3, in float64: for differences ~1e-5 fp32 rounding would swamp its ~d^2/2
            sums["sampler_kl"] += (k3_kl(sampler.double(), old.double()) * mask).sum()
            if weights is not None:
                sums["is_weight"] += (weights * mask).sum()
        return weights

    def _empty_inputs(self) -> dict:
        pad = self.tokenizer.pad_token_id
        ids = torch.full((1, EMPTY_PASS_TOKENS), pad, dtype=torch.long, device=self.ctx.device)
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1, use_cache=False)

    def _empty_backward(self) -> None:
        """A rank with fewer micro-batches still runs forward + backward (zero loss) so FSDP's collectives match."""
        out = self.engine.module(**self._empty_inputs())
        self._tokens["train"].processed += EMPTY_PASS_TOKENS
        self.engine.backward(out.logits.sum() * 0.0)

    def _track_nonfinite(self, all_applied: bool, cause: str = "loss") -> None:
        """Count a skipped step; stop after max_consecutive_nonfinite in a row, naming the cause of the last."""
        if all_applied:
            self.consecutive_nonfinite = 0
            return
        self.consecutive_nonfinite += 1
        self.nonfinite_steps += 1
        what = nonfinite.describe(cause, self.rewards.names, self._reward_peaks, self.cfg.scale_rewards)
        self._skip_note = (what, nonfinite.advice(cause, self._precision_advice()))
        if self.consecutive_nonfinite >= self.cfg.max_consecutive_nonfinite:
            raise NonFiniteError(
                f"{cause}: {self.consecutive_nonfinite} consecutive steps had {what} (the last: step "
                f"{self.step + 1}); stopping. {self._checkpoint_note()}. "
                f"{nonfinite.advice(cause, self._precision_advice())}")

    def _precision_advice(self) -> str:
        """The override that turns mixed precision off, as the config parser reads it (YAML null), when it is on."""
        if not self.cfg.distributed.mixed_precision:
            return ""
        return ", or train in full precision: distributed.mixed_precision=null"

    # ------------------------------------------------------------------------------------------------ metrics
    def _step_metrics(self, batch, rewards, correct, flat_groups, rows, sums, grad_norms) -> dict:
        """The step's metrics over all ranks (one all-reduce of sums by name, one of the longest completion)."""
        dev = self.ctx.device
        lengths = batch.completion_lengths.double().cpu()
        row_tokens = (batch.prompt_mask.sum(1).double().cpu() + lengths)[rows]  # s of each trained row (mfu)
        s = gdist.all_reduce_sum_named({
            "reward": float(rewards.sum()), "reward_sq": float((rewards.double() ** 2).sum()), "rows": len(rewards),
            "correct": float(correct.sum()), "completion_tokens": float(lengths.sum()),
            "flat_groups": float(flat_groups.sum()), "groups": len(flat_groups),
            # cut off = no EOS in the completion (the loss's mask_truncated_completions definition): a completion
            # that ends with EOS exactly at max_completion_length finished
            "truncated": float(cut_off(batch, eos_token_ids(self.hf_model, self.tokenizer)).sum()),
            "prompt_tokens": float(batch.prompt_mask.sum()), "trained_tokens": float(lengths[rows].sum()),
            "attention_pairs": float((row_tokens * (row_tokens + 1)).sum()),
            "decode_processed": float(self._decode_tokens[0]), "decode_useful": float(self._decode_tokens[1]),
            "prompts_truncated": float(self._prompts_cut),
            **{k: sums[k] for k in ("loss", "pg", "kl", "clipped", "ratio", "entropy", "dual_clipped")},
            **{f"tokens/{k}_{name}": getattr(t, k) for name, t in self._tokens.items()
               for k in ("processed", "useful", "shared")}}, dev)
        mx = gdist.all_reduce_max([float(lengths.max()) if len(lengths) else 0.0], dev)
        n, tok = s["rows"], max(float(s["trained_tokens"]), 1.0)  # tokens trained, all ranks
        tok_iters = tok * self.cfg.num_iterations
        mean = float(s["reward"] / n)
        return {
            "step": self.step,
            "reward_mean": mean,
            "reward_std": float(torch.sqrt((s["reward_sq"] / n - mean ** 2).clamp(min=0))),
            "accuracy": float(s["correct"] / n),
            "completion_length_mean": float(s["completion_tokens"] / n),
            "completion_length_max": float(mx[0]),
            "truncated_fraction": float(s["truncated"] / n),
            "prompt_length_mean": float(s["prompt_tokens"] / n),  # with completion_length_mean: the length ratio
            "prompts_truncated": int(s["prompts_truncated"]),  # prompts (all ranks) cut to max_prompt_length tokens
            "zero_advantage_fraction": float(s["flat_groups"] / s["groups"]),
            "loss": float(s["loss"]),
            "policy_loss": float(s["pg"] / tok),
            "kl": float(s["kl"] / tok),
            "clip_fraction": float(s["clipped"] / tok_iters),  # the dual-clip bound counts as clipped too
            **({"dual_clip_fraction": float(s["dual_clipped"] / tok_iters)}
               if self.cfg.effective_dual_clip_c is not None else {}),
            "ratio_mean": float(s["ratio"] / tok_iters),
            "entropy": float(s["entropy"] / tok),
            "trained_tokens": float(s["trained_tokens"]),  # 0: no row trained (entropy, kl then read 0)
            "grad_norm": grad_norms[-1] if grad_norms else 0.0,
            "learning_rate": self.engine.current_lr(),
            "skipped_steps": self.nonfinite_steps,
            # tokens each pass computed (padding and empty passes included) and the real ones it needed, all ranks
            # and iterations: their difference is the padding (padding_free, max_tokens_per_micro_batch)
            **{k: float(v) for k, v in s.items() if k.startswith("tokens/")},
            "epoch": self.sampler.epoch,
            "_completion_tokens": float(s["completion_tokens"]) / self.ctx.world_size,  # per rank, for tokens/s
            "_attention_pairs": float(s["attention_pairs"]),  # all ranks, for mfu
            # decode rows computed vs tokens generated, all ranks and rollout rounds (lean / hf: vLLM batches its
            # own way); their gap is the padding that decode_compaction_threshold removes
            **({"tokens/processed_decode": float(s["decode_processed"]),
                "tokens/useful_decode": float(s["decode_useful"])} if self.cfg.rollout_engine != "vllm" else {}),
        }

    def _sampler_metrics(self, sums: dict, batch: RolloutBatch, rows: list[int]) -> dict:
        """sampler_logprob_diff: mean |logp_trainer - logp_sampler|, sampler_kl: k3 estimate of KL(sampler ||
        trainer), over the completion tokens trained on (all ranks); is_weight_mean with a sampler correction."""
        tokens = float(batch.completion_mask[rows].sum()) if rows else 0.0
        s = gdist.all_reduce_sum_named({"sampler_diff": sums["sampler_diff"], "sampler_kl": sums["sampler_kl"],
                                        "is_weight": sums["is_weight"], "tokens": tokens}, self.ctx.device)
        tok = max(float(s["tokens"]), 1.0)
        out = {"sampler_logprob_diff": float(s["sampler_diff"] / tok), "sampler_kl": float(s["sampler_kl"] / tok)}
        if self.cfg.sampler_correction != "none" or self.behaviour_ratio:
            out["is_weight_mean"] = float(s["is_weight"] / tok)
        return out

    def _reward_means(self, per_function: dict) -> dict:
        """reward/<name>: each function's mean over the completions of all ranks (every rank has the same functions,
        so the all-reduce matches; a rank with no rows adds zeros)."""
        # a score that does not apply (NaN: a batch function's None) is left out of its function's mean
        s = gdist.all_reduce_sum_named({**{f"sum/{k}": float(sum(x for x in v if x == x)) for k, v in
                                           per_function.items()},
                                        **{f"rows/{k}": float(sum(1 for x in v if x == x)) for k, v in
                                           per_function.items()}}, self.ctx.device)
        return {f"reward/{name}": float(s[f"sum/{name}"] / max(float(s[f"rows/{name}"]), 1.0))
                for name in per_function}

    def _timing_metrics(self, timer: Timer, t0: float, completion_tokens: float) -> dict:
        """step_time_s, time_<stage>_s, this rank's sampling throughput and the weight sync's part of the rollout."""
        return {"step_time_s": time.perf_counter() - t0, **{f"time_{k}_s": v for k, v in timer.times.items()},
                "completion_tokens_per_s": completion_tokens / max(timer.times["rollout"], 1e-9),
                "time_weight_sync_s": self.weight_sync_s}  # part of time_rollout_s

    def _flops_metrics(self, metrics: dict, timer: Timer, attention_pairs: float) -> dict:
        """mfu, mfu_update, mfu_logprobs, tokens_per_s_update, tokens_per_s_logprobs, model_flops (flops.py)."""
        n, layers, d_q = self._flops_shape
        update, no_grad = flops.step_flops(n, layers, d_q, metrics, attention_pairs, self.cfg.num_iterations)
        return flops.metrics(update, no_grad, metrics, {**timer.times, "step": metrics["step_time_s"]},
                             self._peak_flops, gdist.group_size())

    def _log_completions(self, batch: RolloutBatch, rewards, per_function) -> None:
        """Rank 0's first log_completions rows to completions.jsonl (no collective: only rank 0 writes). The prompt
        is decoded from the batch: the text the model was given (after any truncation), whichever round of dynamic
        sampling the row came from."""
        if not self.completion_log.enabled or self.last_advantages is None:
            return
        n = min(self.cfg.log_completions, len(batch))
        prompts = [self.tokenizer.decode(batch.prompt_ids[i][batch.prompt_mask[i].bool()]) for i in range(n)]
        self.completion_log.write(self.step, prompts, batch.completions, batch.references, rewards, per_function,
                                  self.last_advantages.tolist(), batch.completion_lengths.tolist())

    # ------------------------------------------------------------------------------------------ evaluation, save
    def evaluate(self, tier=None) -> dict:
        """One evaluation tier (evaluation.eval_tiers; the light one by default): greedy accuracy (and pass@k when
        configured) on its problems, split across ranks. Collective."""
        from grpo_dist.evaluation import eval_tiers, run_tier
        tier = tier or eval_tiers(self.cfg)[0]
        self.sync_rollout_weights()
        sample: list = []  # rank 0's first evaluation completion, shown on the console
        t0 = time.perf_counter()
        out = run_tier(self.rollout_engine, self.tokenizer, self.eval_examples, self.cfg, self.ctx, self.rewards,
                       tier, self.step, say=self.logger.write, sample_out=sample if self.ctx.is_main else None)
        self.rollout_engine.release()  # as after a rollout: the memory is training's until the next sync
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
