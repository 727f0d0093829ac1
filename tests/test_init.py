"""zswap.Init: params partitioned as modules are built, late writes landing, every patch undone."""

from __future__ import annotations

import gc
import inspect
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import zswap
import zswap.init as zinit
from zswap import ConfigError, Init, Status, ZswapError, ZswapWarning, param_state

from ._init_helpers import TIERS, FakeEngine, engine_available, gathered, make_init


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)


class Parent(nn.Module):
    """Writes to params after their module was partitioned, the ways real models do."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Child()
        self.emb = nn.Embedding(7, 6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.randn(5))
        self.fan = nn.init._calculate_fan_in_and_fan_out(self.child.lin.weight)  # needs the real shape
        nn.init.normal_(self.child.lin.weight, std=0.1)
        self.child.lin.bias.data.normal_()
        self.emb.weight.data[0].zero_()


def _init_fn(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            m.bias.data.uniform_(-0.5, 0.5)


def build() -> nn.Module:
    return Parent().apply(_init_fn)


def plain(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return build(), torch.get_rng_state()


@pytest.mark.parametrize("tier", TIERS)
def test_every_param_partitioned_when_built(tier, tmp_path):
    with make_init(tier, tmp_path):
        m = build()
    for name, p in m.named_parameters():
        st = param_state(p)
        assert st is not None, name
        assert (p.numel(), p.dtype, p.device.type) == (0, torch.float32, "cpu")
        assert (st.status, st.tier, st.dtype) == (Status.NOT_AVAILABLE, tier, torch.float32)
        assert st.partition_numel == st.numel == st.shape.numel() > 0
    assert param_state(m.child.lin.weight).shape == (5, 6)
    assert m.fan == (6, 5)
    assert param_state(torch.zeros(2)) is None and param_state("x") is None


@pytest.mark.parametrize("tier", TIERS)
def test_same_seed_gives_bitwise_the_same_weights(tier, tmp_path):
    ref, ref_rng = plain()
    init = make_init(tier, tmp_path)
    torch.manual_seed(0)
    with init:
        m = build()
    assert torch.equal(torch.get_rng_state(), ref_rng)  # construction consumed the RNG exactly alike
    names = [n for n, _ in ref.named_parameters()]
    for n, a, b in zip(names, gathered(ref.parameters()), gathered(m.parameters()), strict=True):
        assert torch.equal(a, b), n
    assert m.head.weight is m.emb.weight


def test_shape_queries_need_no_gather():
    seen = {}

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)
            w = self.lin.weight
            seen["q"] = (w.shape, w.size(), w.size(-1), w.dim(), w.ndim, w.numel(), len(w), w.dtype)
            seen["status"] = param_state(w).status

    with Init(remote_device="cpu"):
        Probe()
    assert seen["q"] == ((3, 4), (3, 4), 4, 2, 2, 12, 3, torch.float32)
    assert seen["status"] is Status.NOT_AVAILABLE


def test_touched_params_written_back_within_budget(monkeypatch):
    monkeypatch.setattr(zinit, "TOUCH_BUDGET_BYTES", 64)  # smaller than one param: evict at every touch
    ref, _ = plain()

    class Alias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            w = self.a.weight.data  # an alias held across other touches must not be written back early
            self.b.weight.data.zero_()
            w.fill_(3.0)

    torch.manual_seed(0)
    with Init(remote_device="none"):
        m = build()
        al = Alias()
    for a, b in zip(gathered(ref.parameters()), gathered(m.parameters()), strict=True):
        assert torch.equal(a, b)
    wa, wb = gathered([al.a.weight, al.b.weight])
    assert torch.all(wa == 3.0) and torch.all(wb == 0.0)


def test_only_one_module_gathered_at_a_time():
    statuses = []

    class Watch(nn.Module):
        def __init__(self, earlier: list[nn.Module]) -> None:
            super().__init__()
            statuses.extend(param_state(p).status for m in earlier for p in m.parameters())
            self.lin = nn.Linear(16, 16)

    with Init(remote_device="cpu"):
        layers: list[nn.Module] = []
        for _ in range(4):
            layers.append(Watch(list(layers)))
    assert statuses and all(s is Status.NOT_AVAILABLE for s in statuses)


def _snapshot() -> dict[str, object]:
    factories = [
        "empty",
        "zeros",
        "ones",
        "full",
        "rand",
        "randn",
        "randint",
        "tensor",
        "arange",
        "linspace",
        "empty_strided",
    ]
    factories += [f"{n}_like" for n in ("empty", "zeros", "ones", "full", "rand", "randn")]
    return {
        "inits": {c: c.__dict__.get("__init__") for c in zinit._subclasses(nn.Module)},
        "module": dict(nn.Module.__dict__),
        "factories": {n: getattr(torch, n) for n in factories},
        "nn.init": {n: getattr(nn.init, n) for n in dir(nn.init) if not n.startswith("__")},
        "dtype": torch.get_default_dtype(),
        "modes": torch._C._len_torch_function_stack(),
    }


def _same(before: dict, after: dict) -> None:
    for part in ("inits", "module", "factories", "nn.init"):
        changed = [k for k, v in before[part].items() if after[part].get(k) is not v]
        assert not changed, (part, changed)
    assert set(after["module"]) == set(before["module"])
    assert (after["dtype"], after["modes"]) == (before["dtype"], before["modes"])


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_failing_init_restores_everything(dtype):
    before = _snapshot()
    with pytest.raises(RuntimeError, match="boom"), Init(remote_device="cpu", dtype=dtype):

        class Boom(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(3, 3)
                raise RuntimeError("boom")

        Parent()
        Boom()
    _same(before, _snapshot())
    assert not hasattr(Boom.__init__, "__zswap_init__") and not hasattr(Boom.__init__, "__wrapped__")
    assert nn.Linear(2, 2).weight.numel() == 4  # construction is plain again


def test_patched_inits_keep_signature_and_doc():
    classes = [nn.Linear, nn.Module, nn.Embedding, Parent]
    sigs = [inspect.signature(c.__init__) for c in classes]
    with Init(remote_device="cpu"):
        assert all(hasattr(c.__init__, "__zswap_init__") for c in classes)
        assert [inspect.signature(c.__init__) for c in classes] == sigs
        assert nn.Linear.__init__.__doc__ == nn.Linear.__init__.__wrapped__.__doc__
        assert nn.Linear.__init__.__name__ == "__init__"


def test_nested_init_applies_inner_settings():
    with Init(remote_device="cpu"):
        a = nn.Linear(2, 3)
        with Init(remote_device="none", dtype=torch.float64):
            b = Child()
            assert torch.empty(1).dtype == torch.float32  # built as a plain build, cast at exit
        assert torch.get_default_dtype() == torch.float32
        assert hasattr(nn.Linear.__init__, "__zswap_init__")  # the outer context still holds its patches
        c = nn.Linear(2, 3)
    assert not hasattr(nn.Linear.__init__, "__zswap_init__")
    tiers = [(param_state(p).tier, param_state(p).dtype) for m in (a, b, c) for p in m.parameters()]
    assert (
        tiers == [("cpu", torch.float32)] * 2 + [("none", torch.float64)] * 2 + [("cpu", torch.float32)] * 2
    )


def test_classes_defined_inside_the_context():
    with Init(remote_device="cpu"):

        class Base(nn.Module):
            def __init__(self, n: int) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.randn(n))

        class Sub(Base):
            def __init__(self) -> None:
                super().__init__(4)
                self.v = nn.Parameter(torch.randn(2))

        class SubSub(Sub):
            pass

        subsub = SubSub()
        assert param_state(subsub.v) is not None  # partitioned when its outermost __init__ returned
    assert all(param_state(p) is not None for p in subsub.parameters())


def test_class_escaping_init_subclass_is_swept():
    class NoChain(nn.Module):
        def __init_subclass__(cls, **kwargs: object) -> None:
            pass  # does not chain up: zswap's hook never sees subclasses

    with Init(remote_device="cpu"):

        class Leaf(NoChain):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.randn(3))

        first = Leaf()
        nn.Linear(1, 1)  # a sync point
        assert param_state(first.w) is not None
        second = Leaf()
        assert param_state(second.w) is not None


def test_skip_init_is_partitioned():
    with Init(remote_device="cpu"):
        rng = torch.get_rng_state()
        lin = torch.nn.utils.skip_init(nn.Linear, 4, 8)
        assert torch.equal(torch.get_rng_state(), rng)
    assert all(param_state(p) is not None and p.numel() == 0 for p in lin.parameters())
    assert param_state(lin.weight).shape == (8, 4)


@pytest.mark.parametrize("tier", TIERS)
def test_meta_then_to_empty_is_partitioned(tier, tmp_path):
    def make() -> nn.Module:
        with torch.device("meta"):
            m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        m.to_empty(device="cpu")
        for layer in m:
            layer.reset_parameters()
        return m

    torch.manual_seed(0)
    ref = make()
    init = make_init(tier, tmp_path)
    torch.manual_seed(0)
    with init:
        m = make()
    assert all(param_state(p) is not None for p in m.parameters())
    for a, b in zip(gathered(ref.parameters()), gathered(m.parameters()), strict=True):
        assert torch.equal(a, b)


def test_dtype_keyword_and_config():
    with Init(remote_device="cpu", dtype=torch.bfloat16):
        assert torch.empty(2).dtype == torch.float32  # the build is a plain fp32 build; cast at exit
        m = Child()
        explicit = nn.Linear(2, 2, dtype=torch.float32)  # kept in the Init dtype too
    assert torch.get_default_dtype() == torch.float32
    assert {param_state(p).dtype for p in [*m.parameters(), *explicit.parameters()]} == {torch.bfloat16}
    assert m.lin.weight.dtype == torch.bfloat16 and m.lin.weight.numel() == 0
    with Init({"offload_param": {"device": "cpu"}, "bf16": {"enabled": True}}):
        b = nn.Linear(2, 2)
    assert param_state(b.weight).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="floating"):
        Init(remote_device="cpu", dtype=torch.int32)


def test_config_is_not_referenced_and_later_changes_change_nothing():
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}}}
    init = Init(cfg)
    cfg["zero_optimization"]["offload_param"]["device"] = "none"
    with init:
        m = nn.Linear(2, 2)
    assert param_state(m.weight).tier == "cpu"
    gc.collect()
    # Plain loops: a comprehension naming `cfg` would hold it in a closure cell of its own.
    here, section, strangers = sys._getframe(), cfg["zero_optimization"], []
    for r in gc.get_referrers(cfg):
        if r is not here:
            strangers.append(r)
    for r in gc.get_referrers(section):
        if r is not here and r is not cfg:
            strangers.append(r)
    assert strangers == []


def test_keywords_override_config(tmp_path):
    cfg = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "not-there")}}
    with Init(cfg, remote_device="cpu"):  # the nvme path is never looked at
        a = nn.Linear(2, 2)
    with Init({"offload_param": {"device": "cpu"}}, remote_device="none"):
        b = nn.Linear(2, 2)
    assert (param_state(a.weight).tier, param_state(b.weight).tier) == ("cpu", "none")
    with pytest.raises(ConfigError, match="remote_device"):
        Init(remote_device="disk")


def test_nvme_without_path_is_a_config_error():
    with pytest.raises(ConfigError, match="nvme_path"):
        Init(remote_device="nvme")


def test_bad_nvme_path_fails_before_any_module_is_built(tmp_path):
    from zswap.parts import guards

    guards.install()  # process-wide, installed once on purpose by whichever test runs first: not Init's
    before = _snapshot()
    missing = tmp_path / "typo"
    with pytest.raises(FileNotFoundError, match="typo"):
        Init({"offload_param": {"device": "nvme", "nvme_path": str(missing)}})
    assert not missing.exists()  # never created
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(NotADirectoryError):
        Init({"offload_param": {"device": "nvme", "nvme_path": str(afile)}})
    _same(before, _snapshot())


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_a_bad_nvme_path_is_named_by_its_key(section, tmp_path):
    """Each section's path is checked where its store opens, and the error names the key; a directory whose
    file system takes no files (/proc) says so rather than "does not exist" (the kernel's ENOENT)."""
    cfg = {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    for path, kind, says in [
        (tmp_path / "typo", zswap.errors.NvmePathMissing, "does not exist (zswap never creates it)"),
        ("/proc", zswap.errors.NvmePathNotWritable, "is a directory, but its file system refused a new file"),
    ]:
        cfg["zero_optimization"][section]["nvme_path"] = str(path)
        with pytest.raises(kind, match=re.escape(f"{section}.nvme_path {says}")):
            with Init(cfg):
                m = torch.nn.Linear(4, 4)
            zswap.initialize(m, cfg).close()
    cfg["zero_optimization"][section]["nvme_path"] = str(tmp_path)


def test_a_read_only_nvme_path_says_so_with_erofs(tmp_path, monkeypatch):
    """access() answers EACCES for a directory on a read-only mount; the error gives the kernel's reason."""
    import errno
    import os

    real = os.statvfs

    class ReadOnly:
        def __init__(self, path: str) -> None:
            self._st = real(path)

        def __getattr__(self, name: str) -> int:
            return int(getattr(self._st, name)) | (os.ST_RDONLY if name == "f_flag" else 0)

    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    monkeypatch.setattr(os, "statvfs", ReadOnly)
    with pytest.raises(zswap.errors.NvmePathNotWritable) as ei:
        Init({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}})
    assert ei.value.errno == errno.EROFS
    assert str(ei.value) == f"[Errno 30] offload_param.nvme_path is on a read-only file system: '{tmp_path}'"


def test_world_size_without_torch_distributed_warns(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(ZswapWarning, match="WORLD_SIZE=2"):
        Init(remote_device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    Init(remote_device="cpu")  # no warning: filterwarnings=error would fail here


_ONE_RANK_UNDER_A_LAUNCH = """
import torch, torch.distributed as dist, zswap
dist.init_process_group("gloo", store=dist.FileStore(STORE, 1), rank=0, world_size=1)
try:
    zswap.Init(remote_device="cpu")
except zswap.ZswapError as e:
    print("refused:", e)
with zswap.Init(remote_device="cpu", process_group=dist.new_group([0])):
    m = torch.nn.Linear(2, 2)
print("explicit:", zswap.param_state(m.weight).world_size)
dist.destroy_process_group()
"""


def test_a_one_rank_default_group_under_a_multi_rank_launch_is_refused(tmp_path):
    """The launcher says ``WORLD_SIZE=2`` but the default group was initialised with one rank (by another
    library, before the launch's own): nothing would partition and each rank keep the whole model — an
    error, as DeepSpeed's ``zero.Init`` makes it. A one-rank group passed explicitly is meant."""
    script = _ONE_RANK_UNDER_A_LAUNCH.replace("STORE", repr(str(tmp_path / "store")))
    env = {**os.environ, "WORLD_SIZE": "2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "refused: the launcher set WORLD_SIZE=2 but torch.distributed's default group has 1 rank (it was "
        "initialised before the launch's own, by another library or init_process_group with world_size=1): "
        "zswap.Init would partition nothing and every rank keep the whole model. Initialise the default "
        "group with the launcher's 2 ranks (torch.distributed.init_process_group() from the environment, or "
        "zswap.deepspeed.init_distributed()); to run one model per process, pass a one-rank process_group "
        "explicitly",
        "explicit: 1",
    ]


def test_module_keyword_converts_a_built_model():
    torch.manual_seed(0)
    m = build()
    before = [p.detach().clone() for p in m.parameters()]
    Init(remote_device="cpu", module=m)
    assert all(param_state(p) is not None and p.numel() == 0 for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, gathered(m.parameters()), strict=True))
    m2 = nn.Linear(3, 3)
    with Init(remote_device="none", module=m2):
        assert param_state(m2.weight).tier == "none"


def test_enabled_false_does_nothing():
    before = _snapshot()
    with Init(remote_device="cpu", enabled=False):
        m = nn.Linear(2, 2)
        _same(before, _snapshot())
    assert param_state(m.weight) is None and m.weight.numel() == 4


def test_params_added_in_the_body_and_new_data_are_partitioned():
    with Init(remote_device="cpu"):
        m = nn.Linear(2, 2)
        m.extra = nn.Parameter(torch.ones(3))
        m.bias.data = torch.full((2,), 7.0)
    assert param_state(m.extra) is not None
    extra, bias = gathered([m.extra, m.bias])
    assert torch.equal(extra, torch.ones(3)) and torch.equal(bias, torch.full((2,), 7.0))


def test_module_to_dtype_inside_init():
    with Init(remote_device="cpu"):
        m = nn.Linear(3, 2).double()
    st = param_state(m.weight)
    assert (st.dtype, st.shape, m.weight.dtype) == (torch.float64, (2, 3), torch.float64)


def test_writes_are_queued_not_awaited_one_by_one(monkeypatch):
    engine = FakeEngine()
    monkeypatch.setattr(zinit, "_open_engine", lambda paths, aio: engine)
    with Init({"offload_param": {"device": "nvme", "nvme_path": "/nowhere"}}):
        m = nn.Sequential(*(nn.Linear(4, 4) for _ in range(8)))
        assert engine.writes == 16 and engine.waits == 0  # nothing waited for during construction
    assert engine.waits == 16  # leaving Init waits for all of them
    assert {param_state(p).tier for p in m.parameters()} == {"nvme"}
    monkeypatch.setattr(zswap.storage, "INFLIGHT_WRITE_BYTES", 100)
    engine2 = FakeEngine()
    monkeypatch.setattr(zinit, "_open_engine", lambda paths, aio: engine2)
    with Init({"offload_param": {"device": "nvme", "nvme_path": "/nowhere"}}):
        nn.Sequential(*(nn.Linear(4, 4) for _ in range(8)))
        assert 0 < engine2.waits < 16  # only when the in-flight bytes pass the budget


def test_write_errors_surface_when_leaving_init(monkeypatch):
    before = _snapshot()
    monkeypatch.setattr(zinit, "_open_engine", lambda paths, aio: FakeEngine(fail_writes=True))
    with (
        pytest.raises(zswap.SwapIOError, match="No space"),
        Init({"offload_param": {"device": "nvme", "nvme_path": "/nowhere"}}),
    ):
        nn.Linear(2, 2)
    _same(before, _snapshot())


def test_body_error_wins_over_a_write_error(monkeypatch):
    monkeypatch.setattr(zinit, "_open_engine", lambda paths, aio: FakeEngine(fail_writes=True))
    with (
        pytest.raises(RuntimeError, match="body") as info,
        Init({"offload_param": {"device": "nvme", "nvme_path": "/nowhere"}}),
    ):
        nn.Linear(2, 2)
        raise RuntimeError("body")
    assert any("No space" in n for n in getattr(info.value, "__notes__", ["No space"]))
    assert not hasattr(nn.Linear.__init__, "__zswap_init__")


def test_init_in_another_thread_while_active_is_refused():
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with Init(remote_device="cpu"):
                pass
        except ZswapError as e:
            errors.append(e)

    with Init(remote_device="cpu"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        built_elsewhere: list[nn.Module] = []
        t2 = threading.Thread(target=lambda: built_elsewhere.append(nn.Linear(2, 2)))
        t2.start()
        t2.join()
    assert errors and "another thread" in str(errors[0])
    assert param_state(built_elsewhere[0].weight) is None  # other threads build plainly


@pytest.mark.skipif(not engine_available(), reason="the native swap engine is not built")
def test_nvme_partitions_live_in_the_engine(tmp_path):
    with make_init("nvme", tmp_path):
        m = Child()
    st = param_state(m.lin.weight)
    physical = st.store.physical(st.key)
    assert physical in st.store.engine
    assert st.store.engine.nbytes(physical) == 30 * 4


def test_lazy_and_scripted_modules_inside_init():
    with Init(remote_device="cpu"):
        lazy = nn.LazyLinear(3)

        class Scripted(torch.jit.ScriptModule):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(2))

    assert param_state(lazy.weight) is None and param_state(lazy.bias) is None  # materialised at first use
    lazy(torch.ones(1, 4))
    assert lazy.weight.shape == (3, 4)
    assert Scripted().w.numel() == 2  # torch.jit's own __init__ wrapper survived the restore


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tier", TIERS)
def test_params_built_on_a_gpu(tier, tmp_path):
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = build()
    init = make_init(tier, tmp_path, pin_memory=True)
    torch.manual_seed(0)
    with torch.device("cuda"), init:
        m = build()
    for p in m.parameters():
        st = param_state(p)
        assert (p.device.type, p.numel(), st.device.type) == ("cuda", 0, "cuda")
        local, handle = st.store.load(st.key, st.partition_numel, st.dtype)
        if handle is not None:
            handle.wait()
        assert local.device.type == ("cuda" if tier == "none" else "cpu")
        assert local.is_pinned() or tier != "cpu"  # pinned when asked and CUDA is there
    for a, b in zip(gathered(ref.parameters()), gathered(m.parameters()), strict=True):
        assert b.device.type == "cuda" and torch.equal(a, b)
