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

import copy
import random
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from grpo_dist import checkpoint as ckpt
from grpo_dist import distributed as gdist
from grpo_dist import faults
from grpo_dist import flops
from grpo_dist import lora
from grpo_dist import micro_batches as mbatch
from grpo_dist import nonfinite
from grpo_dist import watchdog
from grpo_dist.advantages import dynamic_sampling_quota, group_advantages, zero_advantage_groups
from grpo_dist.async_rollout import RolloutsElsewhere
from grpo_dist.async_save import BackgroundSaver
from grpo_dist.completions import CompletionLog, format_sample
from grpo_dist.config import ConfigError, GRPOConfig
from grpo_dist.curriculum import Curriculum, allocate_group_sizes, record_graded
from grpo_dist.data import (DataError, PromptSampler, load_examples, prompt_length_check, render_prompt,
                            truncate_long_prompts)
from grpo_dist.decoder import prepare_replica
from grpo_dist.engines import build_engine, shards_from_host
from grpo_dist.environments import build_environment, step_metrics as environment_metrics
from grpo_dist.health import CANNOT_LEARN_EXIT_CODE, HealthMonitor
from grpo_dist.interrupts import PREEMPTED_EXIT_CODE, GracefulStop
from grpo_dist.losses import LossSpec, grpo_loss, k3_kl, kl_estimate, truncated_is_weights, uses_sequence_normaliser
from grpo_dist.metrics import MetricsLogger, MetricsWriteError
from grpo_dist.packing import PassTokens, completion_log_probs, fallback_line, pack_rows, share_prompts_reason
from grpo_dist.prompt_sharing import group_order, prompt_groups
from grpo_dist.models import (MIXED_PRECISION_DTYPES, cast_parameters_, copy_in_dtype, load_model, load_on_rank0_only,
                              load_tokenizer, materialize_meta, reward_dtype)
from grpo_dist.rewards import RewardComputer
from grpo_dist.rewards.batch import argument_problems, rollout_context
from grpo_dist.rollout import RolloutBatch, concat_rollouts, cut_off, eos_token_ids
from grpo_dist.rollout_engines import (SamplingSpec, build_rollout_engine, require_vllm,
                                       rollout_dtype, tied_aliases)
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
        self.environment = build_environment(cfg, self.tokenizer)  # single-turn unless config section environment
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
        self.loss_spec = self._loss_spec()
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
        self._decode_tokens = [0, 0]  # this step's decode row-steps computed, tokens generated (all rollout rounds)
        self._prompts_cut = 0  # this step's prompts longer than max_prompt_length (all rollout rounds)
        if rng is not None:
            ckpt.set_rng_state(rng)
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
            if self.async_rollouts is not None:  # the first max_staleness + 1 batches go out
                self.async_rollouts.start(self)
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
            if self.async_rollouts is not None:  # not after an error: the peers may be gone
                self.async_rollouts.close()
        except BaseException as e:
            if self.async_rollouts is not None:  # the rollout ranks stop now, naming this failure (best effort)
                self.async_rollouts.abort(e)
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
        health = self.health.update(metrics, self.step, self._skip_note)
        self._skip_note = None
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
        self.rollout_engine.close()
        self.environment.close()

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
        metrics.update(environment_metrics(self.environment, self.ctx.device))  # tools/*: multi-turn only
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
        batch = self.environment.rollout(self.rollout_engine, self.tokenizer, prompts, answers,
                                         self.sampling_spec(n=n, row_seeds=self._row_seeds(len(examples))),
                                         cfg.data.max_prompt_length, self.ctx.device)
        self._prompts_cut += batch.prompts_truncated
        if batch.decode_row_steps is not None:
            self._decode_tokens[0] += batch.decode_row_steps
            self._decode_tokens[1] += int(batch.loss_mask.sum())  # the tokens the model generated
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
                mask = batch.loss_mask[idx][:, :p.shape[1]].to(p.dtype)
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
        lengths = batch.loss_mask.sum(-1)  # the model's tokens (multi-turn: observations are not trained on)
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
            sums["entropy"] += (entropy.detach() * mb.loss_mask).sum()
        c = logp.shape[1]
        old = old_logp[:, :c] if old_logp is not None else logp.detach()  # stale rollouts: the proximal policy
        ref = ref_logp[:, :c] if ref_logp is not None else None
        is_weights = self._sampler_terms(mb, old, sums if first else None)
        terms = grpo_loss(logp, old, advantages, mb.loss_mask, normaliser=max(normaliser, 1.0),
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
        sampler, mask = mb.sampler_logprobs.to(old.dtype), mb.loss_mask.to(old.dtype)
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
            "prompt_tokens": float(batch.prompt_mask.sum()),
            "trained_tokens": float(batch.loss_mask.sum(-1).double().cpu()[rows].sum()),
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
        tokens = float(batch.loss_mask[rows].sum()) if rows else 0.0
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
