"""Save and resume of a run: the stateful parts, assembled once, and what the training loop asks of checkpoints.

A checkpoint (checkpoint.py has the on-disk format, docs/fault-tolerance.md the rules) holds these parts:

    model + optimizer   the engine's files: model.safetensors + optimizer.pt (full), sharded/ (DCP), the LoRA
                        adapter + optimizer.pt, deepspeed/ (DeepSpeed's own); written from a collective snapshot
    scheduler           trainer_state.json "scheduler": the LR schedule (engine.scheduler_state)
    counters            trainer_state.json "step", "epoch", "nonfinite_steps"
    run                 trainer_state.json "world_size", "config": what the resume checks compare with this run
    sampler             trainer_state.json "sampler": the prompt order and cursor (data.PromptSampler)
    sft_sampler         trainer_state.json "sft_sampler" (sft_coef > 0): the reference solutions' order
    curriculum          trainer_state.json "curriculum" (curriculum.mode != none): the difficulty statistics
    rng                 rng_state_<rank>.pt: torch, python, numpy (, cuda) RNG of each rank

Each part other than the model and optimizer is a state_dict()/load_state_dict() object; "counters" and "run" are
stored at the top level of trainer_state.json, the others under their name (the format written before parts
existed, so older checkpoints load). The asynchronous runs' cursor is the sampler: a trainer's sampler advances
when a batch comes back from the rollout ranks, and the rollout side starts from a copy of it (async_rollout.py),
so batches in flight at a save are sampled again after a resume.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from grpo_dist import checkpoint as ckpt
from grpo_dist import distributed as gdist
from grpo_dist import nonfinite
from grpo_dist import watchdog
from grpo_dist.async_save import BackgroundSaver
from grpo_dist.config import ConfigError
from grpo_dist.data import DataError

FLAT_PARTS = ("counters", "run")  # their state_dicts are the top level of trainer_state.json
DATA_CURSORS = ("sampler", "sft_sampler")  # checked against this world size before any weight is read
# trainer_state.json's key order as written before the parts existed (a file of the same state is the same bytes)
KEY_ORDER = ("step", "epoch", "sampler", "scheduler", "world_size", "nonfinite_steps", "config", "sft_sampler",
             "curriculum")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Counters:
    """The trainer's counters (its attributes step and nonfinite_steps, and its sampler's epoch)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def state_dict(self) -> dict:
        t = self.trainer
        return {"step": t.step, "epoch": t.sampler.epoch, "nonfinite_steps": t.nonfinite_steps}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.step = state["step"]
        self.trainer.nonfinite_steps = state.get("nonfinite_steps", 0)


class RunInfo:
    """The world size and resolved config a checkpoint was written with. Nothing to restore: a resume compares
    them with this run (world size, the settings it logs as changed, the rollout mode)."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx

    def state_dict(self) -> dict:
        return {"world_size": self.ctx.world_size, "config": self.cfg.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        pass


class Scheduler:
    """The LR schedule of the engine (a resume then applies the configured optimizer settings over it)."""

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict:
        return self.engine.scheduler_state()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_scheduler_state(state)


class RNG:
    """This rank's python, numpy, torch (and cuda) RNG."""

    def state_dict(self) -> dict:
        return ckpt.rng_state()

    def load_state_dict(self, state: dict) -> None:
        ckpt.set_rng_state(state)


class Resolved(NamedTuple):
    """The checkpoint to resume from (None: a fresh start), the note of its verification, its trainer state."""
    path: str | None
    note: str
    saved: dict | None


def resolve(cfg, ctx, has_curriculum: bool) -> Resolved:
    """Collective (one broadcast), before any model loads: rank 0 resolves resume_from_checkpoint, verifies (and
    hashes) the checkpoint and reads its state, so what the state alone can refuse stops here."""
    path, note, error, saved = None, "", None, None
    if ctx.is_main:
        try:
            path, note = ckpt.resolve_and_verify(cfg.resume_from_checkpoint, cfg.output_dir,
                                                 cfg.verify_checkpoint_hashes, cfg.start_over_if_no_intact_checkpoint)
            saved = ckpt.read_trainer_state(path) if path is not None else None
        except (ckpt.CheckpointError, OSError, ValueError) as e:
            error = str(e)
    path, note, error, saved = gdist.broadcast_object((str(path) if path else None, note, error, saved))
    if error:
        raise ckpt.CheckpointError(error)
    if saved is not None and has_curriculum and "curriculum" not in saved:
        raise ConfigError(f"config key 'curriculum.mode' = {cfg.curriculum.mode}: checkpoint {path} has no "
                          f"curriculum statistics (written with curriculum.mode=none); resume with "
                          f"curriculum.mode=none or start a fresh run")
    return Resolved(path, note, saved)


class Checkpointer:
    """The parts of a run's checkpoints, assembled once (models: build.Models; parts: name -> Stateful, in
    trainer_state.json order, None for a part this run does not have), and what the loop asks: save, resume, the
    saves that are due, the best checkpoint (save_best), the save metrics. All collective unless said otherwise."""

    def __init__(self, cfg, ctx, models, parts: dict[str, Stateful | None]):
        self.cfg, self.ctx, self.tied = cfg, ctx, models.tied_weights
        self.target = ckpt.Target(cfg.output_dir, models.engine, models.hf_model, models.tokenizer, ctx,
                                  models.save_format, cfg.save_total_limit, cfg.lora if cfg.lora.r else None,
                                  cfg.model.name_or_path, cfg.verify_checkpoint_hashes)
        self.parts: dict[str, Stateful] = {k: p for k, p in parts.items() if p is not None}
        self.rng = RNG()
        # async_save: checkpoints written by a background thread (async_save.py); the save metrics go into the
        # next step's line (a save starts after its step's line is logged)
        self.saver = BackgroundSaver(cfg.distributed.timeout_s) if cfg.async_save else None
        self.resumed_from: Path | None = None
        self.best: dict | None = None  # the record of output_dir/best/ (save_best)
        self._metrics: dict = {}

    # ------------------------------------------------------------------------------------------------------ save
    def trainer_state(self) -> dict:
        """trainer_state.json's content (without save_format, which the save adds)."""
        out: dict = {}
        for key, part in self.parts.items():
            if key in FLAT_PARTS:
                out.update(part.state_dict())
            else:
                out[key] = part.state_dict()
        rank = {key: i for i, key in enumerate(KEY_ORDER)}
        return dict(sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank))))

    def save(self, background: bool = False, name: str | None = None,
             extra_files: dict[str, str] | None = None) -> Path:
        """checkpoint-<step> (name: output_dir/<name>/ with extra_files, the best checkpoint). background (with
        async_save): written by the saver's thread, in place after the next poll or wait; else written here
        (after any save in flight)."""
        t0 = time.perf_counter()
        saver = self.saver if background else None
        if self.saver is not None:  # one save at a time: the one in flight first (its time_save_s kept)
            self._metrics.update(self.save_times(wait=True))
        state = self.trainer_state()
        path = ckpt.save_checkpoint(self.target, state["step"], state, self.rng.state_dict(), keep=self.resumed_from,
                                    name=name, extra_files=extra_files, background=saver)
        self._metrics["time_save_blocking_s"] = time.perf_counter() - t0
        if saver is None or not saver.in_flight():  # written here: nothing left to wait for
            self._metrics["time_save_s"] = self._metrics["time_save_blocking_s"]
        return path

    def with_target(self, **changes) -> Checkpointer:
        """A checkpointer of the same parts writing elsewhere or in another format (output_dir, save_format, ...):
        the same saver, so its saves still go one at a time."""
        other = copy.copy(self)
        other.target = dataclasses.replace(self.target, **changes)
        other._metrics = {}
        return other

    def save_if_due(self, stop: bool, cannot_learn: bool) -> Path | None:
        """A checkpoint at save_steps, at the end (save_final), and before any stop (a requested one always; a
        health.stop_on one when saving is on)."""
        cfg, step = self.cfg, self.parts["counters"].state_dict()["step"]
        if stop or (cfg.save_steps and step % cfg.save_steps == 0) or (step == cfg.max_steps and cfg.save_final) \
                or (cannot_learn and (cfg.save_steps or cfg.save_final)):
            watchdog.set_phase("save")
            return self.save(background=cfg.async_save)
        return None

    def after_step(self, metrics: dict, stop: bool, cannot_learn: bool, say) -> None:
        """The saves due after a step's line is logged: save_if_due, a new best (save_best), and before a stop the
        save in flight in place (the stop's line says the checkpoint is written: it must be by then)."""
        saved = self.save_if_due(stop, cannot_learn)
        if self.cfg.save_best and self.cfg.save_best in metrics:
            watchdog.set_phase("save")
            self.keep_best(metrics[self.cfg.save_best], saved, say)
        if stop or cannot_learn:
            self._metrics.update(self.save_times(wait=True))

    def save_times(self, wait: bool) -> dict:
        """time_save_blocking_s and time_save_s of the last save (the step's line after it). wait: block until the
        save in flight is done; else a collective poll (async_save.BackgroundSaver.poll). Either raises the
        background write's error."""
        if self.saver is not None and self.saver.in_flight():
            watchdog.set_phase("save")
            total = self.saver.wait() if wait else self.saver.poll(self.ctx.device)
            if total is not None:
                self._metrics["time_save_s"] = total
        out, self._metrics = self._metrics, {}
        return out

    def finish_after(self, error: BaseException | None) -> None:
        """Not collective. On the way out with an error: let the save in flight finish (an intact checkpoint is
        worth keeping); its own failure is one line, as the error that ends the run is already on its way."""
        if self.saver is None or not self.saver.in_flight() or isinstance(error, KeyboardInterrupt):
            return
        try:
            self.saver.wait()
        except BaseException as e:  # noqa: BLE001 - reported, not raised over the error that ends the run
            if self.ctx.is_main:
                print(f"[grpo_dist] the checkpoint save in flight failed too: {e}", flush=True)

    def note(self) -> str:
        """The newest intact checkpoint for a stop message, after the save in flight is done (with async_save the
        previous step's checkpoint may still be writing; naming "no checkpoint" then would be false)."""
        self.finish_after(None)
        return nonfinite.checkpoint_note(self.cfg.output_dir)

    def latest(self) -> Path | None:
        """The newest intact checkpoint once the save in flight is done (a stop message names it)."""
        self.finish_after(None)
        return ckpt.latest_checkpoint(self.cfg.output_dir)

    # ---------------------------------------------------------------------------------------------------- resume
    def resume(self, resolved: Resolved) -> None:
        """Restore every part from the resolved checkpoint (nothing when there is none): checks first (another
        model, a world size the data order does not map onto), then model + optimizer, the JSON parts, the RNG
        (reseeded from (seed, step, rank) at another world size)."""
        path, note, saved = resolved
        if path is None:
            return
        self._check_model(path)
        assert saved is not None  # read with the path by resolve
        if note and self.ctx.is_main:
            print(f"[grpo_dist] {path}: {note}", flush=True)
        self._check_cursors(path, saved)
        engine = self.target.engine
        state = ckpt.load_weights(Path(path), engine, self.ctx, tied=self.tied)
        self.parts["scheduler"].load_state_dict(state["scheduler"])
        rng = ckpt.saved_rng(Path(path), self.ctx, state)
        if rng is not None:
            self.rng.load_state_dict(rng)
        engine.apply_optimizer_settings(self.cfg)  # the configured values win over the checkpoint's
        if self.ctx.is_main:
            self._log_config_changes(saved.get("config") or {}, path)
            change = ckpt.rollout_mode_change(saved.get("config") or {}, self.cfg.rollout_ranks,
                                              self.ctx.world_size, Path(path).name)
            if change:
                print(change, flush=True)
        for key, part in self.parts.items():
            if key == "scheduler":
                continue
            if key in FLAT_PARTS:
                part.load_state_dict(state)
            elif key in state:  # curriculum: a checkpoint without its statistics was refused by resolve
                part.load_state_dict(state[key])
            elif self.ctx.is_main:  # sft_sampler: a checkpoint of a run without SFT
                print(f"[grpo_dist] resume: {path} has no SFT order (sft_coef was 0): the reference solutions "
                      f"start from their beginning", flush=True)
        self.resumed_from = Path(path)
        step = state["step"]
        if rng is None:
            # Per-rank RNG streams do not map onto another world size: fresh streams, distinct per step and engine
            # (the prompt order, weights and optimizer state still continue exactly). The ranks of a vLLM
            # tensor-parallel group sample together and must share one stream, as vLLM's own seed does.
            tp = self.cfg.vllm.tensor_parallel_size if self.cfg.rollout_engine == "vllm" else 1
            ckpt.seed_everything(int(np.random.SeedSequence([self.cfg.seed, step, self.ctx.rank // tp])
                                     .generate_state(1)[0]))
        if self.ctx.is_main:
            note = "" if rng is not None else (f" (written by {state['world_size']} ranks, now "
                                               f"{self.ctx.world_size}: sampling RNG reseeded)")
            print(f"[grpo_dist] resumed from {path} at step {step}{note}", flush=True)

    def _check_model(self, path: str) -> None:
        """Before any weight is read: a checkpoint of another model (or adapter) stops here, on every rank."""
        error = None
        if self.ctx.is_main:
            try:
                ckpt.check_model_shape(Path(path), self.target.hf_model.config, self.cfg.lora)
            except (ckpt.CheckpointError, OSError, ValueError) as e:
                error = str(e)
        error = gdist.broadcast_object(error)
        if error:
            raise ckpt.CheckpointError(error)

    def _check_cursors(self, path: str, saved: dict) -> None:
        """Before any weight is read: a different world size resumes only where the data order maps onto it (the
        same checks as the load, on throwaway copies)."""
        try:
            for key in DATA_CURSORS:
                if key in self.parts and key in saved:
                    copy.copy(self.parts[key]).load_state_dict(saved[key])
        except DataError as e:
            hint = ""
            global_batch = saved["sampler"]["prompts_per_rank"] * saved["sampler"]["world_size"]
            if saved["world_size"] != self.ctx.world_size and global_batch % self.ctx.world_size == 0:
                hint = f"; with {self.ctx.world_size} ranks set prompts_per_rank={global_batch // self.ctx.world_size}"
            raise DataError(f"{path}: {e}{hint}") from None

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

    # ------------------------------------------------------------------------------------------------------ best
    def load_best(self) -> None:
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
        self.best = record

    def keep_best(self, value: float, saved: Path | None, say) -> None:
        """A new best value (the all-reduced metric: every rank decides alike) becomes output_dir/best/, hard links
        of the checkpoint just written, else a save of its own. say: rank 0's console line."""
        if not ckpt.improves(value, self.best, self.cfg.save_best_mode):
            return
        step = self.parts["counters"].state_dict()["step"]
        record = {"metric": self.cfg.save_best, "mode": self.cfg.save_best_mode, "value": float(value), "step": step}
        if saved is not None:
            self._metrics.update(self.save_times(wait=True))  # the links need the checkpoint in place
            path = ckpt.link_best(saved, self.cfg.output_dir, record, self.ctx)
        else:
            path = self.save(name=ckpt.BEST_DIR, extra_files={ckpt.BEST_FILE: ckpt.best_json(record)})
        self.best = record
        say(f"[grpo_dist] save_best: {record['metric']} = {value:.4g} at step {step}, the best so far: {path}")
