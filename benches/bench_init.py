"""Memory and time of building a model under ``zswap.Init(remote_device="nvme")`` (not run in CI).

Each measurement runs in a fresh subprocess, so peak RSS (``ru_maxrss``) belongs to that build alone; it is
reported minus the RSS right after ``import torch, zswap``. Baselines measured in the same run:

- model size, and the target peak RSS = 0.25 × model size + 300 MiB;
- a plain build of the same model in RAM (time), and the engine's write bandwidth on the same directory
  (the model's bytes written from engine buffers, queued all at once) — target build time under Init
  ≤ 1.2 × (model bytes / write bandwidth + plain build time).

Usage: ``python benches/bench_init.py [--path DIR] [--layers 16] [--in-features 4096] [--out-features 8192]``
(default DIR: a temp dir under /tmp, removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

MIB = 1 << 20


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _child(mode: str, path: str, layers: int, fin: int, fout: int) -> dict[str, Any]:
    import warnings

    import torch
    from torch import nn

    import zswap

    warnings.simplefilter("ignore", zswap.ZswapWarning)  # fallbacks are reported by the engine's info
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = _rss_bytes()

    def build() -> nn.Module:
        return nn.Sequential(*(nn.Linear(fin, fout) for _ in range(layers)))

    out: dict[str, Any] = {"base_rss": base}
    if mode == "plain":
        t0 = time.perf_counter()
        m = build()
        out["seconds"] = time.perf_counter() - t0
        out["bytes"] = sum(p.numel() * p.element_size() for p in m.parameters())
    elif mode == "zswap":
        cfg = {"offload_param": {"device": "nvme", "nvme_path": path}}
        t0 = time.perf_counter()
        with zswap.Init(cfg) as init:
            m = build()
        out["seconds"] = time.perf_counter() - t0
        st = zswap.param_state(m[0].weight)
        out["engine"] = {k: st.store.engine.info.get(k) for k in ("backend", "direct", "block_size")}
        out["bytes"] = sum(zswap.param_state(p).numel * 4 for p in m.parameters())
        del init
    elif mode == "bandwidth":
        nbytes = layers * (fin * fout + fout) * 4
        with zswap.SwapEngine(path) as eng:
            chunk = fin * fout * 4
            bufs = [eng.empty((chunk,), torch.uint8) for _ in range(2)]
            for b in bufs:
                b.fill_(1)
            t0 = time.perf_counter()
            handles, left, i = [], nbytes, 0
            while left > 0:
                n = min(chunk, left)
                handles.append(eng.write(f"k{i}", bufs[i % 2][:n]))
                left -= n
                i += 1
            for h in handles:
                h.wait()
            out["seconds"] = time.perf_counter() - t0
            out["bytes"] = nbytes
    out["peak_rss"] = _rss_bytes() - base
    return out


def _run(mode: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--path", path, "--layers", str(args.layers)]
    cmd += ["--in-features", str(args.in_features), "--out-features", str(args.out_features)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", help="nvme directory (default: a temp dir under /tmp, removed afterwards)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--in-features", type=int, default=4096)
    ap.add_argument("--out-features", type=int, default=8192)
    ap.add_argument("--child", choices=("plain", "zswap", "bandwidth"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.path, args.layers, args.in_features, args.out_features)))
        return
    tmp = None if args.path else tempfile.mkdtemp(prefix="zswap-bench-init-", dir="/tmp")
    path = args.path or tmp
    try:
        bw = _run("bandwidth", path, args)
        plain = _run("plain", path, args)
        zs = _run("zswap", path, args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    model = plain["bytes"]
    write_bw = bw["bytes"] / bw["seconds"]
    rss_target = 0.25 * model + 300 * MIB
    time_target = model / write_bw + plain["seconds"]
    print(f"model                 {model / MIB:10.0f} MiB  ({args.layers} x Linear({args.in_features}, "
          f"{args.out_features}), fp32); engine {zs['engine']}")  # fmt: skip
    print(f"write bandwidth       {write_bw / MIB:10.0f} MiB/s (SwapEngine, same dir, same bytes)")
    print(f"plain build           {plain['seconds']:10.2f} s    peak RSS {plain['peak_rss'] / MIB:8.0f} MiB")
    print(f"build under Init      {zs['seconds']:10.2f} s    peak RSS {zs['peak_rss'] / MIB:8.0f} MiB")
    print(f"peak RSS / target     {zs['peak_rss'] / rss_target:10.2f}      (target {rss_target / MIB:.0f} "
          f"MiB = 0.25 x model + 300 MiB; ratio to model {zs['peak_rss'] / model:.2f})")  # fmt: skip
    print(f"build time / target   {zs['seconds'] / time_target:10.2f}      (target {time_target:.2f} s = "
          f"model / write bw + plain build; must be <= 1.2)")  # fmt: skip


if __name__ == "__main__":
    main()
