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
is acted on at the next ``logging.log_every`` boundary, where the ranks agree to stop. A run
killed outright resumes from the last epoch's snapshot and repeats the partial epoch.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..data.samplers import ExactShardSampler, ShuffledShardSampler
from .config import ENGINE_SCHEMA, Config, ConfigError, check_engine_config, combine, with_defaults
from .logdir import LogDirError, LogDirLock, check_writable
from .logs import RunLog, peak_memory_mib, summary_writer_class
from .loops import autocast, evaluate, memory_format, to_device
from .optim import build_optimizer
from .progress import ProgressLine, bar
from .ranks import Ranks, all_reduce_sum, any_rank, finish, gather_objects, start
from .rng import capture_rng_state, restore_rng_state, seed_everything
from .schedules import build_scheduler
from .snapshot import (
    BEST,
    FORMAT,
    LAST,
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
EXIT_STOPPED = 3
"""Exit status of a run stopped early with a snapshot written (``--resume`` continues it)."""


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


@contextmanager
def _stop_requests(log: RunLog):
    """A flag set by SIGINT/SIGTERM while training (a second SIGINT interrupts at once)."""
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested  # signals can only be handled in the main thread
        return

    def handle(signum: int, frame: Any) -> None:
        if requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.set()
        log.info(f"{signal.Signals(signum).name}: stopping after this step and writing "
                 f"{LAST} (resume with --resume)")

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
        self.optimizer = build_optimizer(self.model, config["optimizer"])
        self.scheduler = build_scheduler(self.optimizer, config["schedule"],
                                         self.sampler.batches_per_epoch)
        self.scaler = torch.amp.GradScaler(ranks.device.type,
                                           enabled=network["precision"] == "fp16")
        self.epoch, self.batches_done, self.global_step = 0, 0, 0
        self.best: dict[str, Any] | None = None
        self.resumed_sums: torch.Tensor | None = None
        # The loader draws its workers' base seed from this generator, not from the global
        # torch RNG, whose state must only change with the training itself.
        self.loader_generator = torch.Generator()
        if snapshot is None:
            # Ranks differ in their random streams (dropout), rank 0 matches a single process.
            seed_everything(data["seed"] + ranks.rank)
        else:
            self._restore(snapshot)
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
                if self.options.resume is None and (self.options.log_dir / LAST).exists():
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
        path = self.options.resume
        if path is None:
            if (self.options.log_dir / LAST).exists():
                raise SnapshotError(
                    f"{self.options.log_dir} already holds a run ({LAST}): continue it with "
                    f"--resume, or choose another --log-dir")
            return None
        snapshot = read_snapshot(path)
        # keys added to the schema since the snapshot was written count at their defaults
        snapshot["config"] = with_defaults(snapshot["config"],
                                           combine(ENGINE_SCHEMA, self.task.schema))
        check_resumable(snapshot, path, self.task.name, self.config, self.ranks.world_size)
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

    # ------------------------------------------------------------------ writing
    def _write_snapshot(self, epoch: int, batches_done: int, meter: Meter,
                        val_metrics: dict[str, float] | None, improved: bool) -> None:
        """``last.pth`` (and ``best.pth`` when ``improved``) for the position ``batches_done``
        into ``epoch``; every rank must call it."""
        per_rank = gather_objects({"rng": capture_rng_state(),
                                   "train_sums": meter.sums.detach().cpu()}, self.ranks)
        if not self.ranks.is_main:
            return
        payload = {
            "format": FORMAT, "version": VERSION, "task": self.task.name,
            "config": self.config, "world_size": self.ranks.world_size,
            "epoch": epoch, "batches_done": batches_done,
            "global_step": self.global_step,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "best": self.best, "val_metrics": val_metrics, "ranks": per_rank,
            "dataset": self.splits.metadata,
        }
        log_dir = self.options.log_dir
        if improved:
            # best.pth first: a kill between the two writes then leaves last.pth one epoch
            # behind, and resuming repeats that epoch and rewrites best.pth the same way.
            save_atomic(payload, log_dir / BEST)
            copy_atomic(log_dir / BEST, log_dir / LAST)
        else:
            save_atomic(payload, log_dir / LAST)

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
        clip = self.config["optimizer"]["clip_grad_norm"]
        if clip is not None:
            self.scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.config["schedule"]["update"] == "step":
            self.scheduler.step()
        meter.update(outputs.detach(), targets, loss.detach())

    def _sync_buffers(self) -> None:
        """Give every rank rank 0's BN statistics (unsynchronised BN drifts apart per rank)
        so validation is the same whichever rank holds a sample."""
        if self.ranks.distributed:
            for buffer in self.model.buffers():
                dist.broadcast(buffer, 0)

    def _validate(self, val_loader: _ShieldedLoader, log: RunLog,
                  progress: ProgressLine) -> dict[str, float]:
        self._sync_buffers()
        network = self.config["network"]
        metrics = evaluate(self.task, self.model, val_loader, self.ranks,
                           network["precision"], network["channels_last"], progress,
                           len(val_loader))
        log.scalars({f"val/{k}": v for k, v in metrics.items() if k != "count"},
                    self.global_step)
        log.info(f"epoch {self.epoch + 1} val: {_format_metrics(metrics)} "
                 f"({int(metrics['count'])} samples)")
        return metrics

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
        try:
            options.log_dir.mkdir(parents=True, exist_ok=True)
            if ranks.is_main:
                remove_stale_temporaries(options.log_dir)
            log = RunLog(options.log_dir, ranks, config["logging"]["tensorboard"],
                         # the snapshot's own step was logged before it was written: keep
                         # it, drop only what a killed run logged after it
                         purge_step=self.global_step + 1 if options.resume else None)
        except OSError as error:  # e.g. a read-only folder inside a writable one
            raise LogDirError(f"cannot write in --log-dir {options.log_dir}: "
                              f"{error.strerror or error} ({error.filename or ''})") from None
        try:
            if ranks.is_main:
                (options.log_dir / "config.json").write_text(json.dumps(config, indent=2))
            log.info(f"{'resuming' if options.resume else 'starting'} at epoch "
                     f"{self.epoch + 1}, step {self.global_step}; {self.splits.description}; "
                     f"{ranks.world_size} rank(s) on {ranks.device}; log dir {options.log_dir}")
            with _stop_requests(log) as requested:
                return self._epochs(log, requested)
        finally:
            log.close()

    def _epochs(self, log: RunLog, requested: threading.Event) -> int:
        config, ranks = self.config, self.ranks
        progress = ProgressLine(config["logging"]["progress"] and ranks.is_main)
        train_loader, val_loader = self._loaders()
        epochs, log_every = config["schedule"]["epochs"], config["logging"]["log_every"]
        seed = config["data"]["seed"]
        for epoch in range(self.epoch, epochs):
            self.epoch = epoch
            self.sampler.set_epoch(self.epoch, self.batches_done)
            self.loader_generator.manual_seed(
                int(np.random.SeedSequence([seed, self.epoch]).generate_state(1)[0]))
            meter = self.task.new_meter(ranks.device)
            if self.resumed_sums is not None:
                meter.sums.copy_(self.resumed_sums)
                self.resumed_sums = None
            self.trained.train()
            started, images = time.perf_counter(), 0
            for batch in train_loader:
                self._train_step(batch, meter)
                self.batches_done += 1
                self.global_step += 1
                images += self.sampler.per_rank * ranks.world_size
                boundary = (self.batches_done % log_every == 0
                            or self.batches_done == self.sampler.batches_per_epoch)
                if boundary:
                    self._report(meter, log, progress, images, time.perf_counter() - started)
                    started, images = time.perf_counter(), 0
                if self._should_stop(requested, boundary):
                    progress.end()
                    self._write_snapshot(self.epoch, self.batches_done, meter, None, False)
                    log.info(f"stopped at epoch {self.epoch + 1}, step {self.global_step}: "
                             f"{self.options.log_dir / LAST} written; continue with --resume")
                    return EXIT_STOPPED
            progress.end()
            self._end_epoch(meter, val_loader, log, progress)
        best = self.best or {}
        log.info(f"finished {epochs} epochs; best {best.get('metric')} {best.get('value')} "
                 f"(epoch {best.get('epoch')}); snapshots in {self.options.log_dir}")
        return EXIT_FINISHED

    def _end_epoch(self, meter: Meter, val_loader: _ShieldedLoader, log: RunLog,
                   progress: ProgressLine) -> None:
        config = self.config
        if config["schedule"]["update"] == "epoch":
            self.scheduler.step()
        train_metrics = meter.summarize(all_reduce_sum(meter.sums, self.ranks))
        log.info(f"epoch {self.epoch + 1} train: {_format_metrics(train_metrics)}")
        last = self.epoch + 1 == config["schedule"]["epochs"]
        val_metrics, improved = None, False
        if last or (self.epoch + 1) % config["logging"]["val_every"] == 0:
            val_metrics = self._validate(val_loader, log, progress)
            value = val_metrics[self.task.best_metric]
            improved = not math.isnan(value) and (self.best is None
                                                  or value > self.best["value"])
            if improved:
                self.best = {"metric": self.task.best_metric, "value": value,
                             "epoch": self.epoch + 1}
        self.batches_done = 0
        self._write_snapshot(self.epoch + 1, 0, meter, val_metrics, improved)


def train(task: Task, config: Config, options: TrainOptions) -> int:
    """Train ``task`` as ``config`` says; returns :data:`EXIT_FINISHED` or
    :data:`EXIT_STOPPED`. Under ``torchrun`` every rank calls it. Bad input raises
    (ConfigError, SnapshotError, the task's data errors) before anything is written."""
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
    finally:
        if run is not None:
            run.release()
        if finished:
            finish(ranks)
        elif dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["EXIT_FINISHED", "EXIT_STOPPED", "TrainOptions", "train"]
