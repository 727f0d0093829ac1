"""The README's quickstart: a small model built under zswap.Init with its params and AdamW states on NVMe
(a temp dir here), five training steps, then the weights saved for plain `from_pretrained`/safetensors."""

import pathlib
import tempfile

import torch

import zswap

swap = tempfile.mkdtemp(prefix="zswap-quickstart-")  # use a directory on your NVMe drive here
config = {
    "zero_optimization": {
        "offload_param": {"device": "nvme", "nvme_path": swap},
        "offload_optimizer": {"device": "nvme", "nvme_path": swap},
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
}

torch.manual_seed(0)
with zswap.Init(config):  # each layer's params go to NVMe as the layer is built
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
engine = zswap.initialize(model, config)  # hooks that stream params in; AdamW over NVMe-resident states

x, y = torch.randn(64, 512), torch.randn(64, 512)
for step in range(5):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    engine.step()
    print(f"step {step}: loss {loss.item():.4f}")

stats = engine.stats()
print(f"read {stats['bytes_read'] / 2**20:.1f} MiB, wrote {stats['bytes_written'] / 2**20:.1f} MiB")
engine.close()
zswap.save_weights(model, f"{swap}/weights")  # Hugging Face layout, readable without zswap
print("saved", sorted(p.name for p in pathlib.Path(swap, "weights").iterdir()))
