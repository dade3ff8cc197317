"""DDP training under torchrun on CPU (gloo) follows the single-process loss curve."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# torchrun with gloo on CPU; the tools would pick NCCL and CUDA if visible.
pytestmark = pytest.mark.without_gpu

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "ddp_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, out):
    subprocess.run([sys.executable, *args, str(SCRIPT), str(out)], check=True, timeout=300)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_torchrun_two_ranks_matches_single_process(tmp_path):
    single = _run([], tmp_path / "single.json")
    ddp = _run(["-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(_free_port())], tmp_path / "ddp.json")
    assert ddp["world"] == 2 and single["world"] == 1
    torch.testing.assert_close(torch.tensor(ddp["losses"]), torch.tensor(single["losses"]),
                               atol=1e-10, rtol=0)
    assert single["losses"][-1] < single["losses"][0]  # it did train
    for key, value in single["state"].items():
        torch.testing.assert_close(torch.tensor(ddp["state"][key]), torch.tensor(value),
                                   atol=1e-9, rtol=0, msg=key)
