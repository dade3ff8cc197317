"""The generic training engine: :func:`train` runs any :class:`~iabn.tools.training.task.Task`.

One call prepares everything that can fail on bad input first (snapshot to resume, data,
model, batch split), then writes: ``LOG_DIR/config.json``, the logs (:mod:`.logs`) and, after
every epoch, ``LOG_DIR/last.pth`` (plus ``best.pth`` when validation improved), atomically.

Exactness of resume: the data order and every sample's augmentation are functions of
``(data.seed, epoch, index)`` (:mod:`iabn.tools.data.samplers`), the learning rate is a closed form
of the step (:mod:`.schedules`), and a snapshot holds model, optimizer, scheduler, loss-scaler,
position and each rank's RNG states. So a run resumed from any snapshot reaches bitwise the
same weights as an uninterrupted one (on the same hardware, software and thread count).

Stopping: SIGINT/SIGTERM (and the testing option ``stop_after_steps``) finish the current
step, write ``last.pth`` mid-epoch and return :data:`EXIT_STOPPED`; under ``torchrun`` a signal
is acted on at the next ``logging.log_every`` boundary, where the ranks agree to stop. A second
SIGINT (one process) stops without waiting for validation or the next step: a step or a
snapshot write under way is finished first (a half-done step cannot be saved), then
``last.pth`` holds the last finished step and :data:`EXIT_INTERRUPTED` is returned; under
``torchrun`` it interrupts at once, without a snapshot (the ranks cannot agree mid-step). A run
killed outright resumes from the last epoch's snapshot and repeats the partial epoch.

Failures: a non-finite training loss stops the run at that step, and a snapshot whose weights
or optimizer state are not finite is never written; a snapshot or log that cannot be written
(a full disk) stops it too. Either raises :class:`TrainingFailed` (one line: the step, the
loss and learning rate, or the file, and the last good snapshot); what is on disk stays as it
was.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..bench import write_text_atomic
from ..data.samplers import ExactShardSampler, ShuffledShardSampler
from .batch_check import check_training_batch
from .config import ENGINE_SCHEMA, Config, ConfigError, check_engine_config, combine, with_defaults
from .logdir import LOCK, LogDirError, LogDirLock, check_outputs, check_writable
from .logs import (
    TENSORBOARD,
    RunLog,
    RunLogError,
    peak_memory_mib,
    set_aside_tensorboard,
    summary_writer_class,
)
from .loops import autocast, evaluate, memory_format, to_device
from .optim import build_optimizer
from .progress import ProgressLine, bar
from .ranks import Ranks, all_reduce_sum, any_rank, finish, gather_objects, start
from .rng import capture_rng_state, restore_rng_state, seed_everything
from .schedules import build_scheduler
from .snapshot import (
    BEST,
    CHECKSUM_SUFFIX,
    FORMAT,
    LAST,
    PREVIOUS,
    READ_FROM,
    VERSION,
    SnapshotError,
    check_resumable,
    copy_atomic,
    load_state,
    read_snapshot,
    remove_stale_temporaries,
    save_atomic,
)
from .task import Meter, Task

EXIT_FINISHED = 0
EXIT_FAILED = 1
"""Exit status of a run that failed while training (:class:`TrainingFailed`)."""
EXIT_STOPPED = 3
"""Exit status of a run stopped early with a snapshot written (``--resume`` continues it)."""
EXIT_INTERRUPTED = 130
"""Exit status of a run stopped by a second SIGINT (128 + SIGINT, as shells report it)."""


class TrainingFailed(RuntimeError):
    """The run could not go on: the loss or the weights stopped being finite, or a snapshot or
    log could not be written. The message names the step or file and the last good snapshot;
    nothing was written over the snapshots."""


@dataclass
class TrainOptions:
    """How to run (as opposed to what to train, which is the config)."""

    log_dir: Path
    resume: Path | None = None
    """A snapshot to continue from (normally ``log_dir / "last.pth"``)."""
    device: str | None = None
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"``; None: CUDA when available (``cuda:LOCAL_RANK``)."""
    stop_after_steps: int | None = None
    """Testing: stop as if interrupted once this global step is done."""


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Interrupts:
    """SIGINT/SIGTERM while training. The first sets :attr:`requested` (stop after this step);
    a second SIGINT raises KeyboardInterrupt at once, except inside :meth:`critical` sections
    (a training step, a snapshot write), whose end it then waits for. Under ``torchrun`` there
    are no critical sections: a rank cannot finish its step alone."""

    def __init__(self, log: RunLog, defer: bool) -> None:
        self.log, self.defer = log, defer
        self.requested = threading.Event()
        self.pending = False
        self.depth = 0

    def handle(self, signum: int, frame: Any) -> None:
        if self.requested.is_set() and signum == signal.SIGINT:
            if self.defer and self.depth:
                self.pending = True
                self.log.info("SIGINT again: stopping when this step is done, without "
                              "further validation")
                return
            raise KeyboardInterrupt
        self.requested.set()
        second = ("a second SIGINT stops without waiting for validation" if self.defer else
                  "a second SIGINT stops at once, without a snapshot")
        self.log.info(f"{signal.Signals(signum).name}: stopping after this step and writing "
                      f"{LAST} (resume with --resume; {second})")

    @contextmanager
    def critical(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.pending and not self.depth:
            self.pending = False
            raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[_Interrupts]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals can only be handled in the main thread
            return
        previous = {sig: signal.signal(sig, self.handle) for sig in _STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _worker_ignores_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: SIGINT/SIGTERM sent to the whole process group (Ctrl-C,
    job schedulers, ``torchrun``) must not kill the workers before the main process has
    finished its step and written its snapshot; the workers stop when the main process shuts
    them down or exits. The signals were blocked while the worker started
    (:class:`_ShieldedLoader`); ignoring them, then unblocking, discards a pending one."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


class _ShieldedLoader:
    """A DataLoader whose worker processes are started with SIGINT/SIGTERM blocked (they
    inherit the mask, so a signal in the start-up window cannot kill them either); the main
    process's own mask is restored right after, and a signal that came meanwhile is then
    delivered to it."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        if (self.loader.num_workers == 0
                or threading.current_thread() is not threading.main_thread()):
            return iter(self.loader)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            return iter(self.loader)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _format_metrics(metrics: dict[str, float], per_class: bool = True) -> str:
    """``name value`` pairs; ``per_class=False`` leaves out ``group/name`` entries (e.g. the
    segmentation task's ``iou/<class>``), which the progress line has no room for."""
    return " ".join(f"{name} {value:.4g}" for name, value in metrics.items()
                    if name != "count" and (per_class or "/" not in name))


class _Run:
    """One training run; ``__init__`` builds everything (nothing written), ``run`` trains."""

    def __init__(self, task: Task, config: Config, options: TrainOptions, ranks: Ranks) -> None:
        self.task, self.config, self.options, self.ranks = task, config, options, ranks
        self.lock = LogDirLock(options.log_dir)
        data, network = config["data"], config["network"]
        check_writable(options.log_dir)  # every rank writes its log file there
        if ranks.is_main:
            # a running run first: the advice for a folder with snapshots (--resume) would
            # only be refused by its lock
            self.lock.check_free()
            check_outputs(options.log_dir, _REPLACED, (LOCK, f"logs/rank{ranks.rank}.log"),
                          ("logs", TENSORBOARD))
        if config["logging"]["tensorboard"] and ranks.is_main:
            summary_writer_class()  # a missing package fails now, not after the first write
        snapshot = self._snapshot_to_resume()
        seed_everything(data["seed"])
        self.splits = task.datasets(config)
        self.model = task.build_model(config, self.splits, ranks).to(
            ranks.device, memory_format=memory_format(network["channels_last"]))
        try:
            self.sampler = ShuffledShardSampler(
                len(self.splits.train), data["batch_size"], ranks.world_size, ranks.rank,
                data["seed"], config["schedule"]["max_steps_per_epoch"])
        except ValueError as error:
            raise ConfigError(f"data.batch_size={data['batch_size']}: {error}") from None
        check_training_batch(task, config, self.splits, self.model, self.sampler.per_rank,
                             ranks)
        self.plan_report = None
        if network["memory_budget"] is not None:
            from .memory_plan import plan_model

            self.model, self.plan_report = plan_model(
                self.model, network["memory_budget"], self.splits.train[(0, 0)][0],
                self.sampler.per_rank, ranks.device, network["precision"],
                network["channels_last"], ranks.distributed)
        self.optimizer = build_optimizer(self.model, config["optimizer"])
        self.scheduler = build_scheduler(self.optimizer, config["schedule"],
                                         self.sampler.batches_per_epoch)
        self.scaler = torch.amp.GradScaler(ranks.device.type,
                                           enabled=network["precision"] == "fp16")
        self.epoch, self.batches_done, self.global_step = 0, 0, 0
        self.best: dict[str, Any] | None = None
        self.resumed_sums: torch.Tensor | None = None
        self.meter: Meter | None = None
        # what a failure message names as the last good snapshot, and the position (epoch,
        # batches done) last written: an interrupt there need not write it again
        self.last_good: str | None = None
        self.saved: tuple[int, int] | None = None
        self.validation_rng: dict[str, Any] | None = None
        # The loader draws its workers' base seed from this generator, not from the global
        # torch RNG, whose state must only change with the training itself.
        self.loader_generator = torch.Generator()
        if snapshot is None:
            # Ranks differ in their random streams (dropout), rank 0 matches a single process.
            seed_everything(data["seed"] + ranks.rank)
        else:
            self._restore(snapshot)
        self.first_step = self.global_step
        self.trained = self.model
        if ranks.distributed:
            device_ids = [ranks.device.index] if ranks.device.type == "cuda" else None
            self.trained = nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        self._lock_log_dir()

    def _lock_log_dir(self) -> None:
        """Take the log directory (rank 0), last of the checks: a second run pointed at it
        stops here, on every rank, naming the run that holds it (:mod:`.logdir`)."""
        error: LogDirError | SnapshotError | None = None
        if self.ranks.is_main:
            try:
                self.lock.acquire()
                if self.options.resume is None and _snapshots(self.options.log_dir):
                    self.lock.release()  # written since the first check, by a run now gone
                    self._snapshot_to_resume()
            except (LogDirError, SnapshotError) as raised:
                error = raised
        failed = error is not None
        if self.ranks.distributed:
            failed = any_rank(failed, self.ranks)
        if failed:
            raise error or LogDirError(f"{self.options.log_dir}: rank 0 could not take the "
                                       f"log directory (its message says why)")

    def release(self) -> None:
        self.lock.release()

    def _snapshot_to_resume(self) -> dict[str, Any] | None:
        path, log_dir = self.options.resume, self.options.log_dir
        if path is None:
            found = _snapshots(log_dir)
            if found:
                # --resume alone reads last.pth (or, when that is bad, previous.pth)
                how = "--resume" if {LAST, PREVIOUS} & set(found) else \
                    f"--resume {log_dir / found[0]}"
                raise SnapshotError(
                    f"{log_dir} already holds a run ({', '.join(found)}): continue it with "
                    f"{how}, or choose another --log-dir")
            return None
        snapshot = read_snapshot(path)
        # keys added to the schema since the snapshot was written count at their defaults
        snapshot["config"] = with_defaults(snapshot["config"],
                                           combine(ENGINE_SCHEMA, self.task.schema))
        check_resumable(snapshot, path, self.task.name, self.config, self.ranks.world_size)
        if self.ranks.is_main:
            _warn_if_not_bitwise(snapshot, self.ranks.device)
        return snapshot

    def _restore(self, snapshot: dict[str, Any]) -> None:
        path = self.options.resume
        load_state(self.model, snapshot["model"], "model", path)
        load_state(self.optimizer, snapshot["optimizer"], "optimizer", path)
        load_state(self.scheduler, snapshot["scheduler"], "scheduler", path)
        load_state(self.scaler, snapshot["scaler"], "loss scaler", path)
        self.epoch, self.batches_done = snapshot["epoch"], snapshot["batches_done"]
        self.global_step, self.best = snapshot["global_step"], snapshot["best"]
        mine = snapshot["ranks"][self.ranks.rank]
        restore_rng_state(mine["rng"])
        if self.batches_done:
            self.resumed_sums = mine["train_sums"]
        self.last_good = f"{snapshot.get(READ_FROM, path)} (step {self.global_step})"

    # ------------------------------------------------------------------ writing
    def _write_snapshot(self, epoch: int, batches_done: int, meter: Meter,
                        val_metrics: dict[str, float] | None, improved: bool,
                        log: RunLog) -> None:
        """``last.pth`` (and ``best.pth`` when ``improved``) for the position ``batches_done``
        into ``epoch``; every rank must call it. Weights or optimizer state that are not
        finite are never written (:class:`TrainingFailed`)."""
        per_rank = gather_objects({"rng": capture_rng_state(),
                                   "train_sums": meter.sums.detach().cpu()}, self.ranks)
        if not self.ranks.is_main:
            self.saved = (epoch, batches_done)
            return
        broken = _first_non_finite(self.model, self.optimizer)
        if broken is not None:
            raise self._diverged(f"after step {self.global_step} {broken} is not finite")
        payload = {
            "format": FORMAT, "version": VERSION, "task": self.task.name,
            "config": self.config, "world_size": self.ranks.world_size,
            "epoch": epoch, "batches_done": batches_done,
            "global_step": self.global_step,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "best": self.best, "val_metrics": val_metrics, "ranks": per_rank,
            "dataset": self.splits.metadata,
            # what else decides bitwise equality of a resumed run (see _warn_if_not_bitwise)
            "threads": torch.get_num_threads(), "device": self.ranks.device.type,
        }
        log_dir = self.options.log_dir
        # the TensorBoard points up to this step go to disk first: a run killed after the
        # snapshot resumes after this step and must find them there
        log.flush()
        target = log_dir / (BEST if improved else LAST)
        try:
            if improved:
                # best.pth first: a kill between the two writes then leaves last.pth one epoch
                # behind, and resuming repeats that epoch and rewrites best.pth the same way.
                save_atomic(payload, target)
                target = log_dir / LAST
                copy_atomic(log_dir / BEST, target)
            else:
                save_atomic(payload, target)
        except OSError as error:
            raise TrainingFailed(
                f"cannot write snapshot {target}: {error.strerror or error}; the snapshots "
                f"already in {log_dir} are as they were (the last: "
                f"{self.last_good or 'none was written yet'})") from None
        self.last_good = f"{log_dir / LAST} (step {self.global_step})"
        self.saved = (epoch, batches_done)

    def _diverged(self, what: str) -> TrainingFailed:
        lr = self.optimizer.param_groups[0]["lr"]
        return TrainingFailed(
            f"training diverged: {what} (epoch {self.epoch + 1}, learning rate {lr:.4g}); "
            f"nothing was written from this point on; the last good snapshot is "
            f"{self.last_good or 'none (there was none yet)'}; lower optimizer.lr (or add "
            f"schedule.warmup_epochs or optimizer.clip_grad_norm) and start again in a new "
            f"--log-dir")

    # ------------------------------------------------------------------ loop
    def _loaders(self) -> tuple[_ShieldedLoader, _ShieldedLoader]:
        data, ranks = self.config["data"], self.ranks
        common = {"num_workers": data["workers"], "pin_memory": ranks.device.type == "cuda",
                  "worker_init_fn": _worker_ignores_stop_signals}
        train = DataLoader(self.splits.train, batch_size=self.sampler.per_rank,
                           sampler=self.sampler, generator=self.loader_generator, **common)
        val_batch = data["val_batch_size"] or data["batch_size"]
        val = DataLoader(self.splits.val, batch_size=max(1, val_batch // ranks.world_size),
                         sampler=ExactShardSampler(len(self.splits.val), ranks.world_size,
                                                   ranks.rank), **common)
        return _ShieldedLoader(train), _ShieldedLoader(val)

    def _train_step(self, batch: Any, meter: Meter) -> None:
        network, optimizer = self.config["network"], self.optimizer
        inputs, targets = to_device(batch, self.ranks.device, network["channels_last"])
        with autocast(self.ranks.device, network["precision"]):
            outputs = self.task.forward(self.trained, inputs)
            loss = self.task.loss(outputs, targets)
        optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        # One host sync per step, after backward is queued (so its launches overlap the
        # device's forward) and before the optimizer step, so a non-finite step is never
        # applied. Under torchrun every rank reaches it after backward's all-reduce; the
        # loss is each rank's own, and torchrun ends the peers of a rank that exits here.
        value = loss.detach().float().item()
        if not math.isfinite(value):
            raise self._diverged(f"the training loss is {value} at step "
                                 f"{self.global_step + 1}")
        clip = self.config["optimizer"]["clip_grad_norm"]
        if clip is not None:
            self.scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        # fp16's loss scaler skips the optimizer step when the scaled gradients overflowed
        # (the first steps, while it lowers its scale): no update is applied, so a per-step
        # schedule does not advance either. It would otherwise run ahead of the updates, and
        # PyTorch rightly warns "lr_scheduler.step() before optimizer.step()" when the very
        # first step is skipped. A lowered scale is the skip (one host sync, fp16 only).
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(optimizer)
        self.scaler.update()
        applied = scale is None or self.scaler.get_scale() >= scale
        if self.config["schedule"]["update"] == "step" and applied:
            self.scheduler.step()
        meter.update(outputs.detach(), targets, loss.detach())

    def _sync_buffers(self) -> None:
        """Give every rank rank 0's BN statistics (unsynchronised BN drifts apart per rank)
        so validation is the same whichever rank holds a sample."""
        if self.ranks.distributed:
            for buffer in self.model.buffers():
                dist.broadcast(buffer, 0)

    def _validate(self, val_loader: _ShieldedLoader, progress: ProgressLine
                  ) -> dict[str, float]:
        self._sync_buffers()
        network = self.config["network"]
        return evaluate(self.task, self.model, val_loader, self.ranks, network["precision"],
                        network["channels_last"], progress, len(val_loader))

    def _log_validation(self, metrics: dict[str, float], log: RunLog) -> None:
        log.scalars({f"val/{k}": v for k, v in metrics.items() if k != "count"},
                    self.global_step)
        log.info(f"epoch {self.epoch + 1} val: {_format_metrics(metrics)} "
                 f"({int(metrics['count'])} samples)")

    def _report(self, meter: Meter, log: RunLog, progress: ProgressLine, images: int,
                seconds: float) -> None:
        """Training metrics so far this epoch (summed over ranks) to progress, log, TB."""
        metrics = meter.summarize(all_reduce_sum(meter.sums, self.ranks))
        lr = self.optimizer.param_groups[0]["lr"]
        speed = images / seconds if seconds > 0 else 0.0
        memory = peak_memory_mib(self.ranks.device)
        epochs, steps = self.config["schedule"]["epochs"], self.sampler.batches_per_epoch
        position = f"epoch {self.epoch + 1}/{epochs} {bar(self.batches_done, steps)} " \
                   f"{self.batches_done}/{steps}"
        rest = f"lr {lr:.4g} {speed:.0f} img/s {memory:.0f} MiB peak"
        progress.show(f"{position} {_format_metrics(metrics, per_class=False)} {rest}")
        log.info(f"{position} {_format_metrics(metrics)} {rest}", console=False)
        log.scalars({**{f"train/{k}": v for k, v in metrics.items() if k != "count"},
                     "train/lr": lr, "train/images_per_s": speed,
                     "train/peak_memory_mib": memory}, self.global_step)

    def _should_stop(self, requested: threading.Event, at_boundary: bool) -> bool:
        if self.options.stop_after_steps == self.global_step:
            return True
        if not self.ranks.distributed:
            return requested.is_set()
        # Only at agreed points: every rank must take part in the all-reduce.
        return at_boundary and any_rank(requested.is_set(), self.ranks)

    def run(self) -> int:
        options, config, ranks = self.options, self.config, self.ranks
        moved = None
        try:
            options.log_dir.mkdir(parents=True, exist_ok=True)
            if ranks.is_main:
                remove_stale_temporaries(options.log_dir)
                if options.resume is None:
                    # a fresh start is refused where there are snapshots: these events are
                    # from a run that died before its first one
                    moved = set_aside_tensorboard(options.log_dir)
            log = RunLog(options.log_dir, ranks, config["logging"]["tensorboard"],
                         # the snapshot's own step was logged before it was written: keep
                         # it, drop only what a killed run logged after it
                         purge_step=self.global_step + 1 if options.resume else None)
        except OSError as error:  # e.g. a read-only folder inside a writable one
            where = f" ({error.filename})" if error.filename else ""
            raise LogDirError(f"cannot write in --log-dir {options.log_dir}: "
                              f"{error.strerror or error}{where}") from None
        failed = True
        try:
            if ranks.is_main:
                self._write_config()
            if moved is not None:
                log.info(f"moved the TensorBoard events of an earlier run here, which left no "
                         f"snapshot, to {moved}")
            log.info(f"{'resuming' if options.resume else 'starting'} at epoch "
                     f"{self.epoch + 1}, step {self.global_step}; {self.splits.description}; "
                     f"{ranks.world_size} rank(s) on {ranks.device}; log dir {options.log_dir}")
            if self.plan_report is not None:
                from .memory_plan import summary

                log.info(summary(self.plan_report))
            interrupts = _Interrupts(log, defer=not ranks.distributed)
            with interrupts.installed():
                code = self._epochs(log, interrupts)
            failed = False
            return code
        except RunLogError as error:
            raise self._cannot_write(str(error)) from None
        except TrainingFailed as error:
            with suppress(RunLogError):
                log.info(f"stopped: {error}", console=False)
            raise
        finally:
            try:
                log.close()
            except RunLogError as error:
                if not failed:
                    raise self._cannot_write(str(error)) from None

    def _write_config(self) -> None:
        path = self.options.log_dir / "config.json"
        try:
            write_text_atomic(path, json.dumps(self.config, indent=2) + "\n")
        except OSError as error:
            raise self._cannot_write(f"cannot write {path}: {error.strerror or error}"
                                     ) from None

    def _cannot_write(self, what: str) -> TrainingFailed:
        return TrainingFailed(f"{what}; the snapshots in {self.options.log_dir} are as they "
                              f"were (the last: {self.last_good or 'none was written yet'})")

    def _current_meter(self) -> Meter:
        """The training sums of the position reached (an interrupt may come before the
        epoch's meter exists)."""
        if self.meter is None:
            self.meter = self.task.new_meter(self.ranks.device)
            if self.resumed_sums is not None:
                self.meter.sums.copy_(self.resumed_sums)
        return self.meter

    def _epochs(self, log: RunLog, interrupts: _Interrupts) -> int:
        progress = ProgressLine(self.config["logging"]["progress"] and self.ranks.is_main)
        validation_rng = None
        try:
            return self._train_epochs(log, interrupts, progress)
        except KeyboardInterrupt:
            validation_rng = self.validation_rng
        finally:
            progress.end()  # an error message or the last log line starts on a line of its own
        # A second SIGINT: save the last finished step, if this run made one.
        where = f"interrupted at epoch {self.epoch + 1}, step {self.global_step}"
        if self.ranks.distributed or self.global_step == self.first_step:
            why = ("under torchrun no snapshot is written (the ranks cannot agree mid-step)"
                   if self.ranks.distributed else "no step was finished in this run")
            log.info(f"{where}: {why}; the last snapshot is {self.last_good or 'none'}")
            return EXIT_INTERRUPTED
        if self.saved != (self.epoch, self.batches_done):
            if validation_rng is not None:
                # interrupted in validation: its data loading may have drawn random numbers
                restore_rng_state(validation_rng)
            with interrupts.critical():
                self._write_snapshot(self.epoch, self.batches_done, self._current_meter(),
                                     None, False, log)
        log.info(f"{where}: {self.options.log_dir / LAST} written; continue with --resume")
        return EXIT_INTERRUPTED

    def _train_epochs(self, log: RunLog, interrupts: _Interrupts,
                      progress: ProgressLine) -> int:
        config, ranks = self.config, self.ranks
        requested = interrupts.requested
        train_loader, val_loader = self._loaders()
        epochs, log_every = config["schedule"]["epochs"], config["logging"]["log_every"]
        seed = config["data"]["seed"]
        for epoch in range(self.epoch, epochs):
            with interrupts.critical():
                self.epoch = epoch
                self.sampler.set_epoch(self.epoch, self.batches_done)
                self.loader_generator.manual_seed(
                    int(np.random.SeedSequence([seed, self.epoch]).generate_state(1)[0]))
                self.meter = None
                meter = self._current_meter()
                self.resumed_sums = None
            self.trained.train()
            started, images = time.perf_counter(), 0
            for batch in train_loader:
                # the step and its log line: a snapshot after it must find its points logged
                with interrupts.critical():
                    self._train_step(batch, meter)
                    self.batches_done += 1
                    self.global_step += 1
                    images += self.sampler.per_rank * ranks.world_size
                    boundary = (self.batches_done % log_every == 0
                                or self.batches_done == self.sampler.batches_per_epoch)
                    if boundary:
                        self._report(meter, log, progress, images,
                                     time.perf_counter() - started)
                        started, images = time.perf_counter(), 0
                if self._should_stop(requested, boundary):
                    progress.end()
                    with interrupts.critical():
                        self._write_snapshot(self.epoch, self.batches_done, meter, None, False,
                                             log)
                    log.info(f"stopped at epoch {self.epoch + 1}, step {self.global_step}: "
                             f"{self.options.log_dir / LAST} written; continue with --resume")
                    return EXIT_STOPPED
            progress.end()
            self._end_epoch(meter, val_loader, log, progress, interrupts)
        best = self.best
        # rounded as the epochs' metrics are (the snapshot keeps the full value)
        best_text = (f"best {best['metric']} {best['value']:.4g} (epoch {best['epoch']})"
                     if best is not None else
                     f"no best.pth (no finite validation {self.task.best_metric})")
        log.info(f"finished {epochs} epochs; {best_text}; snapshots in {self.options.log_dir}")
        return EXIT_FINISHED

    def _end_epoch(self, meter: Meter, val_loader: _ShieldedLoader, log: RunLog,
                   progress: ProgressLine, interrupts: _Interrupts) -> None:
        config = self.config
        train_metrics = meter.summarize(all_reduce_sum(meter.sums, self.ranks))
        log.info(f"epoch {self.epoch + 1} train: {_format_metrics(train_metrics)}")
        last = self.epoch + 1 == config["schedule"]["epochs"]
        val_metrics = None
        if last or (self.epoch + 1) % config["logging"]["val_every"] == 0:
            # An interrupt in validation saves the position before it (the epoch's last
            # step), with the random state from before it.
            self.validation_rng = capture_rng_state()
            val_metrics = self._validate(val_loader, progress)
        with interrupts.critical():
            self.validation_rng = None
            if val_metrics is not None:
                # logged here, not in validation: an interrupted one is repeated on resume
                self._log_validation(val_metrics, log)
            # after validation, which does not read the learning rate: an interrupt there
            # must find the scheduler as the epoch's last step left it
            if config["schedule"]["update"] == "epoch":
                self.scheduler.step()
            improved = False
            if val_metrics is not None:
                value = val_metrics[self.task.best_metric]
                improved = not math.isnan(value) and (self.best is None
                                                      or value > self.best["value"])
                if improved:
                    self.best = {"metric": self.task.best_metric, "value": value,
                                 "epoch": self.epoch + 1}
            self._write_snapshot(self.epoch + 1, 0, meter, val_metrics, improved, log)
            self.epoch += 1
            self.batches_done = 0


#: Files of a log directory written by replacing them (a folder there is refused up front).
_REPLACED = ("config.json", *(name + suffix for name in (LAST, BEST, PREVIOUS)
                              for suffix in ("", CHECKSUM_SUFFIX)))


def _snapshots(log_dir: Path) -> list[str]:
    """The snapshot files in ``log_dir`` (a fresh start there would replace them)."""
    return [name for name in (LAST, PREVIOUS, BEST) if (log_dir / name).exists()]


def _first_non_finite(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """The name of the first model or optimizer-state tensor with a NaN or an infinity, or
    None (one host sync when all are finite)."""
    named = [(f"weight {name}", t) for name, t in model.state_dict().items()]
    for index, state in enumerate(optimizer.state.values()):
        named += [(f"optimizer state {key} of parameter {index}", t)
                  for key, t in state.items() if isinstance(t, torch.Tensor)]
    named = [(name, t) for name, t in named if t.is_floating_point() and t.numel()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(t).all().to(named[0][1].device) for _, t in named])
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


def out_of_memory(error: RuntimeError) -> bool:
    """CUDA's ``OutOfMemoryError``, or the CPU allocator's failure (a plain RuntimeError)."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def _warn_if_not_bitwise(snapshot: dict[str, Any], device: torch.device) -> None:
    """One line on stderr when the resumed run cannot end bitwise as an uninterrupted one:
    another device type, or on CPU another intra-op thread count (CPU kernels split their
    sums by thread). Snapshots of older versions do not record them."""
    threads, kind = snapshot.get("threads"), snapshot.get("device")
    if kind is not None and kind != device.type:
        how = f"on {kind}, this run is on {device.type}"
    elif device.type == "cpu" and threads is not None and threads != torch.get_num_threads():
        how = (f"with {threads} torch thread(s), this run has {torch.get_num_threads()} (set "
               f"OMP_NUM_THREADS={threads} to match)")
    else:
        return
    print(f"iabn: warning: snapshot {snapshot.get(READ_FROM)} was written {how}: the resumed "
          f"run will not reach bitwise the weights of an uninterrupted one", file=sys.stderr,
          flush=True)


def train(task: Task, config: Config, options: TrainOptions) -> int:
    """Train ``task`` as ``config`` says; returns :data:`EXIT_FINISHED`, :data:`EXIT_STOPPED`
    or :data:`EXIT_INTERRUPTED`. Under ``torchrun`` every rank calls it. Bad input raises
    (ConfigError, SnapshotError, LogDirError, DeviceError, the task's data errors) before
    anything is written; :class:`TrainingFailed` once training went wrong."""
    check_engine_config(config)
    task.check_config(config, "config")
    ranks = start(options.device)
    finished = False
    run = None
    try:
        run = _Run(task, config, options, ranks)
        code = run.run()
        finished = True
        return code
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not out_of_memory(error):
            raise
        last = run.last_good if run is not None else None
        raise TrainingFailed(
            f"out of memory on {ranks.device} ({str(error).splitlines()[0][:200]}); lower "
            f"data.batch_size or the input size; the snapshots in {options.log_dir} are as "
            f"they were (the last: {last or 'none was written yet'})") from None
    finally:
        if run is not None:
            run.release()
        if finished:
            finish(ranks)
        elif dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["EXIT_FAILED", "EXIT_FINISHED", "EXIT_INTERRUPTED", "EXIT_STOPPED", "TrainOptions",
           "TrainingFailed", "out_of_memory", "train"]
