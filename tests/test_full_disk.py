"""Writes of torch archives that fail for want of space (simulated with ``RLIMIT_FSIZE``: a write past the
limit fails with ``EFBIG``, as a full disk fails with ``ENOSPC``): an `OSError` (a `zswap.SwapIOError`)
naming the file the caller asked for, and the process goes on. torch's archive writer, left unfinished
by a failed write, writes its end again when it is destroyed and aborts the process when that fails too;
a path it opens itself turns the failure into "unexpected pos". Each case runs in a child process (the
limit holds for the whole process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zswap

CHILD = r"""
import os, resource, signal, sys, warnings
import torch
import zswap.deepspeed as deepspeed
from zswap.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
warnings.simplefilter("ignore")
d, case = sys.argv[1], sys.argv[2]
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0,
       "zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=cfg):
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))  # 2 MiB of fp32
engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
if case == "fp32":
    engine.save_checkpoint(os.path.join(d, "ck"))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
try:
    if case == "16bit":
        engine.save_16bit_model(os.path.join(d, "out"))
    else:
        convert_zero_checkpoint_to_fp32_state_dict(
            os.path.join(d, "ck"), os.path.join(d, "out"), safe_serialization=False
        )
except OSError as e:
    print(f"raised {type(e).__name__} errno={e.errno} {e}", flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print("alive", sorted(os.listdir(os.path.join(d, "out"))), flush=True)
engine.close()
"""


def _run(tmp_path: Path, case: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(zswap.__file__).parents[1])}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), case],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


def test_a_16bit_save_that_runs_out_of_space_raises_and_the_process_goes_on(tmp_path):
    raised, alive = _run(tmp_path, "16bit")
    assert raised.startswith("raised SwapIOError errno=27 ") and "out/pytorch_model.bin" in raised, raised
    assert alive == "alive []"  # nothing half-written left under any name


def test_a_bin_conversion_that_runs_out_of_space_names_the_file(tmp_path):
    raised, alive = _run(tmp_path, "fp32")
    assert raised.startswith("raised SwapIOError errno=27 [Errno 27] cannot write "), raised
    assert "out/pytorch_model.bin: File too large" in raised and "unexpected pos" not in raised
    assert alive == "alive []"
