"""Engine fault suite: memory safety, copy-on-write overwrites, space, fallbacks and the error tree.

Cases that used to crash the process (SIGSEGV, heap corruption) run in a child process, and the test
asserts the child raised the documented exception and exited normally — never by a signal.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import zswap
from zswap import SwapEngine
from zswap.errors import (
    BackendUnavailable,
    ChecksumError,
    ConfigError,
    DirectIOUnavailable,
    EngineClosedError,
    InvalidTensorError,
    NvmePathError,
    NvmePathMissing,
    NvmePathNotADirectory,
    NvmePathNotWritable,
    SwapIOError,
    SwapMemoryError,
    ThreadStartError,
    UnavailableError,
    UnknownKeyError,
    ZswapError,
)

from .conftest import mounted, swap_fds

PYTHONPATH = str(Path(zswap.__file__).resolve().parent.parent)


def run_child(code: str, *, prefix: list[str] | None = None, timeout: float = 120) -> str:
    """Runs `code` in a fresh interpreter; fails the test if it died by a signal or exited non-zero."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    r = subprocess.run(
        [*(prefix or []), sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode >= 0, f"child killed by signal {-r.returncode}:\n{r.stderr}"
    assert r.returncode == 0, f"child failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def filled(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# -- 1. memory safety ---------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_bad_tensors_raise_instead_of_crashing(tmp_path: Path, backend: str, direct: bool) -> None:
    out = run_child(
        f"""
        import ctypes, mmap, os, warnings, torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from zswap import SwapEngine
        from zswap.errors import InvalidTensorError
        warnings.simplefilter("ignore")
        e = SwapEngine({str(tmp_path)!r}, backend={backend!r}, direct={direct!r})
        e.write("k", torch.arange(1 << 18, dtype=torch.float32)).wait()
        seen = []
        def refused(what, call, match):
            try:
                call()
            except InvalidTensorError as err:
                assert match in str(err), (what, str(err))
                seen.append(what)
            else:
                raise AssertionError(what + " was accepted")
        shrunk = torch.empty(1 << 18, dtype=torch.float32)
        shrunk.untyped_storage().resize_(4096)
        refused("read-shrunk", lambda: e.read("k", shrunk), "storage, which holds 4096 bytes")
        refused("write-shrunk", lambda: e.write("s", shrunk), "storage, which holds 4096 bytes")
        with FakeTensorMode():
            fake = torch.empty(1 << 18)
        refused("read-fake", lambda: e.read("k", fake), "fake tensor")
        refused("write-fake", lambda: e.write("f", fake), "fake tensor")
        refused("meta", lambda: e.write("m", torch.empty(4, device="meta")), "meta")
        # Read-only memory as a read destination (a PROT_READ file mapping).
        path = os.path.join({str(tmp_path)!r}, "ro")
        with open(path, "wb") as f:
            f.write(bytes(1 << 20))
        fd = os.open(path, os.O_RDONLY)
        ro = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)
        ro_t = torch.frombuffer(ro, dtype=torch.float32)
        refused("read-readonly", lambda: e.read("k", ro_t), "not writable")
        e.write("from-ro", ro_t).wait()  # reading *from* read-only memory is fine
        # The binding checks raw addresses itself: null, unmapped, read-only.
        keep = torch.empty(1)
        refused("raw-null", lambda: e._engine.write("x", 0, 100, keep), "address 0")
        gone = mmap.mmap(-1, 1 << 20)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(gone))
        gone.close()
        refused("raw-unmapped-read", lambda: e._engine.read("k", addr, 1 << 20, keep), "not mapped")
        refused("raw-unmapped-write", lambda: e._engine.write("x", addr, 4096, keep), "not mapped")
        ro_addr = ctypes.addressof(ctypes.c_char.from_buffer_copy(b"x"))  # heap: fine for a write
        e._engine.write("y", ro_addr, 1, keep).wait()
        out = torch.empty(1 << 18, dtype=torch.float32)
        e.read("k", out).wait()
        assert torch.equal(out, torch.arange(1 << 18, dtype=torch.float32))
        print(",".join(seen))
        """
    )
    assert out.strip().split(",") == [
        "read-shrunk",
        "write-shrunk",
        "read-fake",
        "write-fake",
        "meta",
        "read-readonly",
        "raw-null",
        "raw-unmapped-read",
        "raw-unmapped-write",
    ]


def test_lazy_conj_and_neg_views_store_values_and_refuse_raw_reads(tmp_path: Path, backend: str) -> None:
    with SwapEngine(tmp_path, backend=backend) as e:
        z = torch.randn(1000, dtype=torch.complex64)
        e.write("c", z.conj()).wait()
        out = torch.empty_like(z)
        e.read("c", out).wait()
        assert torch.equal(out, z.conj().resolve_conj())
        x = torch.randn(1000)
        e.write("n", torch._neg_view(x)).wait()
        back = torch.empty_like(x)
        e.read("n", back).wait()
        assert torch.equal(back, -x)
        with pytest.raises(InvalidTensorError, match="lazily conjugated view"):
            e.read("c", torch.empty_like(z).conj())
        with pytest.raises(InvalidTensorError, match="lazily negated view"):
            e.read("n", torch._neg_view(torch.empty_like(x)))


# -- 2. copy-on-write overwrites -----------------------------------------------------------------------


def test_failed_overwrite_keeps_the_previous_value(tmp_path: Path, backend: str) -> None:
    with SwapEngine(tmp_path, backend=backend, block_size=1 << 20) as e:
        old, new = filled(3 << 20, 1), filled(3 << 20, 2)
        e.write("k", old).wait()
        e._engine.inject_fault("write", "errno", 5, skip=1)
        h = e.write("k", new)
        with pytest.raises(SwapIOError) as ei:
            h.wait()
        assert ei.value.errno == 5 and ei.value.key == "k"
        out = torch.empty_like(old)
        e.read("k", out).wait()
        assert torch.equal(out, old), "a failed overwrite destroyed the previous value"
        e.write("k", new).wait()
        e.read("k", out).wait()
        assert torch.equal(out, new)


def test_enospc_on_overwrite_keeps_the_previous_value(backend: str) -> None:
    with mounted("tmpfs", "size=3m") as d, SwapEngine(d, backend=backend, direct=False) as e:
        old = filled(2 << 20, 3)
        e.write("k", old).wait()
        with pytest.raises(SwapIOError) as ei:
            e.write("k", filled(2 << 20, 4)).wait()  # a second 2 MiB extent does not fit
        assert ei.value.errno == 28 and ei.value.path == str(d)
        out = torch.empty_like(old)
        e.read("k", out).wait()
        assert torch.equal(out, old) and "k" in e and e.nbytes("k") == 2 << 20
        e.free("k")
        e.write("k", filled(2 << 20, 4)).wait()  # the freed space is reused


def test_readers_of_the_old_value_keep_working_during_an_overwrite(tmp_path: Path, backend: str) -> None:
    with SwapEngine(tmp_path, backend=backend) as e:
        old, new = filled(8 << 20, 5), filled(8 << 20, 6)
        e.write("k", old).wait()
        outs = [torch.empty_like(old) for _ in range(4)]
        reads = [e.read("k", o) for o in outs[:2]]
        w = e.write("k", new)
        reads += [e.read("k", o) for o in outs[2:]]  # issued after the write: they see it
        w.wait()
        for r in reads:
            r.wait()
        assert torch.equal(outs[0], old) and torch.equal(outs[1], old)
        assert torch.equal(outs[2], new) and torch.equal(outs[3], new)


def test_freed_space_is_returned_to_the_file_system_and_reused(tmp_path: Path, backend: str) -> None:
    with SwapEngine(tmp_path, backend=backend, direct=False) as e:
        e.write("small", torch.ones(1000)).wait()
        big = filled(136 << 20, 7)  # past the 128 MiB punch threshold
        e.write("big", big).wait()
        held = e.stats()["allocated_bytes"]
        assert held >= 136 << 20
        e.free("big")
        after = e.stats()["allocated_bytes"]
        assert after < 8 << 20, f"free kept {after} of {held} bytes allocated"
        del big
        again = filled(100 << 20, 8)
        e.write("again", again).wait()
        out = torch.empty_like(again)
        e.read("again", out).wait()
        assert torch.equal(out, again)


# -- 3. checksums (off by default: benches/README.md, "Checksums", has the measured cost) --------------------


def test_checksums_catch_lost_writes_and_flipped_bytes(tmp_path: Path, backend: str) -> None:
    # queue_depth=1: blocks complete in order, so "the second block" is block 1.
    with SwapEngine(tmp_path, backend=backend, block_size=1 << 20, queue_depth=1, checksum="crc32c") as e:
        assert e.info["checksum"] is True
        src = filled(3 << 20, 9)
        e._engine.inject_fault("write", "lost", skip=1)
        e.write("lost", src).wait()  # reported complete; block 1 never reached the file
        with pytest.raises(ChecksumError) as ei:
            e.read("lost", torch.empty_like(src)).wait()
        assert ei.value.key == "lost" and ei.value.block == 1 and ei.value.errno == 5
        e.write("flip", src).wait()
        fd = os.open(swap_fds(e)[0], os.O_RDWR)
        try:
            off = (4 << 20) + 17  # block 1 of "flip", whose extent follows the 3 MiB of "lost"
            b = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b[0] ^ 0x01]), off)
            os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(ChecksumError, match="checksum mismatch"):
            e.read("flip", torch.empty_like(src)).wait()


# -- 4. space and close --------------------------------------------------------------------------------


def test_close_releases_the_descriptor_and_space_at_once(tmp_path: Path, backend: str) -> None:
    e = SwapEngine(tmp_path, backend=backend)
    e.write("k", torch.ones(4 << 20)).wait()
    assert len(swap_fds(e)) == 1
    fd_path = swap_fds(e)[0]
    assert os.stat(fd_path).st_blocks * 512 >= 16 << 20
    e.close()
    assert swap_fds(e) == [], "close() kept the swap file open (its space stays used)"
    for call in (lambda: e.read("k", torch.empty(4 << 20)), lambda: e.free("k"), lambda: e.nbytes("k")):
        with pytest.raises(EngineClosedError):
            call()


def test_opening_allocates_no_space(tmp_path: Path, backend: str) -> None:
    with SwapEngine(tmp_path, backend=backend) as e:
        (fd,) = swap_fds(e)
        st = os.stat(fd)
        assert (st.st_size, st.st_blocks) == (0, 0), "the direct-I/O probe left space allocated"
        assert e.stats()["allocated_bytes"] == 0


def test_enospc_at_open_is_a_swap_io_error_not_a_direct_io_refusal(backend: str) -> None:
    with mounted("tmpfs", "size=1m") as d:
        fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, bytes(4096)) > 0:
                pass
        except OSError as err:
            assert err.errno == 28
        finally:
            os.close(fd)

        for direct in ("auto", True):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # "direct I/O unavailable" would be a silent downgrade
                with pytest.raises(SwapIOError) as ei:
                    SwapEngine(d, backend=backend, direct=direct)
            assert ei.value.errno == 28 and ei.value.path == str(d), direct
            assert not isinstance(ei.value, UnavailableError)


def test_the_swap_file_can_never_be_linked_into_the_namespace(tmp_path: Path, backend: str) -> None:
    # linkat(/proc/self/fd, "N", ..., AT_SYMLINK_FOLLOW) names an O_TMPFILE file unless it was opened
    # O_EXCL (a dir fd forces CPython to use linkat; plain link() would fail with EXDEV either way).
    with SwapEngine(tmp_path, backend=backend) as e:
        (fd,) = swap_fds(e)
        proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(FileNotFoundError):
                os.link(os.path.basename(fd), tmp_path / "revived", src_dir_fd=proc, follow_symlinks=True)
        finally:
            os.close(proc)
        assert list(tmp_path.iterdir()) == []


# -- 5. fallbacks --------------------------------------------------------------------------------------


def _drop_ipc_lock() -> list[str]:
    setpriv = shutil.which("setpriv")
    if setpriv and os.geteuid() == 0:
        return [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]
    capsh = shutil.which("capsh")
    if capsh and os.geteuid() == 0:
        pytest.skip("only capsh available; its argument form differs, not wired up")
    if os.geteuid() != 0:
        return []  # an unprivileged user has no CAP_IPC_LOCK to drop
    pytest.skip("cannot drop CAP_IPC_LOCK here (no setpriv)")


def test_auto_falls_back_to_psync_when_a_worker_ring_exceeds_memlock(tmp_path: Path) -> None:
    if (why := zswap._zswap.io_uring_available()) is not None:
        pytest.skip(f"io_uring refused here already: {why}")
    out = run_child(
        f"""
        import resource, warnings, zswap
        lim = 64 << 10
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (lim, lim))
        assert zswap._zswap.io_uring_available() is None, "the small probe ring must still fit"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            e = zswap.SwapEngine({str(tmp_path)!r}, queue_depth=2048, block_size=4096, threads=1)
        notes = [str(x.message) for x in w if issubclass(x.category, zswap.ZswapWarning)]
        assert e.info["backend"] == "psync", e.info
        assert len(notes) == 1 and "io_uring unavailable (Cannot allocate memory" in notes[0], notes
        assert "RLIMIT_MEMLOCK" in notes[0], notes
        import torch
        t = torch.arange(10000.0)
        e.write("k", t).wait()
        o = torch.empty_like(t)
        e.read("k", o).wait()
        assert torch.equal(o, t)
        try:
            zswap.SwapEngine(
                {str(tmp_path)!r}, queue_depth=2048, block_size=4096, threads=1, backend="io_uring"
            )
        except zswap.errors.BackendUnavailable as err:
            assert err.errno == 12 and "RLIMIT_MEMLOCK" in str(err), err
        else:
            raise AssertionError("backend='io_uring' must not fall back")
        print("ok")
        """,
        prefix=_drop_ipc_lock(),
    )
    assert out.strip() == "ok"


def test_a_fatal_ring_error_fails_requests_instead_of_hanging(tmp_path: Path) -> None:
    if (why := zswap._zswap.io_uring_available()) is not None:
        pytest.skip(f"psync has no submission ring, and io_uring is refused here: {why}")
    out = run_child(
        f"""
        import torch, zswap
        e = zswap.SwapEngine(
            {str(tmp_path)!r}, backend="io_uring", threads=1, block_size=1 << 20, checksum="off"
        )
        e._engine.inject_fault("submit", "errno", 4, count=3)  # EINTR: transient, retried
        # Engine memory and no checksum: the blocks wait in the ring for io_uring_enter (bounced or
        # checksummed ones are handed to the kernel at once, and complete honestly when it fails later).
        t = e.empty(1 << 20, torch.float32)
        t.copy_(torch.arange(1 << 20, dtype=torch.float32))
        e.write("k", t).wait()
        e._engine.inject_fault("submit", "errno", 9)  # EBADF: the ring is dead
        try:
            e.write("x", t).wait()
        except zswap.SwapIOError as err:
            assert err.errno == 9 and "io_uring_enter failed" in str(err), err
        else:
            raise AssertionError("the write succeeded on a dead ring")
        try:
            e.read("k", torch.empty_like(t)).wait()  # no worker left: fails at once, never hangs
        except zswap.SwapIOError as err:
            assert err.errno == 9, err
        else:
            raise AssertionError("read on a dead ring succeeded")
        e.close()
        print("ok")
        """,
        timeout=60,
    )
    assert out.strip() == "ok"


# -- 6. the error tree ---------------------------------------------------------------------------------


def test_error_classes_are_zswap_errors_and_the_natural_builtins() -> None:
    tree = {
        ConfigError: ValueError,
        NvmePathMissing: FileNotFoundError,
        NvmePathNotADirectory: NotADirectoryError,
        NvmePathNotWritable: PermissionError,
        InvalidTensorError: ValueError,
        SwapIOError: OSError,
        ChecksumError: SwapIOError,
        BackendUnavailable: OSError,
        DirectIOUnavailable: OSError,
        SwapMemoryError: MemoryError,
        ThreadStartError: RuntimeError,
        EngineClosedError: RuntimeError,
        UnknownKeyError: KeyError,
    }
    for cls, builtin in tree.items():
        assert issubclass(cls, ZswapError) and issubclass(cls, builtin), cls
    for cls in (NvmePathMissing, NvmePathNotADirectory, NvmePathNotWritable):
        assert issubclass(cls, NvmePathError) and issubclass(cls, ConfigError)
        e = cls(2, "msg", "/p")
        assert (e.errno, e.strerror, e.filename) == (2, "msg", "/p")


def test_a_read_only_swap_directory_is_a_config_error_and_a_permission_error(tmp_path: Path) -> None:
    with mounted("tmpfs", "size=1m,mode=0755") as d:
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True, capture_output=True)
        with pytest.raises(PermissionError) as ei:
            SwapEngine(d)
        assert isinstance(ei.value, NvmePathNotWritable) and ei.value.filename == str(d)


def test_enomem_is_a_swap_memory_error(tmp_path: Path) -> None:
    with SwapEngine(tmp_path) as e, pytest.raises(MemoryError) as ei:
        e.empty(1 << 50, torch.uint8)  # 1 PiB: the kernel refuses the mapping
    assert isinstance(ei.value, SwapMemoryError) and ei.value.errno == 12
    assert "cannot map" in str(ei.value)


def test_thread_start_failure_is_a_thread_start_error(tmp_path: Path) -> None:
    # The kernel never applies RLIMIT_NPROC to uid 0, whatever its capabilities: run as nobody.
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root ignores RLIMIT_NPROC and setpriv is missing to run as another user")
        prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        tmp_path = Path(tempfile.mkdtemp(prefix="zswap-nproc-"))  # pytest's tree is root-only
        tmp_path.chmod(0o777)
    try:
        _thread_start_child(tmp_path, prefix)
    finally:
        if os.geteuid() == 0:
            shutil.rmtree(tmp_path, ignore_errors=True)


def _thread_start_child(tmp_path: Path, prefix: list[str]) -> None:
    out = run_child(
        f"""
        import resource, torch, zswap
        resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
        try:
            zswap.SwapEngine({str(tmp_path)!r}, backend="psync")
        except RuntimeError as err:
            assert isinstance(err, zswap.errors.ThreadStartError), type(err)
            assert err.errno == 11 and "cannot start engine thread zswap-psync-0" in str(err), err
        else:
            raise AssertionError("engine started without threads")
        print("ok")
        """,
        prefix=prefix,
    )
    assert out.strip() == "ok"


def test_adam_kernel_refuses_unmapped_and_read_only_state() -> None:
    out = run_child(
        """
        import ctypes, mmap, warnings, torch
        from zswap import _zswap
        from zswap.errors import InvalidTensorError
        n = 1 << 16
        p, g, m, v = (torch.zeros(n) for _ in range(4))
        ro = mmap.mmap(-1, n * 4, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: "the given buffer is not writable"
            ro_t = torch.frombuffer(ro, dtype=torch.float32)
        ro_addr = ro_t.data_ptr()
        gone = mmap.mmap(-1, n * 4)
        gone_addr = ctypes.addressof(ctypes.c_char.from_buffer(gone))
        gone.close()
        kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
        def call(param, grad, ea, eas):
            _zswap.cpu_adam_step(n, param, "float32", grad, "float32", None, ea, eas, **kw)
        for what, args, match in [
            ("read-only exp_avg", (p.data_ptr(), g.data_ptr(), ro_addr, v.data_ptr()), "not writable"),
            ("unmapped grad", (p.data_ptr(), gone_addr, m.data_ptr(), v.data_ptr()), "not mapped"),
        ]:
            try:
                call(*args)
            except InvalidTensorError as err:
                assert match in str(err), (what, err)
            else:
                raise AssertionError(what + " accepted")
        call(p.data_ptr(), ro_addr, m.data_ptr(), v.data_ptr())  # a read-only *grad* is fine
        print("ok")
        """
    )
    assert out.strip() == "ok"
