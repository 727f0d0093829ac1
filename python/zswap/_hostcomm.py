"""The gathers and gradient reductions of ranks that share one host, through shared memory instead of gloo.

gloo moves a CPU collective over TCP on loopback: every byte is copied into the kernel by the sender and out
by the receiver, and each call is a round trip on the socket. Over two ranks of a 256 MiB model that came to
0.3 s a step of transfer and 0.13 s of waiting for the other rank's arrival (backward's reduce-scatters
alone; measured on the 2-core VM, benches/README.md "The step matrix"). Ranks on one host can instead see
each other's memory: each rank maps one segment of every rank's, writes its contribution into its own, and
reads the others' out of theirs — one copy in, one copy out, no kernel in the path.

A `Channel` per gloo process group (`channel`), opened the first time the group gathers or reduces; opening
is itself collective (every rank calls it at the same point, being the same collective on every rank), and
leaves the group on gloo for good — ``None`` — unless every rank of it has host collectives on and can map
every other's segment (one host, one ``/dev/shm``, room on it: the pages are reserved with
``posix_fallocate``, so a full tmpfs is an error at opening, never a ``SIGBUS`` at a write); ranks that share
a host but could not share memory say why in one `ZswapWarning`. The segments are unlinked as soon as every
rank has mapped them: nothing is left in ``/dev/shm``, whatever happens to the processes later — except
where a rank is killed (SIGTERM, SIGKILL) while it waits for its peers to map its segment; the next segment
this user creates removes such leftovers (`_sweep`).

Each segment is a header and two slots of `SLOT` bytes. An exchange of any size runs in *rounds* of one slot:
round k writes slot ``k % 2``, publishes ``ready = k``, waits until every peer's ``ready`` reaches k, reads,
and publishes ``done = k``; before writing slot ``k % 2`` again (round k + 2) a rank waits until every peer's
``done`` reached k. Every rank runs the same rounds in the same order, as it would run gloo's collectives.

Memory order: the counters are plain aligned 8-byte stores and loads, and the data is written and read by
torch before and after them in program order. That is a publication only under x86-64's total store order
(stores are seen in the order they were made, loads are not reordered with older loads, and a store another
core observed stays ordered before this core's later stores); elsewhere `channel` returns ``None``.

A wait spins briefly, then yields the core, then sleeps in short polls; every second it checks that the peer
it waits for still runs (`_alive`: a zombie counts as exited), and gives up after the group's timeout
(``init_process_group``'s ``timeout``; `Channel._timeout`), raising a `ZswapError` that names the peer,
the exchange and the round. A round interrupted (an exception, a KeyboardInterrupt) leaves the ranks out of
step: the channel is then broken, and every later use raises. ``ZSWAP_HOST_COLLECTIVES=0`` turns it off
(gloo for every collective, as before).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import socket
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .errors import RanksDivergedError, ZswapError, ZswapWarning

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SLOT = 4 << 20
"""Bytes one round moves through a rank's slot (two slots a rank: 8 MiB of shared memory per rank)."""

_HEADER = 4096  # keeps the slots page-aligned
_READY, _DONE, _PID = 0, 8, 16  # byte offsets of the header's int64 fields
_TOKEN = 24  # 16 random bytes: that the segment opened is the one the rank announced
_CHECKING = 40  # int64: the round a rank would run next, while it waits in the ranks' check instead
_SHM = "/dev/shm"
_SPINS, _YIELDS, _POLL = 64, 2000, 0.0002  # then sleeps of _POLL seconds
_CHECK_EVERY = 1.0  # seconds between liveness and timeout checks while sleeping
STALL_WARNING = 60.0
"""Seconds of waiting for one peer in one round after which a wait says so (once), well before the
group's timeout (30 min by default) ends it."""
_OFF = "off"  # a rank's reason for no segment: ZSWAP_HOST_COLLECTIVES=0 (or not x86-64 Linux)

_CHANNELS: dict[int, tuple[Any, Channel | None]] = {}
"""{id(process group): (the group, its channel or None where gloo stays)} — the group kept to tell a
destroyed group's id, reused by a new group, from the group itself."""


def enabled() -> bool:
    """Whether host collectives may be used at all: x86-64 Linux, and not turned off."""
    return (
        os.environ.get("ZSWAP_HOST_COLLECTIVES", "1") != "0"
        and platform.system() == "Linux"
        and platform.machine() in ("x86_64", "AMD64")
        and os.path.isdir(_SHM)
    )


def _known(group: ProcessGroup | None) -> tuple[Any, tuple[Any, Channel | None] | None]:
    """(the process group ``group`` names, ``None`` the default one; its `_CHANNELS` entry, if opened)."""
    pg = group if group is not None else torch.distributed.distributed_c10d._get_default_group()
    known = _CHANNELS.get(id(pg))
    return pg, (known if known is not None and known[0] is pg else None)


def opened(group: ProcessGroup | None) -> Channel | None:
    """``group``'s channel if one was opened (never opens one: no collective)."""
    known = _known(group)[1]
    return None if known is None else known[1]


def channel(group: ProcessGroup | None) -> Channel | None:
    """The shared-memory channel of ``group`` (``None``: the default group), opened on first use — a
    collective call, made by every rank at the same point — or ``None`` where the group keeps gloo."""
    pg, known = _known(group)
    if known is not None:
        return known[1]
    made = Channel.open(pg)
    _CHANNELS[id(pg)] = (pg, made)
    return made


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: a zombie (exited, not yet reaped by its parent — a launcher
    waiting on another rank first) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold anything
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return True


def _maps(pid: int, path: str) -> bool:
    """Whether process ``pid`` has ``path`` mapped (unlinked since: the kernel marks it "(deleted)")."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(path in line for line in f)
    except OSError:
        return False


class _Segment:
    """One rank's mapping: its header fields and its two slots as byte tensors."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.ready = ctypes.c_int64.from_buffer(mm, _READY)
        self.done = ctypes.c_int64.from_buffer(mm, _DONE)
        self.pid = ctypes.c_int64.from_buffer(mm, _PID)
        self.checking = ctypes.c_int64.from_buffer(mm, _CHECKING)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        self.slots = (whole[_HEADER : _HEADER + SLOT], whole[_HEADER + SLOT : _HEADER + 2 * SLOT])

    def token(self) -> bytes:
        return bytes(self.mm[_TOKEN : _TOKEN + 16])


STALE_AFTER = 600.0
"""Seconds from which a segment of a process that no longer runs is another run's leftover (`_sweep`)."""


def _sweep() -> None:
    """Unlink segments a killed rank left: each is unlinked once every rank mapped it, so one still there
    belongs to a rank killed while it waited for its peers (SIGTERM or SIGKILL from a launcher). Only this
    user's, named as `_create` names them, of a process that is gone, and untouched for `STALE_AFTER`
    seconds (the age keeps a live rank's segment safe where its pid means nothing here: another pid
    namespace sharing ``/dev/shm``)."""
    try:
        names = os.listdir(_SHM)
    except OSError:
        return
    now = time.time()
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "zswap" or not parts[1].isdigit() or len(parts[2]) != 16:
            continue
        path = os.path.join(_SHM, name)
        try:
            st = os.stat(path)
            if st.st_uid == os.getuid() and now - st.st_mtime >= STALE_AFTER and not _alive(int(parts[1])):
                os.unlink(path)
        except OSError:
            continue  # gone meanwhile, or not ours to remove


def _create(size: int) -> tuple[str, mmap.mmap, bytes]:
    """A new segment of ``size`` bytes with its pages reserved, this process's pid and a fresh token (after
    `_sweep` removed what killed runs left)."""
    _sweep()
    path = os.path.join(_SHM, f"zswap-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS at a write into a full tmpfs
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    token = secrets.token_bytes(16)
    mm[_TOKEN : _TOKEN + 16] = token
    ctypes.c_int64.from_buffer(mm, _PID).value = os.getpid()
    return path, mm, token


def _attach(path: str, size: int, token: bytes) -> _Segment:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    seg = _Segment(mm)
    if seg.token() != token:
        raise OSError(f"{path} is not the segment its rank announced")
    return seg


class Channel:
    """Shared memory between the ranks of one process group on one host (see the module docstring)."""

    def __init__(self, rank: int, segments: list[_Segment], paths: list[str]) -> None:
        self.rank, self.world = rank, len(segments)
        self._segs = segments
        self._peers = [j for j in range(self.world) if j != rank]
        self._pids = [int(s.pid.value) for s in segments]
        # The peers whose exit a wait can notice: their pid, seen from here, maps their segment (in another
        # pid namespace the number may name some other process, or none).
        self._watch = [j for j in self._peers if _maps(self._pids[j], paths[j])]
        self._broken: str | None = None
        self._group: Callable[[], Any] = lambda: None
        """The process group (weakly): a wait gives up after its timeout (`_timeout`)."""
        self.rounds = 0
        """Rounds run: the last round's number (every rank's the same)."""
        self._stalled: tuple[int, int] | None = None  # (peer, round) a wait has warned about

    @classmethod
    def open(cls, pg: Any) -> Channel | None:
        """Map every rank's segment of ``pg``: collective; ``None`` (on every rank alike) where any rank
        cannot — another host, another ``/dev/shm``, no room on it — or has host collectives off. Ranks
        that share a host but could not share memory say why in one `ZswapWarning`."""
        dist = torch.distributed
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        if world < 2 or dist.get_backend(pg) != "gloo":
            return None
        size = _HEADER + 2 * SLOT
        mine: tuple[str, mmap.mmap, bytes] | None = None
        why: str | None = _OFF
        # A rank where host collectives are off (or no segment could be made) still joins the two
        # collectives below, announcing none: every rank then keeps gloo, whatever each one's setting.
        if enabled():
            try:
                mine, why = _create(size), None
            except OSError as exc:
                why = f"no segment in {_SHM}: {exc}"
        segments: list[_Segment] = []
        try:
            mine_path, mine_token = (mine[0], mine[2]) if mine is not None else (None, None)
            announced: list[Any] = [None] * world
            dist.all_gather_object(announced, (_host(), mine_path, mine_token, why), group=pg)
            one_host = len({host for host, *_ in announced}) == 1
            if one_host and all(path for _, path, _, _ in announced):
                try:
                    for j, (_, path, token, _) in enumerate(announced):
                        if j == rank and mine is not None:
                            segments.append(_Segment(mine[1]))
                        else:
                            segments.append(_attach(path, size, token))
                except OSError as exc:
                    why, segments = f"cannot map another rank's segment: {exc}", []
            failed: list[Any] = [None] * world
            dist.all_gather_object(failed, why, group=pg)  # past it, every rank has mapped every segment
        finally:
            if mine is not None:
                os.unlink(mine[0])  # mapped where it is used: nothing stays in /dev/shm
        if one_host and _OFF not in failed and any(failed):
            r, reason = next((r, w) for r, w in enumerate(failed) if w)
            warnings.warn(
                f"the {world} ranks of this process group share one host but not memory (rank {r}: "
                f"{reason}): gloo carries their gathers and gradient reductions, slower; "
                "ZSWAP_HOST_COLLECTIVES=0 says that is meant",
                ZswapWarning,
                stacklevel=2,
            )
        if not segments or any(failed):
            return None
        made = cls(rank, segments, [path for _, path, _, _ in announced])
        made._group = weakref.ref(pg)
        return made

    # -- the two exchanges ---------------------------------------------------------------------------

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None:
        """``out`` (world × n elements) = every rank's ``local`` (n elements) in rank order."""
        n, es, dtype = local.numel(), local.element_size(), local.dtype
        per = SLOT // es
        for c in range(0, n, per):
            m = min(per, n - c)
            mine = local[c : c + m]

            def write(slot: torch.Tensor, mine: torch.Tensor = mine, m: int = m) -> None:
                slot[: m * es].view(dtype).copy_(mine)

            def read(slot: int, mine: torch.Tensor = mine, c: int = c, m: int = m) -> None:
                for j in range(self.world):
                    src = mine if j == self.rank else self._segs[j].slots[slot][: m * es].view(dtype)
                    out[j * n + c : j * n + c + m].copy_(src)

            self._exchange(write, read, "a gather")

    def sum_slices(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """``out`` (n elements) = the sum over ranks, in rank order ``((s0 + s1) + s2) + …``, of slice
        ``rank`` of each rank's ``flat`` (world × n elements): a reduce-scatter, summed as
        `zswap.gradients.grads` sums gloo's all-to-all."""
        n, es, dtype, world, rank = out.numel(), flat.element_size(), flat.dtype, self.world, self.rank
        per = SLOT // (world * es)
        for c in range(0, n, per):
            m = min(per, n - c)

            def write(slot: torch.Tensor, c: int = c, m: int = m) -> None:
                for j in self._peers:  # slice j's chunk goes where rank j reads it
                    slot[j * m * es : (j + 1) * m * es].view(dtype).copy_(flat[j * n + c : j * n + c + m])

            def read(slot: int, c: int = c, m: int = m) -> None:
                parts = [
                    flat[rank * n + c : rank * n + c + m]
                    if j == rank
                    else self._segs[j].slots[slot][rank * m * es : (rank + 1) * m * es].view(dtype)
                    for j in range(world)
                ]
                dst = out[c : c + m]
                torch.add(parts[0], parts[1], out=dst)
                for p in parts[2:]:
                    dst.add_(p)

            self._exchange(write, read, "a gradient reduction")

    # -- rounds ----------------------------------------------------------------------------------------

    def _exchange(
        self, write: Callable[[torch.Tensor], None], read: Callable[[int], None], what: str
    ) -> None:
        if self._broken is not None:
            raise ZswapError(
                f"the shared-memory channel of this process group broke earlier ({self._broken}): its ranks "
                "are out of step; start the processes again"
            )
        k = self.rounds + 1
        slot = k % 2
        me = self._segs[self.rank]
        try:
            self._wait(lambda j: self._segs[j].done.value >= k - 2, what, k)  # peers are done with slot
            write(me.slots[slot])
            me.ready.value = k
            self._wait(lambda j: self._segs[j].ready.value >= k, what, k)
            read(slot)
            me.done.value = k
        except BaseException as exc:
            self._broken = f"{what}, round {k}, was interrupted: {type(exc).__name__}: {exc}"
            raise
        self.rounds = k

    def _wait(self, reached: Callable[[int], bool], what: str, k: int) -> None:
        for j in self._peers:
            if reached(j):
                continue
            spins, start, checked = 0, 0.0, 0.0
            while not reached(j):
                spins += 1
                if spins <= _SPINS:
                    continue
                if spins <= _SPINS + _YIELDS:
                    os.sched_yield()
                    continue
                now = time.monotonic()
                if not start:
                    start = checked = now
                if now - checked >= _CHECK_EVERY:
                    checked = now
                    self._check(j, what, k, now - start)
                time.sleep(_POLL)

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Around the ranks' check of what they ran (`zswap._dist.check_same`, over the backend): a peer
        still waiting for this rank in a round it will never run (it ran one collective more) sees it here
        and raises, instead of waiting for the process group's timeout."""
        me = self._segs[self.rank]
        me.checking.value = self.rounds + 1
        try:
            yield
        finally:
            me.checking.value = 0

    def _check(self, j: int, what: str, k: int, waited: float) -> None:
        parked = self._segs[j].checking.value
        if 0 < parked <= k:
            raise RanksDivergedError(
                f"rank {self.rank} waits for rank {j} in {what} (shared-memory round {k}), but rank {j} "
                "went on to the ranks' check (at engine.step(), or after a forward no backward follows) "
                "without it: the ranks ran different collectives — a param got a gradient (or was gathered) "
                "on some ranks only (a module run by some ranks only, or a pass that raised on some ranks "
                "and was carried on from). Mark the module whose use differs a leaf, whose params are "
                "gathered and reduced together whatever runs inside it "
                "(zswap.deepspeed.utils.set_z3_leaf_modules, or the config's zero_optimization.leaf_module)"
            )
        if j in self._watch and not _alive(self._pids[j]):
            raise ZswapError(
                f"rank {j} (pid {self._pids[j]}) exited while rank {self.rank} waited for it in {what} "
                f"(shared-memory round {k})"
            )
        limit = self._timeout()
        if STALL_WARNING <= waited < limit and self._stalled != (j, k):
            self._stalled = (j, k)
            warnings.warn(
                f"rank {self.rank} has waited {waited:.0f} s for rank {j} in {what} (shared-memory round "
                f"{k}) and waits up to the process group's timeout ({limit:g} s). If only some ranks called "
                "it, call it on every rank: zswap's state_dict(), save_weights, save_16bit_model, "
                "GatheredParameters and forward gather the partitioned params from all ranks",
                ZswapWarning,
                stacklevel=2,
            )
        if waited >= limit:
            raise ZswapError(
                f"rank {self.rank} waited {waited:.0f} s for rank {j} in {what} (shared-memory round {k}), "
                f"past the process group's timeout of {limit:g} s: the ranks no longer run the same "
                "collectives"
            )

    def _timeout(self) -> float:
        """Seconds a wait may last: the group's timeout as gloo keeps it (``init_process_group``'s or
        ``new_group``'s ``timeout``, or `torch.distributed.set_timeout`), else torch's default."""
        with contextlib.suppress(Exception):
            pg = self._group()
            if pg is not None:
                return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        return float(torch.distributed.default_pg_timeout.total_seconds())
