"""Loading a safetensors checkpoint with ``from_pretrained`` under ``zswap.Init(nvme)`` (not run in CI).

A Llama checkpoint of ``--size`` MiB (float32, 64 MiB shards with an index) is written from random tensors,
then each measurement runs in a fresh subprocess with the checkpoint's pages dropped from the page cache
(``posix_fadvise(DONTNEED)`` after ``fsync``), so every run reads it from the disk. Peak RSS is the kernel's
high-water mark of the child's address space (``VmHWM``, reset right before the load), minus its RSS then.
Baselines measured in the same run:

- reading the same bytes: ``fio`` (sequential, 1 MiB blocks, buffered, as the loader reads) when it is
  installed, else the same bytes read with ``pread`` into one reused 4 MiB buffer. This is the baseline of a
  load under ``Init(cpu)`` (params land in memory: it only reads);
- the same work a load under ``Init(nvme)`` does: ``fio`` reading the checkpoint as above while a second
  job writes the same number of bytes to a new file in the swap folder with the swap engine's settings
  (``O_DIRECT``, its block size and queue depth, io_uring), timed until both finish. The disk shares its
  bandwidth between the two, so this is the like-for-like baseline of the nvme load; the read-only ratio
  is printed too;
- a load under ``Init(cpu)`` (time, peak RSS: the params are the model's bytes in memory);
- a plain ``from_pretrained`` of the same checkpoint (time, peak RSS): as returned (transformers leaves the
  weights memory-mapped, so nothing is read yet), and after touching every weight once (what the first forward
  does — each page is then read and counted in RSS);
- the target peak RSS = 0.25 × model + 300 MiB, and the target load rate ≥ 0.7 × the read rate;
- both loads again in processes that first loaded a tiny checkpoint of the same class ("transformers
  warmed"): transformers' one-time work per process (its weight-conversion tables, ~1000 regular
  expressions compiled on the first ``from_pretrained``, and lazy imports) is then paid outside the timing,
  which leaves what a load of this checkpoint costs by itself.

Each contender runs ``--repeat`` times, interleaved with the others (a slow spell of the disk then hits them
alike), and its fastest run is reported, with the highest peak RSS of its runs.

Usage: ``python benches/bench_pretrained.py [--path DIR] [--size 1024] [--repeat 3]`` (DIR holds the
checkpoint and the swap; default a temp dir under /tmp, removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
HIDDEN, FFN, VOCAB = 1024, 2816, 16384


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Reset this address space's peak RSS (``VmHWM``) to its current RSS and return that.

    ``ru_maxrss`` alone misleads in a child: it is the larger of this address space's peak and the peak of
    the one it replaced at ``exec`` — the forked copy of the parent, which here wrote the checkpoint."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak-RSS counter
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return _status("VmRSS")


def peak() -> int:
    try:
        return _status("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_checkpoint(path: Path, size: int) -> int:
    import torch
    import transformers
    from safetensors.torch import save_file

    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN
    layers = max(1, round((size / 4 - 2 * VOCAB * HIDDEN) / per_layer))
    cfg = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    path.mkdir(parents=True)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in transformers.LlamaForCausalLM(cfg).named_parameters()}
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0
    for n, shape in shapes.items():
        shard[n] = torch.randn(shape) * 0.02
        total += shard[n].numel() * 4
        if sum(t.numel() for t in shard.values()) * 4 >= 64 * MIB:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, path / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard = {}
    if shard:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def drop_cache(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _child(mode: str, ckpt: str, swap: str) -> dict[str, Any]:
    import warnings

    import transformers

    import zswap

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore", zswap.ZswapWarning)
    files = sorted(Path(ckpt).glob("*.safetensors"))
    out: dict[str, Any] = {"bytes": sum(f.stat().st_size for f in files)}
    warm = mode.endswith("-warm")
    mode = mode.removesuffix("-warm")
    nvme = {"offload_param": {"device": "nvme", "nvme_path": swap}}
    cfg = {"zswap": nvme, "zswap-cpu": {"offload_param": {"device": "cpu"}}, "engine": nvme}.get(mode)
    init = zswap.Init(cfg) if cfg is not None else None
    if (
        mode == "engine"
    ):  # the settings Init(nvme)'s swap engine resolves to on this disk, for fio's write job
        assert init is not None
        info = init._placement.store.engine.info
        return {k: info[k] for k in ("backend", "direct", "block_size", "queue_depth", "threads")}
    config = transformers.AutoConfig.from_pretrained(ckpt)
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # its module imported before the base
    if warm:  # transformers' one-time work (conversion tables, lazy imports) paid on a tiny checkpoint first
        tiny = Path(swap) / "tiny"
        if init is not None:
            with zswap.Init(cfg):
                cls.from_pretrained(tiny)
        else:
            cls.from_pretrained(tiny)
    base = reset_peak()
    t0 = time.perf_counter()
    if mode == "read":
        buf = bytearray(4 * MIB)
        view = memoryview(buf)
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                off = 0
                while n := os.preadv(fd, [view], off):
                    off += n
            finally:
                os.close(fd)
    elif mode in ("plain", "plain-touched"):
        m = cls.from_pretrained(ckpt)
        if mode == "plain-touched":  # what the first forward does: every weight's pages come in
            out["checksum"] = float(sum(p.detach().float().sum() for p in m.parameters()))
    else:
        assert init is not None
        with init:
            m = cls.from_pretrained(ckpt)
        if mode == "zswap":
            out["engine"] = {k: init._placement.store.engine.info.get(k) for k in ("backend", "direct")}
        out["partitioned"] = all(zswap.param_state(p) is not None for p in m.parameters())
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss"] = peak() - base
    return out


def write_tiny(path: Path) -> None:
    """A one-layer Llama of the bench's class, to pay transformers' one-time loading work on."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def fio_read(ckpt: Path) -> dict[str, Any] | None:
    if shutil.which("fio") is None:
        return None
    files = sorted(ckpt.glob("*.safetensors"))
    cmd = [
        "fio",
        "--name=read",
        "--rw=read",
        "--bs=1M",
        "--ioengine=psync",
        "--direct=0",
        "--output-format=json",
    ]
    cmd += ["--filename=" + ":".join(str(f) for f in files)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return None
    job = json.loads(r.stdout)["jobs"][0]["read"]
    return {"bytes": job["io_bytes"], "seconds": job["runtime"] / 1000}


def fio_read_write(ckpt: Path, swap: Path, nbytes: int, engine: dict[str, Any]) -> dict[str, Any] | None:
    """The work of a load under ``Init(nvme)`` done by fio: read the checkpoint (as `fio_read`) while a
    second job writes ``nbytes`` to a new file in the swap folder with the engine's settings (``O_DIRECT``
    when the engine uses it, its block size, its queue depth through io_uring; a psync engine's
    ``queue_depth`` threads as as many jobs). Timed until both jobs finish; the file is removed after."""
    if shutil.which("fio") is None:
        return None
    files = sorted(ckpt.glob("*.safetensors"))
    qd = int(engine["queue_depth"])
    cmd = ["fio", "--output-format=json"]
    cmd += ["--name=read", "--rw=read", "--bs=1M", "--ioengine=psync", "--direct=0"]
    cmd += ["--filename=" + ":".join(str(f) for f in files)]
    cmd += ["--name=write", "--rw=write", f"--bs={engine['block_size']}", f"--direct={int(engine['direct'])}"]
    cmd += [f"--filename={swap / 'fio-write.tmp'}", "--unlink=1", "--fallocate=native"]
    if engine["backend"] == "io_uring":
        cmd += ["--ioengine=io_uring", f"--iodepth={qd}", f"--size={nbytes}"]
    else:
        share = -(-nbytes // qd // MIB) * MIB
        cmd += ["--ioengine=psync", f"--numjobs={qd}", f"--size={share}", f"--offset_increment={share}"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return None
    jobs = json.loads(r.stdout)["jobs"]
    reads = [j["read"]["runtime"] / 1000 for j in jobs if j["jobname"] == "read"]
    writes = [j["write"]["runtime"] / 1000 for j in jobs if j["jobname"] == "write"]
    written = sum(j["write"]["io_bytes"] for j in jobs if j["jobname"] == "write")
    return {
        "bytes": sum(j["read"]["io_bytes"] for j in jobs if j["jobname"] == "read"),
        "written": written,
        "seconds": max(reads + writes),
        "read_seconds": max(reads),
        "write_seconds": max(writes),
    }


def _run(mode: str, ckpt: Path, swap: Path) -> dict[str, Any]:
    drop_cache(ckpt)
    cmd = [sys.executable, __file__, "--child", mode, "--ckpt", str(ckpt), "--swap", str(swap)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of a contender's runs, with the highest peak RSS any of them reached."""
    out = dict(min(runs, key=lambda r: r["seconds"]))
    if "peak_rss" in out:
        out["peak_rss"] = max(r["peak_rss"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", help="directory for the checkpoint and the swap (default: a temp dir)")
    ap.add_argument("--size", type=int, default=1024, help="checkpoint size in MiB (default 1024)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each contender, best kept (default 3)")
    modes = ("read", "plain", "plain-touched", "zswap", "zswap-cpu", "plain-warm", "zswap-warm", "engine")
    ap.add_argument("--child", choices=modes, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--swap", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.ckpt, args.swap)))
        return
    tmp = None if args.path else tempfile.mkdtemp(prefix="zswap-bench-pretrained-", dir="/tmp")
    root = Path(args.path or tmp)
    ckpt, swap = root / "ckpt", root / "swap"
    swap.mkdir(parents=True, exist_ok=True)
    try:
        model = write_checkpoint(ckpt, args.size * MIB)
        write_tiny(swap / "tiny")
        engine = _run("engine", ckpt, swap)
        runs: dict[str, list[dict[str, Any]]] = {}
        fio = None
        contenders = ("plain", "plain-touched", "zswap", "zswap-cpu", "plain-warm", "zswap-warm")
        for _ in range(args.repeat):  # interleaved, so a slow spell of the disk hits every contender alike
            drop_cache(ckpt)
            got = fio_read(ckpt)
            fio = fio or got
            runs.setdefault("read", []).append(got or _run("read", ckpt, swap))
            drop_cache(ckpt)
            both = fio_read_write(ckpt, swap, model, engine)
            if both is not None:
                runs.setdefault("read+write", []).append(both)
            for mode in contenders:
                runs.setdefault(mode, []).append(_run(mode, ckpt, swap))
        read, plain, touched, zs, zs_cpu, plain_warm, zs_warm = (best(runs[m]) for m in ("read", *contenders))
        rw = best(runs["read+write"]) if "read+write" in runs else None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    read_rate = read["bytes"] / read["seconds"]
    rss_target = 0.25 * model + 300 * MIB
    rss_ratio = touched["peak_rss"] / max(zs["peak_rss"], 1)
    how = "fio, 1 MiB sequential, buffered" if fio else "pread loop, 4 MiB buffer (fio not installed)"
    kib, qd = engine["block_size"] // 1024, engine["queue_depth"]
    eng = f"{engine['backend']}, direct={engine['direct']}, {kib} KiB x qd {qd}"
    print(f"checkpoint            {model / MIB:10.0f} MiB  float32 Llama, 64 MiB shards; swap engine {eng}")
    print(f"read same bytes       {read['seconds']:10.2f} s    {read_rate / MIB:8.0f} MiB/s  ({how})")
    how_w = "O_DIRECT" if engine["direct"] else "buffered"
    if rw is not None:
        print(
            f"read + write them     {rw['seconds']:10.2f} s    "
            f"{rw['bytes'] / rw['seconds'] / MIB:8.0f} MiB/s "
            f"(fio, both jobs at once until both end: read {rw['read_seconds']:.2f} s, {how_w} write "
            f"{rw['written'] / MIB:.0f} MiB {rw['write_seconds']:.2f} s; the work of a load under Init(nvme))"
        )
    print(
        f"plain from_pretrained {plain['seconds']:10.2f} s    peak RSS {plain['peak_rss'] / MIB:8.0f} MiB  "
        "(weights left memory-mapped: no byte read yet)"
    )
    print(
        f"  + touch every weight{touched['seconds']:10.2f} s    peak RSS "
        f"{touched['peak_rss'] / MIB:8.0f} MiB  (what its first forward does)"
    )
    print(
        f"under Init(cpu)       {zs_cpu['seconds']:10.2f} s    peak RSS {zs_cpu['peak_rss'] / MIB:8.0f} MiB  "
        f"(params in memory, it only reads; every param partitioned: {zs_cpu['partitioned']})"
    )
    print(
        f"  load / read rate    {read['seconds'] / zs_cpu['seconds']:10.2f}      (target >= 0.7; Init(cpu) / "
        f"plain touched time {zs_cpu['seconds'] / touched['seconds']:.2f}x)"
    )
    print(
        f"under Init(nvme)      {zs['seconds']:10.2f} s    peak RSS {zs['peak_rss'] / MIB:8.0f} MiB  "
        f"(every param partitioned: {zs['partitioned']})"
    )
    print(
        f"peak RSS / target     {zs['peak_rss'] / rss_target:10.2f}      (target {rss_target / MIB:.0f} MiB "
        f"= 0.25 x model + 300 MiB; plain touched / Init: {rss_ratio:.1f}x)"
    )
    if rw is not None:
        print(
            f"  load / read+write   {rw['seconds'] / zs['seconds']:10.2f}      "
            "(target >= 0.7: the same work, the like-for-like baseline)"
        )
    print(
        f"  load / read rate    {read['seconds'] / zs['seconds']:10.2f}      (against reading alone, "
        f"half the I/O; Init / plain touched time {zs['seconds'] / touched['seconds']:.2f}x)"
    )
    stream = zs["bytes"] / max(zs["seconds"] - plain["seconds"], 1e-9)
    print(
        f"  without the fixed   {stream / read_rate:10.2f}      (load time minus plain from_pretrained's, "
        f"which reads no byte, against reading alone: {stream / MIB:.0f} MiB/s)"
    )
    print(
        f"transformers warmed:  plain {plain_warm['seconds']:.2f} s, under Init(nvme) "
        f"{zs_warm['seconds']:.2f} s (its one-time work paid on a tiny checkpoint first, as in a process "
        "that loaded a model before)"
    )
    if rw is not None:
        print(
            f"  load / read+write   {rw['seconds'] / zs_warm['seconds']:10.2f}      (warmed; target >= 0.7)"
        )
    print(
        f"  load / read rate    {read['seconds'] / zs_warm['seconds']:10.2f}      "
        "(warmed, against reading alone)"
    )


if __name__ == "__main__":
    main()
