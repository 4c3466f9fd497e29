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

import copy
import random
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from grpo_dist import checkpoint as ckpt
from grpo_dist import distributed as gdist
from grpo_dist import flops
from grpo_dist import lora
from grpo_dist import nonfinite
from grpo_dist import watchdog
from grpo_dist.async_rollout import AsyncRollouts, RolloutsElsewhere, replica_engine
from grpo_dist.async_save import BackgroundSaver
from grpo_dist.batch_source import ColocatedSource, RolloutRankSource, StepBatch
from grpo_dist.completions import CompletionLog, format_sample
from grpo_dist.config import ConfigError, GRPOConfig
from grpo_dist.curriculum import Curriculum
from grpo_dist.data import DataError, PromptSampler, load_examples, prompt_length_check, truncate_long_prompts
from grpo_dist.decoder import prepare_replica
from grpo_dist.graded import sampling_spec
from grpo_dist.engines import build_engine, shards_from_host
from grpo_dist.health import CANNOT_LEARN_EXIT_CODE, HealthMonitor
from grpo_dist.interrupts import PREEMPTED_EXIT_CODE, GracefulStop
from grpo_dist.learner import Learner, StepState
from grpo_dist.metrics import MetricsLogger, MetricsWriteError
from grpo_dist.nonfinite import NONFINITE_EXIT_CODE, NonFiniteError  # noqa: F401  (train.py reads them here)
from grpo_dist.packing import fallback_line, share_prompts_reason
from grpo_dist.models import (MIXED_PRECISION_DTYPES, cast_parameters_, copy_in_dtype, load_model, load_on_rank0_only,
                              load_tokenizer, materialize_meta, reward_dtype)
from grpo_dist.rewards import RewardComputer
from grpo_dist.rewards.batch import argument_problems
from grpo_dist.rollout import RolloutBatch, eos_token_ids
from grpo_dist.rollout_engines import SamplingSpec, build_rollout_engine, require_vllm, tied_aliases
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
        self._seed_everything(cfg.seed + ctx.rank)
        # Data and reward functions first: their mistakes are named before minutes of model loading.
        self.train_examples = self._load_split("train")
        self.eval_examples = self._load_split("eval") if cfg.eval_steps or cfg.full_eval_steps else []
        if (cfg.eval_steps or cfg.full_eval_steps) and not self.eval_examples:
            key = "eval_steps" if cfg.eval_steps else "full_eval_steps"
            raise ConfigError(f"config key '{key}' = {getattr(cfg, key)}, but the eval split is empty (no "
                              f"data.eval_path, and data.preset gives no held-out set here); set data.eval_path")
        # difficulty-aware sampling: the column check of curriculum.mode=static runs here, before any model loads
        self.curriculum = Curriculum(cfg.curriculum, self.train_examples, cfg.prompts_per_rank * ctx.world_size,
                                     cfg.seed) if cfg.curriculum.mode != "none" else None
        self.sampler = PromptSampler(self.train_examples, cfg.prompts_per_rank, ctx.rank, ctx.world_size, cfg.seed,
                                     self.curriculum)
        self._resume = self._resolve_resume()  # the checkpoint and its trainer_state.json, before any model loads
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
        self._check_prompt_lengths()  # prompts that lose their beginning: one warning, or refused (before models)
        self.sft = SFTMixer(cfg, ctx, self.tokenizer, sft_examples) if sft_examples else None  # SFT + RL
        # Pretrained weights on several ranks: rank 0 reads them, the others build on the meta device and get
        # their shards from rank 0 while the engine wraps (one model copy in host RAM per node while loading).
        meta = load_on_rank0_only(cfg, ctx.world_size) and not ctx.is_main
        # FSDP shards from the host (engines.shards_from_host): no full fp32 model on a GPU before sharding
        host = shards_from_host(cfg, ctx.world_size)
        policy = self._load_model("model", meta, to_device=not host)
        compute_dtype = MIXED_PRECISION_DTYPES.get(cfg.distributed.mixed_precision)
        # vLLM holds its own copy of the weights; lean / hf sample from a replica built here; with rollout_ranks > 0
        # the rollout ranks sample (async_rollout.py) and a trainer rank builds neither
        local_rollouts = not cfg.rollout_ranks
        self.gen_model = self._build_replica(policy, meta, compute_dtype) \
            if local_rollouts and cfg.rollout_engine != "vllm" else None
        self.hf_model = policy  # its config and generation_config go into checkpoints
        self.tied_weights = tied_aliases(policy)  # plain names, read before any wrapper renames them
        self.padding_free = cfg.padding_free and self._can_pack(policy)
        self.share_prompts = self.padding_free and cfg.share_prompts and self._can_share_prompts(policy)
        num_params = sum(p.numel() for p in policy.parameters())
        # mfu (flops.py): the model's shape before LoRA or a wrapper changes it, and the device's peak
        self._flops_shape = (flops.matmul_params(policy), *flops.attention_dims(policy.config))
        self._peak_flops = flops.peak_flops(cfg.peak_flops, ctx.device)
        if cfg.lora.r:  # after the replica copy: the replica stays a plain model and gets merged weights
            lora.apply_lora(policy, cfg.lora, cfg.model.init_seed)
            self._untie_replica(lora.adapted_tied_weights(policy))
        self.engine = build_engine(cfg, policy, ctx)
        if cfg.lora.r and cfg.lora.dropout:
            lora.activate_dropout(self.engine.module)
        if cfg.save_format == "sharded" and not self.engine.supports_sharded():
            raise ConfigError(f"config key 'save_format' = sharded is not supported by distributed.backend="
                              f"{cfg.distributed.backend}; use full or auto")
        # LoRA checkpoints hold the adapter (+ optimizer) only: always the full (gathered) format
        self.save_format = "full" if cfg.lora.r else ckpt.resolve_save_format(cfg.save_format, num_params, self.engine)
        self.ref_model: torch.nn.Module | lora.Reference | None = None
        if cfg.beta != 0.0 and cfg.lora.r:  # LoRA: the reference is the policy without its adapters
            self.ref_model = lora.Reference(self.engine.module)
        elif cfg.beta != 0.0:  # with beta = 0 the reference model is neither built nor run
            ref = self._load_model("reference model", meta, to_device=False)
            if cfg.distributed.backend in ("fsdp", "fsdp2"):  # kept in the compute dtype: cast before the GPU
                cast_parameters_(ref, compute_dtype)
            self.ref_model = self.engine.wrap_reference(ref if meta or host else ref.to(ctx.device))
        self.step = 0
        self.consecutive_nonfinite = 0
        self.nonfinite_steps = 0
        self.resumed_from: Path | None = None
        self.was_finished = False  # resumed at max_steps: nothing to train (nothing_to_do)
        self._stop_requested = False
        # async_save: checkpoints written by a background thread (async_save.py); the save metrics go into the
        # next step's line (a save starts after its step's line is logged)
        self.saver = BackgroundSaver(cfg.distributed.timeout_s) if cfg.async_save else None
        self._save_metrics: dict = {}
        self._maybe_resume()
        self.best = self._load_best() if cfg.save_best else None  # the record of output_dir/best/ (save_best)
        # vLLM's engine reseeds the process RNGs when it is built: a resumed run goes on with the checkpoint's
        # streams (bitwise what the uninterrupted run drew), not with the seed's again
        rng = ckpt.rng_state() if self.resumed_from is not None else None
        # every generate follows a weight sync here: vLLM starts from dummy weights (no checkpoint read per rank)
        self.rollout_engine = build_rollout_engine(cfg, ctx, self.gen_model, self.tokenizer, self.tied_weights,
                                                   num_params=num_params, synced=True) \
            if local_rollouts else RolloutsElsewhere()
        if rng is not None:
            ckpt.set_rng_state(rng)
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

    # --------------------------------------------------------------------------------------------------- setup
    def _build_replica(self, policy, meta: bool, compute_dtype):
        """The generation replica: a plain copy of the policy, refreshed from the shards every step (its storage
        is untouched until the first refresh on meta-built ranks). With mixed precision its parameters hold the
        compute dtype: rollouts then sample from the weights the training passes compute with, at half the
        memory. Buffers stay as they are, like FSDP's MixedPrecision keeps them: RoPE's inv_freq rounded to bf16
        would shift positions against the training forward more and more along the sequence."""
        replica = copy_in_dtype(policy, compute_dtype).eval()  # cast while copying: no full fp32 copy
        if meta:
            materialize_meta(replica, self.ctx.device)
        else:  # a policy left on the host for FSDP: the replica goes to the device in the compute dtype
            replica.to(self.ctx.device)
        if load_on_rank0_only(self.cfg, self.ctx.world_size):  # a collective: meta-built ranks take rank 0's buffers
            gdist.broadcast_tensors(list(replica.buffers()))
        replica.requires_grad_(False)
        prepare_replica(replica)  # one q|k|v and gate|up matmul per layer when decoding (decoder.py)
        return replica

    def _can_pack(self, policy) -> bool:
        """Whether the passes can run packed rows (padding_free); one line on rank 0 when they fall back."""
        line = fallback_line(policy)
        if line and self.ctx.is_main:
            print(line, flush=True)
        return line is None

    def _can_share_prompts(self, policy) -> bool:
        """Whether rows with the same prompt can read one copy of it (share_prompts); one line on rank 0 if not."""
        why = share_prompts_reason(policy)
        if why and self.ctx.is_main:
            print(f"[grpo_dist] share_prompts: {why}; every row computes its own prompt", flush=True)
        return why is None

    def _load_model(self, what: str, meta: bool, to_device: bool = True) -> torch.nn.Module:
        """load_model, on this rank's device unless meta or not to_device; rank 0 says what it loads and how long it
        took (a big model takes minutes)."""
        m = self.cfg.model
        name = m.name_or_path or f"tiny {(m.tiny or {}).get('architecture', 'qwen2')} (random weights)"
        if self.ctx.is_main:
            print(f"[grpo_dist] loading {what} {name} ...", flush=True)
        t0 = time.perf_counter()
        model = load_model(m, self.tokenizer, on_meta=meta)
        model = model.to(self.ctx.device) if to_device and not meta else model
        if self.ctx.is_main:
            print(f"[grpo_dist] loading {what} {name} ... done in {time.perf_counter() - t0:.1f} s", flush=True)
        return model

    def _check_prompt_lengths(self) -> None:
        """Rank 0 counts the training prompts that rollouts would cut (data.prompt_length_check), every rank gets
        its verdict: above data.max_truncated_prompt_fraction the run stops (DataError, exit 2), else one warning."""
        warning, error = None, None
        if self.ctx.is_main:
            warning, error = prompt_length_check(self.train_examples, self.cfg.data, self.tokenizer)
            if warning:
                print(f"[grpo_dist] {warning}", flush=True)
        error = gdist.broadcast_object(error)
        if error:
            self.rewards.close()
            raise DataError(error)

    def _untie_replica(self, names: list[str]) -> None:
        """An adapted tied head: the merge gives it weights of its own (lora.adapted_tied_weights)."""
        if names and self.cfg.rollout_engine == "vllm":
            raise ConfigError(f"config key 'lora.target_modules' adapts {names[0]}, which this model ties to its "
                              f"embeddings: not supported with rollout_engine=vllm (its model keeps them tied); "
                              f"use rollout_engine=lean or hf, or leave lm_head out")
        if self.gen_model is not None:
            lora.untie(self.gen_model, names)

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _load_split(self, split: str):
        examples = load_examples(self.cfg.data, split)
        where = (self.cfg.data.path if split == "train" else self.cfg.data.eval_path) or \
            f"data.preset={self.cfg.data.preset} ({split})"
        return truncate_long_prompts(examples, self.cfg.data.max_prompt_length, where, warn=self.ctx.is_main)

    def _resolve_resume(self) -> tuple[str | None, str, dict | None]:
        """(checkpoint path or None, verification note, its trainer_state.json), the same on every rank (one
        broadcast): rank 0 resolves, verifies (and hashes) the checkpoint and reads its state before any model
        loads, so what the state alone can refuse stops here."""
        path, note, error, saved = None, "", None, None
        if self.ctx.is_main:
            try:
                path, note = ckpt.resolve_and_verify(self.cfg.resume_from_checkpoint, self.cfg.output_dir,
                                                     self.cfg.verify_checkpoint_hashes,
                                                     self.cfg.start_over_if_no_intact_checkpoint)
                saved = ckpt.read_trainer_state(path) if path is not None else None
            except (ckpt.CheckpointError, OSError, ValueError) as e:
                error = str(e)
        path, note, error, saved = gdist.broadcast_object((str(path) if path else None, note, error, saved))
        if error:
            raise ckpt.CheckpointError(error)
        if saved is not None and self.curriculum is not None and "curriculum" not in saved:
            raise ConfigError(f"config key 'curriculum.mode' = {self.cfg.curriculum.mode}: checkpoint {path} has "
                              f"no curriculum statistics (written with curriculum.mode=none); resume with "
                              f"curriculum.mode=none or start a fresh run")
        return path, note, saved

    def _maybe_resume(self) -> None:
        path, note, saved = self._resume
        if path is None:
            return
        error = None
        if self.ctx.is_main:  # before any weight is read: a checkpoint of another model stops here
            try:
                ckpt.check_model_shape(Path(path), self.hf_model.config, self.cfg.lora)
            except (ckpt.CheckpointError, OSError, ValueError) as e:
                error = str(e)
        error = gdist.broadcast_object(error)
        if error:
            raise ckpt.CheckpointError(error)
        assert saved is not None  # read with the path by _resolve_resume
        if note and self.ctx.is_main:
            print(f"[grpo_dist] {path}: {note}", flush=True)
        # Checked before any weight is read: a different world size resumes only where the state maps onto it.
        try:
            copy.copy(self.sampler).load_state_dict(saved["sampler"])  # the same checks, on a throwaway copy
            if self.sft is not None and "sft_sampler" in saved:
                copy.copy(self.sft.sampler).load_state_dict(saved["sft_sampler"])
        except DataError as e:
            hint = ""
            global_batch = saved["sampler"]["prompts_per_rank"] * saved["sampler"]["world_size"]
            if saved["world_size"] != self.ctx.world_size and global_batch % self.ctx.world_size == 0:
                hint = f"; with {self.ctx.world_size} ranks set prompts_per_rank={global_batch // self.ctx.world_size}"
            raise DataError(f"{path}: {e}{hint}") from None
        state = ckpt.load_checkpoint(Path(path), self.engine, self.ctx, tied=self.tied_weights)
        self.engine.apply_optimizer_settings(self.cfg)  # the configured values win over the checkpoint's
        if self.ctx.is_main:
            self._log_config_changes(saved.get("config") or {}, path)
            change = ckpt.rollout_mode_change(saved.get("config") or {}, self.cfg.rollout_ranks,
                                              self.ctx.world_size, Path(path).name)
            if change:
                print(change, flush=True)
        self.sampler.load_state_dict(state["sampler"])
        if self.curriculum is not None:  # a checkpoint without statistics was refused by _resolve_resume
            self.curriculum.load_state_dict(state["curriculum"])
        if self.sft is not None and "sft_sampler" in state:
            self.sft.sampler.load_state_dict(state["sft_sampler"])
        elif self.sft is not None and self.ctx.is_main:
            print(f"[grpo_dist] resume: {path} has no SFT order (sft_coef was 0): the reference solutions start "
                  f"from their beginning", flush=True)
        self.step = state["step"]
        self.nonfinite_steps = state.get("nonfinite_steps", 0)
        self.resumed_from = Path(path)
        if not state["rng_restored"]:
            # Per-rank RNG streams do not map onto another world size: fresh streams, distinct per step and engine
            # (the prompt order, weights and optimizer state still continue exactly). The ranks of a vLLM
            # tensor-parallel group sample together and must share one stream, as vLLM's own seed does.
            tp = self.cfg.vllm.tensor_parallel_size if self.cfg.rollout_engine == "vllm" else 1
            self._seed_everything(int(np.random.SeedSequence([self.cfg.seed, self.step, self.ctx.rank // tp])
                                      .generate_state(1)[0]))
        if self.ctx.is_main:
            note = "" if state["rng_restored"] else (f" (written by {state['world_size']} ranks, now "
                                                     f"{self.ctx.world_size}: sampling RNG reseeded)")
            print(f"[grpo_dist] resumed from {path} at step {self.step}{note}", flush=True)

    def _log_config_changes(self, saved: dict, path: str) -> None:
        """One line per setting that differs from the checkpoint's config (what the user changed on resume)."""
        from grpo_dist.engines import OPTIMIZER_KEYS, SCHEDULE_KEYS

        def flat(d, prefix=""):
            for k, v in d.items():
                if isinstance(v, dict) and k in ("model", "data", "distributed", "health"):
                    yield from flat(v, f"{prefix}{k}.")
                else:
                    yield f"{prefix}{k}", v
        old, new = dict(flat(saved)), dict(flat(self.cfg.to_dict()))
        for key in sorted(set(old) & set(new)):
            if old[key] != new[key] and key not in ("resume_from_checkpoint", "output_dir"):
                applied = " (applied to the restored optimizer / LR schedule)" if key in OPTIMIZER_KEYS + \
                    SCHEDULE_KEYS else ""
                print(f"[grpo_dist] resume: {key} changed since {Path(path).name}: {old[key]!r} -> {new[key]!r}"
                      f"{applied}", flush=True)

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
                metrics.update(self._save_times(wait=False))
                watchdog.set_phase("stop-vote")
                self.logger.log(metrics)  # a failed append (full disk) is kept in logger.failed: stop together
                failed = self.logger.failed or self.completion_log.failed
                votes = gdist.all_reduce_sum_named({"stop": float(self._stop_requested),
                                                    "log_failed": float(failed is not None)},
                                                   self.ctx.device)  # every rank agrees to stop
                if float(votes["log_failed"]):
                    self._finish_save_after(None)  # the save in flight may be the last checkpoint
                    last = ckpt.latest_checkpoint(cfg.output_dir)
                    raise MetricsWriteError(f"{failed or 'rank 0 could not append to its logs'}; "
                                            f"the last checkpoint is {last or 'none'}: free space and rerun with "
                                            f"resume_from_checkpoint=auto")
                stop = bool(float(votes["stop"]))
                saved = self._save_if_due(stop, bool(health.stop))
                if cfg.save_best and cfg.save_best in metrics:
                    watchdog.set_phase("save")
                    self._keep_best(metrics[cfg.save_best], saved)
                if stop or health.stop:  # _stop_code's line says the checkpoint is written: it must be by then
                    self._save_metrics.update(self._save_times(wait=True))
                exit_code = self._stop_code(stop, health.stop)
                if exit_code:
                    break
            self._save_times(wait=True)  # the save in flight is in place (or its error raised) before the exit
            self.source.finish()  # not after an error: the peers may be gone
        except BaseException as e:
            self.source.abort(e)  # rollout ranks: they stop now, naming this failure
            self._finish_save_after(e)
            raise
        finally:
            self.logger.close()
            self.completion_log.close()
            self.rewards.close()
            self.close()
        return exit_code

    def nothing_to_do(self) -> bool:
        """A resumed run whose checkpoint is at max_steps already: say so in one line (rank 0), train nothing."""
        if self.resumed_from is None or self.step < self.cfg.max_steps:
            return False
        self.was_finished = True
        if self.ctx.is_main:
            print(f"[grpo_dist] nothing to do: {self.resumed_from} is at step {self.step} and max_steps is "
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

    def _save_if_due(self, stop: bool, cannot_learn: bool) -> Path | None:
        """A checkpoint at save_steps, at the end (save_final), and before any stop (a requested one always; a
        health.stop_on one when saving is on). Collective."""
        cfg = self.cfg
        if stop or (cfg.save_steps and self.step % cfg.save_steps == 0) or \
                (self.step == cfg.max_steps and cfg.save_final) or \
                (cannot_learn and (cfg.save_steps or cfg.save_final)):
            watchdog.set_phase("save")
            return self.save(background=cfg.async_save)
        return None

    def _save_times(self, wait: bool) -> dict:
        """time_save_blocking_s and time_save_s of the last save (the step's line after it). wait: block until the
        save in flight is done; else a collective poll (async_save.BackgroundSaver.poll). Either raises the
        background write's error."""
        if self.saver is not None and self.saver.in_flight():
            watchdog.set_phase("save")
            total = self.saver.wait() if wait else self.saver.poll(self.ctx.device)
            if total is not None:
                self._save_metrics["time_save_s"] = total
        out, self._save_metrics = self._save_metrics, {}
        return out

    def _finish_save_after(self, error: BaseException | None) -> None:
        """On the way out with an error: let the save in flight finish (an intact checkpoint is worth keeping);
        its own failure is one line, as the error that ends the run is already on its way."""
        if self.saver is None or not self.saver.in_flight() or isinstance(error, KeyboardInterrupt):
            return
        try:
            self.saver.wait()
        except BaseException as e:  # noqa: BLE001 - reported, not raised over the error that ends the run
            if self.ctx.is_main:
                print(f"[grpo_dist] the checkpoint save in flight failed too: {e}", flush=True)

    def _checkpoint_note(self) -> str:
        """The newest intact checkpoint for a stop message, after the save in flight is done (with async_save the
        previous step's checkpoint may still be writing; naming "no checkpoint" then would be false)."""
        self._finish_save_after(None)
        return nonfinite.checkpoint_note(self.cfg.output_dir)

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

    # ------------------------------------------------------------------------------------------------ the step
    def _batch_source(self):
        """Where the graded batches come from (batch_source.py): this rank's own rollout engine, or the rollout
        ranks (rollout_ranks > 0)."""
        cfg, ctx = self.cfg, self.ctx
        if not cfg.rollout_ranks:
            return ColocatedSource(cfg, ctx, self.sampler, self.curriculum, self.rollout_engine, self.tokenizer,
                                   self.rewards, self._eos_ids(), self.engine.iter_full_weights)
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

    def trainer_state(self) -> dict:
        return {"step": self.step, "epoch": self.sampler.epoch, "sampler": self.sampler.state_dict(),
                "scheduler": self.engine.scheduler_state(), "world_size": self.ctx.world_size,
                "nonfinite_steps": self.nonfinite_steps, "config": self.cfg.to_dict(),
                **({"sft_sampler": self.sft.sampler.state_dict()} if self.sft is not None else {}),
                **({"curriculum": self.curriculum.state_dict()} if self.curriculum is not None else {})}

    def save(self, background: bool = False, **where) -> Path:
        """checkpoint-<step>; where: save_checkpoint's name and extra_files (the best checkpoint). background (with
        async_save): written by self.saver's thread, in place after the next poll or wait; else written here (after
        any save in flight). Collective."""
        t0 = time.perf_counter()
        saver = self.saver if background else None
        if self.saver is not None:  # one save at a time: the one in flight first (its time_save_s kept)
            self._save_metrics.update(self._save_times(wait=True))
        path = ckpt.save_checkpoint(self.cfg.output_dir, self.step, self.engine, self.hf_model, self.tokenizer,
                                    self.trainer_state(), self.ctx, self.cfg.save_total_limit, self.resumed_from,
                                    self.save_format, lora_cfg=self.cfg.lora if self.cfg.lora.r else None,
                                    base_name=self.cfg.model.name_or_path,
                                    check_hashes=self.cfg.verify_checkpoint_hashes, background=saver, **where)
        self._save_metrics["time_save_blocking_s"] = time.perf_counter() - t0
        if saver is None or not saver.in_flight():  # written here: nothing left to wait for
            self._save_metrics["time_save_s"] = self._save_metrics["time_save_blocking_s"]
        return path

    def _load_best(self) -> dict | None:
        """The best so far that output_dir/best/ holds (rank 0 reads and verifies it; every rank gets it)."""
        record, error = None, None
        if self.ctx.is_main:
            try:
                record = ckpt.read_best(self.cfg.output_dir, str(self.cfg.save_best), self.cfg.save_best_mode,
                                        self.cfg.verify_checkpoint_hashes)
            except (ckpt.CheckpointError, OSError) as e:  # a damaged best/ that cannot be moved aside
                error = str(e)
            if record is not None:
                print(f"[grpo_dist] save_best: {Path(self.cfg.output_dir) / ckpt.BEST_DIR} holds {record['metric']} "
                      f"= {record['value']:.4g} (step {record['step']}); only a better one replaces it", flush=True)
        record, error = gdist.broadcast_object((record, error))
        if error:
            raise ckpt.CheckpointError(error)
        return record

    def _keep_best(self, value: float, saved: Path | None) -> None:
        """Collective: a new best value (the all-reduced metric: every rank decides alike) becomes output_dir/best/,
        hard links of the checkpoint just written, else a save of its own."""
        if not ckpt.improves(value, self.best, self.cfg.save_best_mode):
            return
        record = {"metric": self.cfg.save_best, "mode": self.cfg.save_best_mode, "value": float(value),
                  "step": self.step}
        if saved is not None:
            self._save_metrics.update(self._save_times(wait=True))  # the links need the checkpoint in place
            path = ckpt.link_best(saved, self.cfg.output_dir, record, self.ctx)
        else:
            path = self.save(name=ckpt.BEST_DIR, extra_files={ckpt.BEST_FILE: ckpt.best_json(record)})
        self.best = record
        self.logger.write(f"[grpo_dist] save_best: {record['metric']} = {value:.4g} at step {self.step}, the best so "
                          f"far: {path}")  # rank 0 (through the progress bar when there is one)
