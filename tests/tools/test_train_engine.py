"""The generic engine with a toy regression task (the Task interface without images).

The engine's weights are compared with a training loop written out here from the documented
contract (data order = permutation of (seed, epoch), closed-form learning rate, clipping,
no weight decay on norm layers); resume after a stop or a signal must be bitwise exact.
"""

import json
import os
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import iabn
from iabn.tools.training.config import ENGINE_SCHEMA, defaults
from iabn.tools.training.engine import EXIT_FINISHED, EXIT_STOPPED, TrainOptions, train
from iabn.tools.training.snapshot import SnapshotError
from iabn.tools.training.task import DataSplits

# the engine picks CUDA when it sees one; these check its CPU runs.
pytestmark = pytest.mark.without_gpu

TRAIN, VAL, FEATURES, SEED = 48, 10, 4, 3


class ToyData(Dataset):
    """``y = x @ w + noise`` with fixed ``x``; keys may be ``(index, seed)`` pairs."""

    def __init__(self, count: int, offset: int) -> None:
        generator = torch.Generator().manual_seed(100 + offset)
        self.x = torch.randn(count, FEATURES, generator=generator)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(
            count, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, key):
        index = key[0] if isinstance(key, tuple) else key
        return self.x[index], self.y[index]


class SquaredErrorMeter:
    def __init__(self, device):
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)

    def update(self, outputs, targets, loss):
        self.sums += torch.stack([loss.double() * len(targets),
                                  torch.tensor(float(len(targets)), dtype=torch.float64)])

    def summarize(self, sums):
        loss = (sums[0] / sums[1]).item()
        return {"loss": loss, "neg_loss": -loss, "count": sums[1].item()}


class ToyTask:
    name, schema, best_metric = "toy", {}, "neg_loss"

    def __init__(self, signal_at_step=None):
        self.signal_at_step, self.training_forwards = signal_at_step, 0

    def check_config(self, config, source):
        pass

    def datasets(self, config):
        return DataSplits(ToyData(TRAIN, 0), ToyData(VAL, 1), 1, "toy regression")

    def build_model(self, config, splits, ranks):
        return toy_model()

    def forward(self, model, inputs):
        if model.training:
            self.training_forwards += 1
            if self.training_forwards == self.signal_at_step:
                os.kill(os.getpid(), signal.SIGTERM)
        return model(inputs).squeeze(1)

    def loss(self, outputs, targets):
        return F.mse_loss(outputs.float(), targets)

    def new_meter(self, device):
        return SquaredErrorMeter(device)


def toy_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.LayerNorm(8), nn.Linear(8, 1))


def toy_config(**sections) -> dict:
    config = defaults(ENGINE_SCHEMA)
    config["optimizer"].update(lr=0.05, weight_decay=0.01, clip_grad_norm=0.5)
    config["schedule"].update(epochs=3, type="cosine", update="step", warmup_epochs=1.0,
                              final_lr=0.001)
    config["data"].update(batch_size=12, workers=0, seed=SEED)
    config["logging"].update(tensorboard=False, progress=False, log_every=2)
    for section, values in sections.items():
        config[section].update(values)
    return config


def _model_state(path):
    return torch.load(path, weights_only=True)["model"]


def reference_weights(config) -> dict:
    """The same training written out by hand."""
    torch.manual_seed(SEED)
    model = toy_model()
    norm = model[1]
    exempt = {id(p) for p in norm.parameters()}
    optimizer = torch.optim.SGD(
        [{"params": [p for p in model.parameters() if id(p) not in exempt],
          "weight_decay": 0.01},
         {"params": list(norm.parameters()), "weight_decay": 0.0}],
        lr=0.05, momentum=0.9, nesterov=True)
    data = ToyData(TRAIN, 0)
    steps_per_epoch, total, warmup = TRAIN // 12, 3 * (TRAIN // 12), TRAIN // 12
    t = 0
    for epoch in range(3):
        order = np.random.default_rng([SEED, epoch]).permutation(TRAIN)
        for step in range(steps_per_epoch):
            lr = 0.001 + (0.05 - 0.001) * (1 + np.cos(np.pi * t / total)) / 2
            if t < warmup:
                lr *= 0.1 + 0.9 * t / warmup
            for group in optimizer.param_groups:
                group["lr"] = lr
            index = torch.from_numpy(order[step * 12:(step + 1) * 12])
            optimizer.zero_grad()
            F.mse_loss(model(data.x[index]).squeeze(1), data.y[index]).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            t += 1
    return model.state_dict()


def test_engine_trains_like_the_loop_written_out(tmp_path):
    config = toy_config()
    assert train(ToyTask(), config, TrainOptions(tmp_path)) == EXIT_FINISHED
    got, expected = _model_state(tmp_path / "last.pth"), reference_weights(config)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_snapshots_logs_and_best_are_written(tmp_path):
    config = toy_config()
    train(ToyTask(), config, TrainOptions(tmp_path))
    last = torch.load(tmp_path / "last.pth", weights_only=True)
    assert (last["epoch"], last["batches_done"], last["global_step"]) == (3, 0, 12)
    best = torch.load(tmp_path / "best.pth", weights_only=True)
    assert best["best"]["value"] == best["val_metrics"]["neg_loss"]
    assert last["best"] == best["best"]  # the best so far is carried on
    assert last["val_metrics"]["count"] == VAL
    assert json.loads((tmp_path / "config.json").read_text()) == config
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "epoch 3 val: loss" in log and "finished 3 epochs" in log


def test_figures_in_the_console_and_log_are_rounded(tmp_path, capsys):
    """Metrics, the learning rate and the best value are shown to 4 significant digits (the
    snapshot keeps the full value): no figure in the output or the log has 5 or more digits
    after its decimal point, nor more than 4 significant ones."""
    import re

    train(ToyTask(), toy_config(), TrainOptions(tmp_path))
    console = capsys.readouterr().out
    log = (tmp_path / "logs" / "rank0.log").read_text()
    best = torch.load(tmp_path / "last.pth", weights_only=True)["best"]
    assert f"best neg_loss {best['value']:.4g} (epoch {best['epoch']})" in console
    assert len(repr(best["value"])) > 8  # a value that rounding shortens
    # a decimal figure, not a date or version: digits '.' digits, not part of a longer token
    figures = re.findall(r"(?<![\w.])-?\d+\.\d+(?:e-?\d+)?(?![\w.])", console + log)
    assert figures  # the check sees the metrics
    long = [f for f in figures
            if len(f.split("e")[0].lstrip("-").replace(".", "").lstrip("0")) > 4]
    assert not long, long


def _assert_same_weights(a, b):
    state_a, state_b = _model_state(a), _model_state(b)
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


@pytest.mark.parametrize("stop_at", [2, 4, 5])  # mid-epoch, at an epoch's end, next epoch
def test_stop_and_resume_is_bitwise_exact(tmp_path, stop_at):
    config = toy_config()
    train(ToyTask(), config, TrainOptions(tmp_path / "whole"))
    run = tmp_path / "run"
    assert train(ToyTask(), config, TrainOptions(run, stop_after_steps=stop_at)) == EXIT_STOPPED
    stopped = torch.load(run / "last.pth", weights_only=True)
    assert stopped["global_step"] == stop_at
    assert train(ToyTask(), config, TrainOptions(run, resume=run / "last.pth")) == EXIT_FINISHED
    _assert_same_weights(tmp_path / "whole" / "last.pth", run / "last.pth")


def test_sigterm_stops_after_the_step_with_a_snapshot(tmp_path):
    config = toy_config()
    train(ToyTask(), config, TrainOptions(tmp_path / "whole"))
    run = tmp_path / "run"
    assert train(ToyTask(signal_at_step=6), config, TrainOptions(run)) == EXIT_STOPPED
    assert torch.load(run / "last.pth", weights_only=True)["global_step"] == 6
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers are put back
    train(ToyTask(), config, TrainOptions(run, resume=run / "last.pth"))
    _assert_same_weights(tmp_path / "whole" / "last.pth", run / "last.pth")


def test_resume_with_another_config_is_refused_before_anything_is_written(tmp_path):
    config = toy_config()
    train(ToyTask(), config, TrainOptions(tmp_path, stop_after_steps=3))
    files = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    log = (tmp_path / "logs" / "rank0.log").read_text()
    with pytest.raises(SnapshotError, match=r"last.pth was written with a different "
                                            r"configuration \(optimizer.lr: 0.05 -> 0.1\)"):
        train(ToyTask(), toy_config(optimizer={"lr": 0.1}),
              TrainOptions(tmp_path, resume=tmp_path / "last.pth"))
    with pytest.raises(SnapshotError, match=r"already holds a run.*--resume"):
        train(ToyTask(), config, TrainOptions(tmp_path))
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == files
    assert (tmp_path / "logs" / "rank0.log").read_text() == log


def test_a_snapshot_without_a_newer_key_resumes_at_its_default(tmp_path):
    """Snapshots written before a config key existed (e.g. data.dataset) still resume when
    the run uses that key's default; another value is still refused."""
    config = toy_config()
    train(ToyTask(), config, TrainOptions(tmp_path / "whole"))
    run = tmp_path / "run"
    train(ToyTask(), config, TrainOptions(run, stop_after_steps=3))
    snapshot = torch.load(run / "last.pth", weights_only=True)
    del snapshot["config"]["optimizer"]["eps"]
    torch.save(snapshot, run / "last.pth")
    (run / "last.pth.sha256").unlink()  # edited by hand: its checksum no longer fits
    with pytest.raises(SnapshotError, match=r"optimizer.eps: 1e-08 -> 0.001"):
        train(ToyTask(), toy_config(optimizer={"eps": 1e-3}),
              TrainOptions(run, resume=run / "last.pth"))
    assert train(ToyTask(), config, TrainOptions(run, resume=run / "last.pth")) == EXIT_FINISHED
    _assert_same_weights(tmp_path / "whole" / "last.pth", run / "last.pth")


def test_batch_that_does_not_fit_the_data_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"data.batch_size=64: .*larger than the 48 samples"):
        train(ToyTask(), toy_config(data={"batch_size": 64}), TrainOptions(tmp_path))
    assert not tmp_path.joinpath("logs").exists()


def test_bf16_autocast_trains_close_to_fp32(tmp_path):
    train(ToyTask(), toy_config(), TrainOptions(tmp_path / "fp32"))
    train(ToyTask(), toy_config(network={"precision": "bf16"}), TrainOptions(tmp_path / "bf16"))
    full = _model_state(tmp_path / "fp32" / "last.pth")
    for key, value in _model_state(tmp_path / "bf16" / "last.pth").items():
        torch.testing.assert_close(value, full[key], atol=0.05, rtol=0.05, msg=key)


def test_fp16_loss_scaling_is_saved_and_resumed_exactly(tmp_path):
    config = toy_config(network={"precision": "fp16"})
    train(ToyTask(), config, TrainOptions(tmp_path / "whole"))
    run = tmp_path / "run"
    train(ToyTask(), config, TrainOptions(run, stop_after_steps=5))
    scaler = torch.load(run / "last.pth", weights_only=True)["scaler"]
    # The scale starts at 2**16 and halves at every overflowing step.
    assert 0 < scaler["scale"] <= 2.0**16
    train(ToyTask(), config, TrainOptions(run, resume=run / "last.pth"))
    _assert_same_weights(tmp_path / "whole" / "last.pth", run / "last.pth")


@pytest.mark.parametrize("update", ["step", "epoch"])
def test_fp16_skipped_steps_do_not_step_the_schedule_ahead(tmp_path, update):
    """fp16's loss scaler skips the first steps (their scaled gradients overflow): the
    schedule advances once per applied step only, so PyTorch has no reason to warn that
    lr_scheduler.step() came before optimizer.step()."""
    import math
    import warnings

    # batches of 4: 12 steps an epoch, more than the scaler skips at the start (a per-epoch
    # schedule steps after every epoch, applied or not)
    config = toy_config(network={"precision": "fp16"}, schedule={"update": update},
                        data={"batch_size": 4})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(ToyTask(), config, TrainOptions(tmp_path))
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "lr_scheduler.step()" in m], messages
    snapshot = torch.load(tmp_path / "last.pth", weights_only=True)
    # GradScaler halves its scale (2**16 at first) at every skipped step and grows it only
    # after 2000 good ones: the halvings count the skipped steps
    skipped = round(math.log2(2.0**16 / snapshot["scaler"]["scale"]))
    assert skipped >= 1  # the case this checks: the first step is skipped
    steps, epochs = 3 * TRAIN // 4, 3
    expected = steps - skipped if update == "step" else epochs
    assert snapshot["scheduler"]["last_epoch"] == expected


class ToyImages(ToyData):
    """The same targets from ``[3, 4, 4]`` images whose mean colour carries the features."""

    def __getitem__(self, key):
        x, y = super().__getitem__(key)
        return x[:3, None, None].expand(3, 4, 4) + 0.1 * x[3], y


class ToyImageTask(ToyTask):
    def datasets(self, config):
        return DataSplits(ToyImages(TRAIN, 0), ToyImages(VAL, 1), 1, "toy images")

    def build_model(self, config, splits, ranks):
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), iabn.InPlaceABN(8),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 1))


def test_channels_last_trains_the_same_model(tmp_path):
    train(ToyImageTask(), toy_config(), TrainOptions(tmp_path / "contiguous"))
    train(ToyImageTask(), toy_config(network={"channels_last": True}),
          TrainOptions(tmp_path / "channels_last"))
    reference = _model_state(tmp_path / "contiguous" / "last.pth")
    state = _model_state(tmp_path / "channels_last" / "last.pth")
    assert state["0.weight"].is_contiguous(memory_format=torch.channels_last)
    assert not reference["0.weight"].is_contiguous(memory_format=torch.channels_last)
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)
