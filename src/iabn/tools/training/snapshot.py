"""Training snapshots: written atomically, read back with checks that name file and mismatch.

A snapshot is a ``torch.save``d dict holding ``format``/``version``, the ``task`` name, the
full ``config``, ``world_size``, the position (``epoch``, ``batches_done`` in that epoch,
``global_step``), the ``model``/``optimizer``/``scheduler``/``scaler`` state dicts, the best
validation result so far, the last validation metrics, per rank the RNG states and the
running training sums of a partial epoch, and ``dataset``: what the task says about its data
(:attr:`~iabn.tools.training.task.DataSplits.metadata`; segmentation: the label set). Only
tensors, numbers, strings and containers, so it loads with ``weights_only=True``.

Writing goes to a temporary file in the same folder, flushed to disk, then renamed over the
target: a run killed at any moment leaves either the old snapshot or the new one, never a
truncated file (at most a stale temporary, which the next run in that folder deletes).

Checksums: next to each snapshot ``NAME.pth``, ``NAME.pth.sha256`` holds its SHA-256 in
``sha256sum`` format (``sha256sum -c`` checks it), written after the snapshot. Before
``last.pth`` is replaced, the old one becomes ``previous.pth`` (with its checksum).
:func:`read_snapshot` verifies the checksum; when ``last.pth`` is corrupt (a bit flip, a
partial copy) or missing while ``previous.pth`` is good, it says so and returns the previous
one, so ``--resume`` continues from the snapshot before (repeating at most an epoch). A
snapshot without a checksum file (older iabn, or a kill between the two writes, after the
snapshot itself was complete) is read unverified.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...models.checkpoints import (
    CHECKSUM_SUFFIX,
    CheckpointError,
    checksum_path,
    file_sha256,
    read_checkpoint,
)
from ..arguments import LAST, RESUME_LAST, not_a_file
from .config import Config, differences

FORMAT = "iabn-training-snapshot"
VERSION = 1
BEST, PREVIOUS = "best.pth", "previous.pth"
#: Not in the file: the key :func:`read_snapshot` adds, naming the file it read (last.pth or,
#: when that is corrupt, previous.pth).
READ_FROM = "read_from"
# Keys that may change between a run and its resumption: they do not alter the training.
RESUME_MAY_CHANGE = ("logging", "data.workers", "data.val_batch_size")


#: The entries resuming reads (the engine's restore and :func:`check_resumable`); a snapshot
#: without one of them is refused as unreadable, so ``--resume`` falls back to previous.pth.
RESUME_KEYS = ("task", "config", "world_size", "epoch", "batches_done", "global_step",
               "model", "optimizer", "scheduler", "scaler", "best", "ranks")
#: The state dicts among them.
STATE_KEYS = ("model", "optimizer", "scheduler", "scaler")
#: What each rank's entry of ``ranks`` holds, and the generator states in its ``rng``
#: (:func:`iabn.tools.training.rng.capture_rng_state`).
RANK_KEYS = ("rng", "train_sums")
RNG_KEYS = ("torch", "cuda", "numpy", "python")
#: The entries evaluating or segmenting with a training snapshot's weights reads.
WEIGHT_KEYS = ("model", "config")


class SnapshotError(ValueError):
    """A snapshot that cannot be read or does not fit the run (the message says why)."""


def _names(keys: Sequence[str]) -> str:
    return ", ".join(map(repr, keys))


def require_keys(payload: dict[str, Any], path: str | Path, keys: Sequence[str], reader: str,
                 what: str = "snapshot", dicts: Sequence[str] = ()) -> None:
    """Raise :class:`SnapshotError` in one line naming ``path`` and the entries of ``keys``
    that the loaded training snapshot ``payload`` lacks (a hand-built, foreign or edited
    file), or those of ``dicts`` that are not dicts; ``reader`` says what reads them."""
    missing = [key for key in keys if key not in payload]
    if missing:
        plural = "entries" if len(missing) > 1 else "entry"
        raise SnapshotError(
            f"{what} {path} is marked as an iabn training snapshot but has no "
            f"{_names(missing)} {plural}, which {reader} reads: it was not written whole by "
            f"iabn train")
    for key in dicts:
        if not isinstance(payload[key], dict):
            raise SnapshotError(f"{what} {path}: its {key!r} entry is a "
                                f"{type(payload[key]).__name__}, not a dict, which {reader} "
                                f"reads")


def _check_resumable_layout(payload: dict[str, Any], path: Path) -> None:
    """Every entry the engine's restore reads is there, of the kind it reads (module doc)."""
    require_keys(payload, path, RESUME_KEYS, "resuming", dicts=(*STATE_KEYS, "config"))
    ranks, world_size = payload["ranks"], payload["world_size"]
    if not isinstance(ranks, (list, tuple)) or len(ranks) != world_size:
        count = f"a {type(ranks).__name__}"
        if isinstance(ranks, (list, tuple)):
            count = f"{len(ranks)} " + ("entry" if len(ranks) == 1 else "entries")
        raise SnapshotError(f"snapshot {path}: its 'ranks' entry holds {count}, not one per "
                            f"rank of its world_size {world_size!r}")
    for rank, entry in enumerate(ranks):
        where = f"snapshot {path}: ranks[{rank}]"
        if not isinstance(entry, dict):
            raise SnapshotError(f"{where} is a {type(entry).__name__}, not a dict")
        missing = [key for key in RANK_KEYS if key not in entry]
        if not missing and isinstance(entry["rng"], dict):
            missing = [f"rng.{key}" for key in RNG_KEYS if key not in entry["rng"]]
        elif not missing:
            missing = ["rng (a dict)"]
        if missing:
            raise SnapshotError(f"{where} has no {_names(missing)} (each rank's entry holds "
                                f"{_names(RANK_KEYS)}, the rng one {_names(RNG_KEYS)})")


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _replace_durably(temporary: Path, path: Path) -> None:
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def _write_checksum(path: Path, digest: str) -> None:
    target = checksum_path(path)
    temporary = _temporary(target)
    try:
        with open(temporary, "w") as file:
            file.write(f"{digest}  {path.name}\n")
            file.flush()
            os.fsync(file.fileno())
        _replace_durably(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _recorded_digest(path: Path) -> str | None:
    """The SHA-256 that ``path``'s checksum file records (None: no readable one)."""
    try:
        words = checksum_path(path).read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
    return words[0] if words else None


def _keep_previous(path: Path) -> None:
    """Before ``last.pth`` is replaced: the current one becomes ``previous.pth``, the
    fallback of a corrupt ``last.pth``, with a checksum file that names ``previous.pth`` (the
    digest ``last.pth``'s file recorded, not recomputed: a corrupt file stays detectable)."""
    if path.name != LAST or not path.is_file():
        return
    previous = path.with_name(PREVIOUS)
    digest = _recorded_digest(path)
    checksum_path(previous).unlink(missing_ok=True)
    os.replace(path, previous)
    checksum_path(path).unlink(missing_ok=True)
    if digest is not None:
        _write_checksum(previous, digest)


def _install(temporary: Path, path: Path) -> None:
    digest = file_sha256(temporary)
    _keep_previous(path)
    checksum_path(path).unlink(missing_ok=True)  # never a stale checksum next to a new file
    _replace_durably(temporary, path)
    _write_checksum(path, digest)


def _save(payload: dict[str, Any], file) -> None:
    """``torch.save``, a failed write of ``file`` reaching the caller as the ``OSError`` it
    is. When the disk fills part way through, torch's zip writer raises a ``RuntimeError``
    ("unexpected pos ...") from closing the archive, with the ``OSError`` (ENOSPC) as its
    context; the tools report ``OSError`` as a failed write and would show this one as a
    crash."""
    try:
        torch.save(payload, file)
    except RuntimeError as error:
        cause = error.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise cause from None


def save_atomic(payload: dict[str, Any], path: str | Path) -> None:
    """``torch.save(payload)`` to ``path`` via a temporary file and a rename, then its
    checksum file (``last.pth``: the old one kept as ``previous.pth``)."""
    path = Path(path)
    temporary = _temporary(path)
    try:
        with open(temporary, "wb") as file:
            _save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        _install(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def copy_atomic(source: str | Path, path: str | Path) -> None:
    """Copy ``source`` to ``path`` as :func:`save_atomic` writes."""
    path = Path(path)
    temporary = _temporary(path)
    try:
        shutil.copyfile(source, temporary)
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        _install(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete temporary snapshot files a killed run left in ``folder``; returns them. Call
    only while no other process writes snapshots there."""
    stale = sorted(Path(folder).glob(".*.pth.*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def read_snapshot(path: str | Path) -> dict[str, Any]:
    """Load a training snapshot (CPU tensors), or raise :class:`SnapshotError` naming the file
    and what is wrong with it. A corrupt or missing ``last.pth`` falls back to a good
    ``previous.pth`` next to it, with a warning on stderr (see module doc), and so does
    one that loads but lacks an entry resuming reads (:data:`RESUME_KEYS`, each rank's
    :data:`RANK_KEYS`)."""
    path = Path(path)
    try:
        payload = _read_verified(path)
        payload[READ_FROM] = str(path)
        return payload
    except SnapshotError as error:
        if path.name != LAST or not path.with_name(PREVIOUS).is_file():
            raise
        previous = path.with_name(PREVIOUS)
        try:
            payload = _read_verified(previous)
        except SnapshotError:
            raise error from None
        print(f"iabn: warning: {error}; resuming from the snapshot before it, {previous} "
              f"(epoch {payload.get('epoch')}, step {payload.get('global_step')})",
              file=sys.stderr, flush=True)
        payload[READ_FROM] = str(previous)
        return payload


def one_line(text: str) -> str:
    """``text``'s non-empty lines joined by "; " (torch's load errors span several lines)."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _read_verified(path: Path) -> dict[str, Any]:
    problem = not_a_file(path, "snapshot")
    if problem:
        raise SnapshotError(problem)
    try:  # (its checksum and the tensors' finiteness checked there)
        payload = read_checkpoint(path, "snapshot")
    except CheckpointError as error:
        raise SnapshotError(one_line(str(error))) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise SnapshotError(
            f"{path} is not an iabn training snapshot (no format={FORMAT!r} marker); plain "
            f"weights can be evaluated with 'iabn test' but not resumed")
    if payload.get("version") != VERSION:
        raise SnapshotError(f"snapshot {path} has format version {payload.get('version')}; "
                            f"this iabn reads version {VERSION}")
    _check_resumable_layout(payload, path)
    return payload


def check_resumable(snapshot: dict[str, Any], path: str | Path, task: str, config: Config,
                    world_size: int, may_change: Sequence[str] = RESUME_MAY_CHANGE) -> None:
    """Refuse to resume from a snapshot of another task, configuration or world size."""
    if snapshot["task"] != task:
        raise SnapshotError(f"snapshot {path} is from a {snapshot['task']!r} run, not "
                            f"{task!r}")
    changed = differences(snapshot["config"], config, ignore=may_change)
    if changed:
        raise SnapshotError(
            f"snapshot {path} was written with a different configuration ("
            + "; ".join(changed) + "): resume with the same config and DATA_ROOT (only "
            + ", ".join(may_change) + " may change), or start a new --log-dir")
    if snapshot["world_size"] != world_size:
        raise SnapshotError(
            f"snapshot {path} was written by {snapshot['world_size']} rank(s), this run has "
            f"{world_size}: resume with the same number of processes (its batch split and "
            f"random states are per rank)")


def load_state(target: Any, state: dict[str, Any], what: str, path: str | Path) -> None:
    """``target.load_state_dict(state)``, errors re-raised as :class:`SnapshotError` naming
    the snapshot and the part (``what``) that does not fit."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError) as error:
        raise SnapshotError(f"snapshot {path}: the {what} state does not fit: {error}"
                            ) from error

__all__ = ["BEST", "CHECKSUM_SUFFIX", "FORMAT", "LAST", "PREVIOUS", "READ_FROM", "RESUME_KEYS",
           "RESUME_LAST", "RESUME_MAY_CHANGE", "VERSION", "WEIGHT_KEYS", "SnapshotError",
           "check_resumable", "checksum_path", "copy_atomic", "file_sha256", "load_state",
           "not_a_file", "one_line", "read_snapshot", "remove_stale_temporaries",
           "require_keys", "save_atomic"]
