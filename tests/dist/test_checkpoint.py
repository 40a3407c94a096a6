"""Checkpoints of the real ZeRO engine on real gloo ranks: save at one layout, resume at another.

One world of 4 ranks trains gpt-tiny and saves at step 3: run A at ZeRO stage 2 with DP 4, run B at stage 1
with DP 2 × TP 2; each then keeps going for 3 more steps (the uninterrupted reference). One world of 2
ranks then resumes A at stage 3 with DP 2 and B at stage 0 with DP 1 × TP 2 (past an interrupted save and
a directory without its marker): the weights after the load are bit-identical to the saved ones, and the
next 3 steps' losses match the uninterrupted run. The same world checks stage-0 saves (every DP rank holds
everything: written once), a checkpoint of another model and one of another TP degree (one sentence, on
every rank, no hang). In this process: consolidation → torch.load(weights_only=True) → load_state_dict
into the single-process GPT, equal to the engine's full state dict.

The world of 2 also covers any model, not only the GPT: one with a frozen parameter, persistent and
non-persistent buffers (one changed by every forward), tied weights and parameters not divisible by DP,
saved at stage 1 and resumed at stage 3 (its consolidation strict-loads into the single-process model); and
bf16, saved at stage 2 and resumed at stage 1 (fp32 masters and moments bit-identical, bf16 parameters the
masters' cast, the next losses exactly those of the uninterrupted run).

A separate process saving a ~20M-parameter checkpoint is SIGKILLed mid-write: the previous checkpoint
stays the latest, resume loads it, and the next save replaces the torn directory.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import hybrid
from hybrid import checkpoint
from hybrid.config.training import TrainConfig
from hybrid.errors import CheckpointError, UsageError
from hybrid.runtime.local_launch import run_local
from hybrid.comm.mesh import build_mesh
from hybrid.models import GPT, GPTConfig

pytestmark = pytest.mark.slow

CONFIG = "configs/gpt-tiny.yaml"
GLOBAL_BATCH, SEED, SAVE_AT, MORE = 8, 0, 3, 3


def _train_config(stage: int, precision: str = "fp32", bucket: int = 20_000, persist: int = 100) -> TrainConfig:
    # Small buckets and persistence threshold: parameters straddle shard edges and stage 3 partitions them.
    return TrainConfig.from_dict({
        "zero": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                 "prefetch_bucket_size": bucket, "param_persistence_threshold": persist},
        "precision": precision,
        "optimizer": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "gradient_clipping": 0.5,
    })


def _batch(step: int, cfg: GPTConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size


def _engine(cfg: GPTConfig, tp: int, dp: int, stage: int, precision: str = "fp32", seed: int = SEED):
    mesh = build_mesh(tp=tp, dp=dp)
    model = GPT(cfg, tp_comm=mesh.tp_comm, seed=seed)
    return mesh, hybrid.initialize(model, _train_config(stage, precision), dp_group=mesh.dp_group,
                                   tp_group=mesh.tp_group)


def _train(mesh, engine, cfg: GPTConfig, first: int, count: int) -> list:
    """Steps ``first .. first+count-1`` on the step's global batch; the DP-mean loss of each."""
    micro = GLOBAL_BATCH // mesh.dp
    rows = slice(mesh.dp_rank * micro, (mesh.dp_rank + 1) * micro)
    losses = []
    for step in range(first, first + count):
        seq = _batch(step, cfg)[rows]
        loss = engine(seq[:, :-1], seq[:, 1:])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        mesh.dp_comm.all_reduce(mean, average=True)
        losses.append(mean.item())
    return losses


def _full(mesh, engine) -> dict:
    return engine.full_state_dict()


def _by_value(state: dict) -> dict:
    """Tensors as numpy arrays: run_local's queue would otherwise pass them by a handle to the rank's
    memory, which is gone once the rank exits."""
    return {k: v.numpy() for k, v in state.items()}


def _tensors(state: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in state.items()}


def _save_runs(cfg_dict: dict, run_a: str, run_b: str) -> dict:
    cfg = GPTConfig.from_dict(cfg_dict)
    out = {}
    for name, run_dir, (tp, dp, stage) in (("a", run_a, (1, 4, 2)), ("b", run_b, (2, 2, 1))):
        mesh, engine = _engine(cfg, tp, dp, stage)
        _train(mesh, engine, cfg, 0, SAVE_AT)
        assert checkpoint.maybe_save(run_dir, engine, SAVE_AT - 1, every=SAVE_AT) is None
        path = checkpoint.maybe_save(run_dir, engine, SAVE_AT, every=SAVE_AT, keep_last=2,
                                     extra={"next_step": SAVE_AT}, model_config=cfg_dict)
        drawn = torch.rand(4)  # what this rank's RNG yields right after the save
        saved = _full(mesh, engine)
        reference = _train(mesh, engine, cfg, SAVE_AT, MORE)
        out[name] = {"path": str(path), "saved": _by_value(saved), "reference": reference}
        if name == "a":  # same world: loading rewinds a trained engine exactly, RNG included
            resumed = checkpoint.load(run_dir, engine)
            out[name].update(same_world_rng=resumed.rng_restored and torch.equal(torch.rand(4), drawn),
                             rewound=_equal(_full(mesh, engine), saved))
    return out


def _resume_runs(cfg_dict: dict, other_dict: dict, run_a: str, run_b: str, run_c: str, run_d: str,
                 run_e: str) -> dict:
    cfg = GPTConfig.from_dict(cfg_dict)
    out = {}
    for name, run_dir, (tp, dp, stage) in (("a", run_a, (1, 2, 3)), ("b", run_b, (2, 1, 0))):
        mesh, engine = _engine(cfg, tp, dp, stage)
        resumed = checkpoint.resume_if_available(run_dir, engine)
        loaded = _full(mesh, engine)
        losses = _train(mesh, engine, cfg, resumed.step, MORE)
        out[name] = {"path": resumed.path.name, "step": resumed.step, "extra": resumed.extra,
                     "rng": resumed.rng_restored, "loaded": _by_value(loaded), "losses": losses}

    # Stage 0 with DP 2: both ranks own every element; the save must still be valid (written once).
    mesh, engine = _engine(cfg, 1, 2, 0)
    checkpoint.load(run_a, engine)
    checkpoint.save(run_c, engine, SAVE_AT)
    out["c"] = {"full": _by_value(_full(mesh, engine)),
                "fresh": checkpoint.resume_if_available(run_c + "-none", engine)}

    errors = []
    for model_dict, tp, run_dir in ((other_dict, 1, run_a), (cfg_dict, 2, run_a)):
        mesh, engine = _engine(GPTConfig.from_dict(model_dict), tp, 2 // tp, 1)
        try:
            checkpoint.load(run_dir, engine)
        except CheckpointError as err:
            errors.append(str(err))
    out["errors"] = errors
    out["any_model"] = _any_model_runs(run_d)
    out["bf16"] = _bf16_runs(cfg, run_e)
    return out


class _Tied(nn.Module):
    """Not the GPT: a frozen parameter, a persistent buffer, a counter buffer every forward changes, a
    non-persistent buffer (absent from state_dict), a head tied to the embedding, and parameters whose
    sizes (7, 42, 66) do not fill whole DP-2 shards of the 4-element alignment."""

    VOCAB, WIDTH, INNER = 11, 6, 7

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.scale = nn.Parameter(torch.rand(self.INNER) + 0.5, requires_grad=False)
        self.register_buffer("shift", torch.randn(self.WIDTH))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.embed = nn.Embedding(self.VOCAB, self.WIDTH)
        self.proj = nn.Linear(self.WIDTH, self.INNER)
        self.out = nn.Linear(self.INNER, self.WIDTH)
        self.head = nn.Linear(self.WIDTH, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx, targets):
        self.calls += 1
        h = self.out(torch.tanh(self.proj(self.embed(idx))) * self.scale) + self.shift
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _tied_engine(stage: int, seed: int):
    mesh = build_mesh(tp=1, dp=2)
    config = _train_config(stage, bucket=40, persist=10)  # units of a few params; stage 3 partitions most
    return mesh, hybrid.initialize(_Tied(seed), config, dp_group=mesh.dp_group)


def _train_tied(mesh, engine, first: int, count: int) -> list:
    micro = GLOBAL_BATCH // mesh.dp
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(2000 + step)
        idx, targets = torch.randint(0, _Tied.VOCAB, (2, GLOBAL_BATCH, 5), generator=g)
        rows = slice(mesh.dp_rank * micro, (mesh.dp_rank + 1) * micro)
        loss = engine(idx[rows], targets[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        mesh.dp_comm.all_reduce(mean, average=True)
        losses.append(mean.item())
    return losses


def _tied_state(engine) -> dict:
    """The engine's full parameters (each once) and the module's persistent buffers."""
    module = engine.module
    persistent = set(module.state_dict(keep_vars=True)) & set(dict(module.named_buffers()))
    return {**engine.full_state_dict(), **{n: b.clone() for n, b in module.named_buffers() if n in persistent}}


def _any_model_runs(run_dir: str) -> dict:
    """_Tied: save at stage 1 (DP 2), keep going; resume a differently seeded model at stage 3 (DP 2)."""
    mesh, engine = _tied_engine(1, seed=0)
    _train_tied(mesh, engine, 0, SAVE_AT)
    checkpoint.save(run_dir, engine, SAVE_AT)
    saved = _tied_state(engine)
    reference = _train_tied(mesh, engine, SAVE_AT, MORE)

    mesh, engine = _tied_engine(3, seed=1)
    resumed = checkpoint.resume_if_available(run_dir, engine)
    loaded = _tied_state(engine)
    return {"saved": saved, "reference": reference, "step": resumed.step, "loaded": loaded,
            "losses": _train_tied(mesh, engine, SAVE_AT, MORE)}


def _views(engine) -> dict:
    return {name: (v.start, v.end, v.master.clone(), v.exp_avg.clone(), v.exp_avg_sq.clone())
            for name, v in engine.shard_views().items()}


def _same_views(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        a[k][:2] == b[k][:2] and all(torch.equal(x, y) for x, y in zip(a[k][2:], b[k][2:])) for k in a)


def _bf16_runs(cfg: GPTConfig, run_dir: str) -> dict:
    """gpt-tiny in bf16: save at stage 2 (DP 2), keep going; load a differently seeded model at stage 1."""
    mesh, engine = _engine(cfg, 1, 2, 2, "bf16")
    _train(mesh, engine, cfg, 0, SAVE_AT)
    checkpoint.save(run_dir, engine, SAVE_AT)
    saved_views, saved_full = _views(engine), engine.full_state_dict()
    reference = _train(mesh, engine, cfg, SAVE_AT, MORE)

    mesh, engine = _engine(cfg, 1, 2, 1, "bf16", seed=SEED + 1)
    checkpoint.load(run_dir, engine)
    full = engine.full_state_dict()
    params = dict(engine.module.named_parameters())
    return {"views": _same_views(_views(engine), saved_views), "full": _equal(full, saved_full),
            "bf16_params": all(p.dtype == torch.bfloat16 for p in params.values()),
            "cast": all(torch.equal(params[n].detach(), full[n].to(torch.bfloat16)) for n in params),
            "reference": reference, "losses": _train(mesh, engine, cfg, SAVE_AT, MORE)}


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _close(losses, reference) -> None:
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (losses, reference)


def test_checkpoint_round_trip_across_layouts(tmp_path):
    cfg = GPTConfig.from_yaml(CONFIG)
    runs = {k: str(tmp_path / k) for k in "abcde"}
    saved = run_local(_save_runs, 4, cfg.to_dict(), runs["a"], runs["b"], timeout_s=180)[0]
    for k in "ab":
        saved[k]["saved"] = _tensors(saved[k]["saved"])
    assert saved["a"]["same_world_rng"] and saved["a"]["rewound"]

    for k in "ab":
        # Consolidated weights load into the single-process GPT and equal the engine's full state dict.
        out_file = tmp_path / f"{k}.pt"
        state, ckpt, doc = checkpoint.consolidate(runs[k])
        torch.save(state, out_file)
        model = GPT(cfg, seed=SEED + 1)
        model.load_state_dict(torch.load(out_file, weights_only=True))
        assert _equal({n: p.detach() for n, p in model.named_parameters()}, saved[k]["saved"])
        assert doc["step"] == SAVE_AT and doc["model_config"] == cfg.to_dict()

    # Interrupted saves after the good checkpoint of A: a half-written temporary directory, and a
    # published-looking directory without its marker. Resume must skip both.
    good = checkpoint.latest(runs["a"])
    partial = good.parent / ".tmp-step-000006"
    shutil.copytree(good, partial)
    (partial / "COMPLETE").unlink()
    (partial / "__0_0.distcp").write_bytes(b"torn")
    unmarked = good.parent / "step-000009"
    shutil.copytree(partial, unmarked)

    ranks = run_local(_resume_runs, 2, cfg.to_dict(), {**cfg.to_dict(), "hidden": 32}, runs["a"], runs["b"],
                      runs["c"], runs["d"], runs["e"], timeout_s=180)
    resumed = ranks[0]
    for k in "ab":
        resumed[k]["loaded"] = _tensors(resumed[k]["loaded"])
    resumed["c"]["full"] = _tensors(resumed["c"]["full"])
    for k in "ab":
        got = resumed[k]
        assert (got["path"], got["step"], got["extra"], got["rng"]) == \
            ("step-000003", SAVE_AT, {"next_step": SAVE_AT}, False)
        assert _equal(got["loaded"], saved[k]["saved"])  # bit-identical weights after the load
        _close(got["losses"], saved[k]["reference"])

    assert _equal(resumed["c"]["full"], saved["a"]["saved"]) and resumed["c"]["fresh"] is None
    c_state, _, c_doc = checkpoint.consolidate(runs["c"])
    assert _equal(c_state, saved["a"]["saved"]) and c_doc["world"]["stage"] == 0
    chunks = FileSystemReader(checkpoint.latest(runs["c"])).read_metadata().state_dict_metadata
    assert all(len(md.chunks) == 1 for key, md in chunks.items() if key.startswith("master/"))

    other, tp = resumed["errors"]
    assert "another model" in other and "parameter" in other and "\n" not in other
    assert "tp=1 but this job runs tp=2" in tp
    assert json.loads((checkpoint.latest(runs["a"]) / "hybrid.json").read_text())["world"] == \
        {"world_size": 4, "dp": 4, "tp": 1, "stage": 2, "precision": "fp32"}

    _check_any_model(resumed["any_model"], runs["d"], tmp_path / "tied.pt")
    _check_bf16([rank["bf16"] for rank in ranks])


def _check_any_model(got: dict, run_dir: str, out_file) -> None:
    assert got["step"] == SAVE_AT
    assert got["saved"]["calls"] == SAVE_AT and got["saved"]["calls"].dtype == torch.long
    assert _equal(got["loaded"], got["saved"])  # frozen parameter and buffers restored too
    _close(got["losses"], got["reference"])

    state, _, doc = checkpoint.consolidate(run_dir)
    assert doc["aliases"] == {"head.weight": "embed.weight"}
    assert set(doc["frozen"]) == {"scale"} and set(doc["buffers"]) == {"shift", "calls"}
    torch.save(state, out_file)
    model = _Tied(seed=7)
    model.load_state_dict(torch.load(out_file, weights_only=True))  # strict: every name, nothing extra
    assert model.head.weight is model.embed.weight
    assert _equal(model.state_dict(), {**got["saved"], "head.weight": got["saved"]["embed.weight"]})


class _WithEmptyParameter(nn.Module):
    """A zero-element parameter (a zero-width adapter): no rank holds a piece of it, so no piece is saved."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x):
        return (self.fc(x) ** 2).mean() + self.empty.sum()


def _save_with_empty_parameter(stage: int, run_dir: str) -> dict:
    engine = hybrid.initialize(_WithEmptyParameter(), _train_config(stage))
    engine.backward(engine(torch.ones(2, 4)))
    engine.step()
    checkpoint.save(run_dir, engine, 1)
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_zero_element_parameter_consolidates(tmp_path, stage):
    full = run_local(_save_with_empty_parameter, 2, stage, str(tmp_path / "run"))[0]
    state, _, _ = checkpoint.consolidate(tmp_path / "run")  # was refused as "damaged"
    assert set(state) == set(full) and state["empty"].shape == (0, 3)
    assert _equal(state, full)


class _SharedBuffer(nn.Module):
    """One tensor registered as a non-persistent buffer, then as a persistent one in a later module."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        cache = torch.randn(4)
        self.a, self.b = nn.Module(), nn.Module()
        self.a.register_buffer("cache", cache, persistent=False)
        self.b.register_buffer("cache", cache)
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return (self.lin(x + self.b.cache) ** 2).mean()


def _save_and_load_shared_buffer(run_dir: str) -> tuple:
    engine = hybrid.initialize(_SharedBuffer(0), _train_config(1))
    engine.backward(engine(torch.ones(2, 4)))
    engine.step()
    checkpoint.save(run_dir, engine, 1)
    other = hybrid.initialize(_SharedBuffer(7), _train_config(1))
    checkpoint.load(run_dir, other)
    return engine.module.b.cache.clone(), other.module.b.cache.clone()


def test_a_buffer_also_registered_as_non_persistent_is_saved_under_its_state_dict_name(tmp_path):
    saved, loaded = run_local(_save_and_load_shared_buffer, 2, str(tmp_path / "run"))[0]
    assert torch.equal(loaded, saved)  # was never written: the new model's values stayed
    state, _, doc = checkpoint.consolidate(tmp_path / "run")  # was a KeyError on the alias
    assert set(doc["buffers"]) == {"b.cache"} and not doc["aliases"] and torch.equal(state["b.cache"], saved)


def _resume_from_paths_that_are_no_run_directory(root: str) -> dict:
    root = Path(root)
    engine = hybrid.initialize(_WithEmptyParameter(), _train_config(1))
    checkpoint.save(root / "run", engine, 3)
    if dist.get_rank() == 0:
        (root / "a-file").write_text("x")
        (root / "odd" / "checkpoints").parent.mkdir()
        (root / "odd" / "checkpoints").write_text("x")
    dist.barrier()
    out = {}
    for label, path in (("step", root / "run" / "checkpoints" / "step-000003"), ("file", root / "a-file"),
                        ("checkpoints file", root / "odd")):
        try:
            out[label] = checkpoint.resume_if_available(path, engine)
        except CheckpointError as err:
            out[label] = str(err)
    return out


def test_resuming_from_a_path_that_is_no_run_directory_is_refused_not_a_fresh_start(tmp_path):
    ranks = run_local(_resume_from_paths_that_are_no_run_directory, 2, str(tmp_path))
    assert ranks[0] == ranks[1]  # the same sentence on every rank
    got = ranks[0]
    step = tmp_path / "run" / "checkpoints" / "step-000003"
    assert got["step"].startswith(f"{step} is one checkpoint, not a run directory; resume with the run directory")
    assert got["file"].startswith(f"{tmp_path / 'a-file'} is a file, not a run directory;")
    assert got["checkpoints file"] == (f"cannot resume from {tmp_path / 'odd'}: {tmp_path / 'odd' / 'checkpoints'} "
                                       "is a file, not a directory; move it aside so checkpoints can be written "
                                       "there.")


def _check_bf16(ranks: list) -> None:
    for got in ranks:
        assert got["views"] and got["full"], "fp32 masters and Adam moments restore bit-identically"
        assert got["bf16_params"] and got["cast"], "the bf16 parameters are the masters cast to bf16"
        assert got["losses"] == got["reference"]


# -- a writer killed mid-save ----------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
BIG_LAYERS, BIG_WIDTH = 5, 2000  # ~20M parameters: each checkpoint is ~240 MB (master + both moments)


def _big_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(BIG_WIDTH, BIG_WIDTH) for _ in range(BIG_LAYERS)])


def _big_engine(seed: int):
    return hybrid.initialize(_big_model(seed), _train_config(0, bucket=50_000_000))


def _killable_writer(run_dir: str) -> None:
    """Run in its own process (a one-rank gloo world): publish step 1, then start saving step 2 with
    different weights; the test kills this process while step 2 is being written."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{run_dir}.store", rank=0, world_size=1)
    engine = _big_engine(SEED)
    checkpoint.save(run_dir, engine, 1)
    with torch.no_grad():
        for view in engine.shard_views().values():
            view.master.add_(1.0)
    print("saving step 2", flush=True)
    checkpoint.save(run_dir, engine, 2)
    print("saved step 2", flush=True)


def _resume_after_kill(run_dir: str) -> dict:
    engine = _big_engine(SEED + 1)
    resumed = checkpoint.resume_if_available(run_dir, engine)
    full = engine.full_state_dict()
    restored = all(torch.equal(full[n], p) for n, p in _big_model(SEED).state_dict().items())
    del full
    again = checkpoint.save(run_dir, engine, 2)  # the torn step-2 directory must not get in the way
    return {"step": resumed.step, "path": resumed.path.name, "restored": restored, "again": again.name}


def test_writer_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    torn = run_dir / "checkpoints" / ".tmp-step-000002"
    code = "import sys; from tests.dist.test_checkpoint import _killable_writer; _killable_writer(sys.argv[1])"
    log = tmp_path / "writer.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stdout.readline()
        assert line == "saving step 2\n", f"the writer failed before its second save: {log.read_text()}"
        written = 0
        while proc.poll() is None and written == 0:
            written = sum(f.stat().st_size for f in torn.glob("*.distcp")) if torn.is_dir() else 0
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL, "the writer finished its save before it could be killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert written > 0 and torn.is_dir() and not (run_dir / "checkpoints" / "step-000002").exists()
    assert checkpoint.latest(run_dir) == run_dir / "checkpoints" / "step-000001"
    assert checkpoint.describe(run_dir)["latest"] == "step-000001"

    got = run_local(_resume_after_kill, 1, str(run_dir), timeout_s=180)[0]
    assert got == {"step": 1, "path": "step-000001", "restored": True, "again": "step-000002"}
    assert not torn.exists() and checkpoint.latest(run_dir).name == "step-000002"


def _save_growth(run_dir: str, stage: int) -> dict:
    """Peak RSS growth of one ``checkpoint.save`` on this rank (VmHWM reset just before), and the bytes of
    the pieces it writes."""
    torch.set_num_threads(1)
    engine = hybrid.initialize(_big_model(SEED), _train_config(stage, bucket=5_000_000))
    loss = engine(torch.randn(4, BIG_WIDTH)).square().mean()
    engine.backward(loss)
    engine.step()
    written = sum(t.nbytes for v in engine.shard_views().values() for t in (v.master, *v.states.values()))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    checkpoint.save(run_dir, engine, 1)
    return {"growth": (_status_kib("VmHWM") - before) * 1024, "written": written}


def _status_kib(key: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key))
    return int(line.split()[1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
@pytest.mark.parametrize("stage", [1, 3])
def test_saving_costs_no_copy_of_the_shard(tmp_path, stage):
    """DCP's writer copies every tensor smaller than its storage (each parameter's piece of a flat buffer)
    and holds the copies until its file is written: the whole shard again, ~120 MB per rank here."""
    ranks = run_local(_save_growth, 2, str(tmp_path / "run"), stage, timeout_s=300)
    for got in ranks:
        assert got["written"] > 100e6 and got["growth"] < 0.1 * got["written"], got
    assert checkpoint.describe(tmp_path / "run")["latest"] == "step-000001"


# -- damaged checkpoints on real ranks --------------------------------------------------------------------

def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _as_format_2(manifest_path: Path, **edit) -> None:
    """Rewrite a checkpoint as the unsealed format 2 (no checksums), with ``edit`` applied to its manifest."""
    doc = json.loads(manifest_path.read_text())
    doc.pop("files")
    doc.update(version=2, **edit)
    manifest_path.write_text(json.dumps(doc))
    (manifest_path.parent / "COMPLETE").write_text(manifest_path.parent.name + "\n")


def _damage_plan(pristine: Path, root: Path) -> dict:
    """label -> (a copy of ``pristine``, the file of its newest checkpoint (step 4) to damage, how, and the
    problem a verification must name)."""
    files = sorted(p.name for p in (pristine / "checkpoints" / "step-000004").iterdir())
    assert {"COMPLETE", "hybrid.json", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files)
    damages = [(f"flip {name}", name, _flip_middle, f"corrupt: {name}") for name in files]
    damages += [("truncate __1_0.distcp", "__1_0.distcp", _truncate, "truncated: __1_0.distcp"),
                ("delete __0_0.distcp", "__0_0.distcp", Path.unlink, "missing: __0_0.distcp"),
                ("delete .metadata", ".metadata", Path.unlink, "missing: .metadata"),
                ("format-2 manifest with a step that is no number", "hybrid.json",
                 lambda path: _as_format_2(path, step="four"), "corrupt: hybrid.json"),
                ("format-2 manifest without its world", "hybrid.json",
                 lambda path: _as_format_2(path, world=None), "corrupt: hybrid.json")]
    return {label: (root / f"run{i}", name, damage, problem)
            for i, (label, name, damage, problem) in enumerate(damages)}


def _damaged_world(cfg_dict: dict, root: str) -> dict:
    """Stage 1, DP 2: train 4 steps, checkpoint steps 2 and 4. Rank 0 damages copies of the run; then at
    stage 3 (another seed) every copy is resumed, one with no good checkpoint through hybrid.runtime.train.resume,
    a damaged checkpoint is loaded explicitly, and a run is resumed with rank 1's directory listing stale,
    one whose newest checkpoint directory was renamed, and one whose format-2 data does not decode."""
    from hybrid.checkpoint import layout
    from hybrid.runtime.train import Context, JobSettings, resume

    cfg, root = GPTConfig.from_dict(cfg_dict), Path(root)
    pristine, none_good, stale = root / "pristine", root / "none-good", root / "stale"
    renamed, garbage = root / "renamed", root / "garbage"
    mesh, engine = _engine(cfg, 1, 2, 1)
    saved = {}
    for step in range(1, 5):
        _train(mesh, engine, cfg, step - 1, 1)
        if checkpoint.maybe_save(pristine, engine, step, every=2) is not None:
            saved[step] = _by_value(_full(mesh, engine))
    plan = _damage_plan(pristine, root)
    if dist.get_rank() == 0:
        for run, name, damage, _ in plan.values():
            shutil.copytree(pristine, run)
            damage(run / "checkpoints" / "step-000004" / name)
        shutil.copytree(pristine, none_good)
        for step in (2, 4):
            _flip_middle(none_good / "checkpoints" / f"step-{step:06d}" / "__1_0.distcp")
        shutil.copytree(pristine, stale)
        shutil.copytree(pristine, renamed)
        (renamed / "checkpoints" / "step-000004").rename(renamed / "checkpoints" / "step-4")
        shutil.copytree(pristine, garbage)
        newest = garbage / "checkpoints" / "step-000004"
        _as_format_2(newest / "hybrid.json")
        data = newest / "__1_0.distcp"
        data.write_bytes(bytes(reversed(data.read_bytes())))  # same size: format 2 checks sizes only
    dist.barrier()

    out = {"saved": saved, "expected": {label: problem for label, (*_, problem) in plan.items()}, "runs": {}}
    mesh, engine = _engine(cfg, 1, 2, 3, seed=SEED + 1)  # each load below overwrites every value it holds
    for label, (run, *_) in plan.items():
        skipped = []
        resumed = checkpoint.resume_if_available(run, engine,
                                                 on_skip=lambda p, problem: skipped.append((p.name, str(problem))))
        out["runs"][label] = {"step": resumed.step, "skipped": skipped, "full": _by_value(_full(mesh, engine))}

    records = []
    ctx = Context(mesh, {}, JobSettings(steps=4, micro_batch=4, stage=3, checkpoint_dir=str(none_good)),
                  rank=dist.get_rank(), world_size=2, reporter=records.append)
    try:
        resume(ctx, engine)
        out["none_good"] = None
    except CheckpointError as err:  # every rank, the same sentence: starting fresh would overwrite them
        out["none_good"] = str(err)
    try:
        checkpoint.load(layout.final_dir(none_good, 4), engine)
        out["explicit"] = None
    except CheckpointError as err:
        out["explicit"] = str(err)

    real_scan = layout.scan
    if dist.get_rank() == 1:  # this rank's view of the directory is stale: it sees no checkpoint at all
        layout.scan = lambda run_dir: []
    try:
        resumed = checkpoint.resume_if_available(stale, engine)
    finally:
        layout.scan = real_scan
    out["stale"] = resumed.step if resumed else None
    resumed = checkpoint.resume_if_available(renamed, engine)
    out["renamed"] = (resumed.path.name, resumed.step, _by_value(_full(mesh, engine)))
    try:
        checkpoint.resume_if_available(garbage, engine)
        out["garbage"] = None
    except CheckpointError as err:
        out["garbage"] = str(err)
    return out


def test_resume_skips_damaged_checkpoints_on_every_rank(tmp_path):
    cfg = GPTConfig.from_yaml(CONFIG)
    ranks = run_local(_damaged_world, 2, cfg.to_dict(), str(tmp_path), timeout_s=240)
    for rank, got in enumerate(ranks):
        at_2 = _tensors(got["saved"][2])
        for label, problem in got["expected"].items():
            run = got["runs"][label]
            assert run["step"] == 2, (rank, label)
            assert run["skipped"] == [("step-000004", problem)], (rank, label)
            assert _equal(_tensors(run["full"]), at_2), (rank, label)

        none_good = tmp_path / "none-good" / "checkpoints"
        assert got["none_good"] == ranks[0]["none_good"]
        assert got["none_good"].startswith(f"no good checkpoint in {none_good} (step-000004 (corrupt: "
                                           f"__1_0.distcp), step-000002 (corrupt: __1_0.distcp))")
        assert f"move {none_good} aside" in got["none_good"]
        assert sorted(p.name for p in none_good.iterdir()) == ["latest", "step-000002", "step-000004"]
        assert "is damaged (corrupt: __1_0.distcp)" in got["explicit"] and "\n" not in got["explicit"]
        assert got["explicit"] == ranks[0]["explicit"]
        assert got["stale"] == 4  # rank 0 chose; rank 1 loaded its choice although it saw nothing
        name, step, full = got["renamed"]  # rank 1 looked for step-000004 and called it corrupt
        assert (name, step) == ("step-4", 4) and _equal(_tensors(full), _tensors(got["saved"][4]))
        garbage = tmp_path / "garbage" / "checkpoints" / "step-000004"
        assert re.match(rf"{re.escape(str(garbage))} is damaged: rank \d could not read its data \(", got["garbage"])
        assert "\n" not in got["garbage"] and got["garbage"] == ranks[0]["garbage"]  # not DCP's multi-rank traceback


def _locked_and_full_world(cfg_dict: dict, root: str) -> dict:
    """DP 2: ``run_steps`` on a directory whose lock the test process holds (every rank refused, nothing
    trained); then a save whose write fails with ENOSPC on rank 1 (every rank gets one sentence, the
    partial directory is gone, the previous checkpoint intact)."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from hybrid.checkpoint import layout, lock
    from hybrid.errors import CheckpointWriteError
    from hybrid.runtime.train import Context, JobSettings, run_steps

    cfg, root = GPTConfig.from_dict(cfg_dict), Path(root)
    mesh, engine = _engine(cfg, 1, 2, 1)
    lock.WAIT_S = 0.5
    ctx = Context(mesh, {}, JobSettings(steps=2, micro_batch=4, stage=1, checkpoint_dir=str(root / "locked"),
                                        checkpoint_every=1), rank=dist.get_rank(), world_size=2)
    out = {}
    try:
        run_steps(ctx, engine, lambda step: (_batch(step, cfg)[:4, :-1], _batch(step, cfg)[:4, 1:]))
        out["locked"] = None
    except CheckpointError as err:
        out["locked"] = str(err)

    full = root / "full"
    _train(mesh, engine, cfg, 0, 1)
    checkpoint.save(full, engine, 1)
    _train(mesh, engine, cfg, 1, 1)
    def save_failing(step: int, rank: int, owner, name: str, error: OSError):
        """``checkpoint.save`` with ``owner.name`` raising ``error`` on ``rank``: its sentence, or None."""
        real = getattr(owner, name)

        def fail(*args, **kwargs):
            raise error

        if dist.get_rank() == rank:
            setattr(owner, name, fail)
        try:
            checkpoint.save(full, engine, step)
            return None
        except CheckpointWriteError as err:
            return str(err)
        finally:
            setattr(owner, name, real)

    out["full"] = save_failing(2, 1, dcp_fs, "_write_item", OSError(errno.ENOSPC, "No space left on device"))
    dist.barrier()
    out["after"] = sorted(p.name for p in layout.checkpoints_dir(full).iterdir())
    out["latest"] = checkpoint.resume_if_available(full, engine).step
    # rank 0 cannot create the step's temporary directory
    out["unwritable"] = save_failing(3, 0, Path, "mkdir", PermissionError(errno.EACCES, "Permission denied"))

    # rank 0 cannot create the lock file (a directory stands where it goes): the others say rank 0's sentence
    (root / "nolock" / "checkpoints" / ".lock").mkdir(parents=True, exist_ok=True)
    try:
        with checkpoint.exclusive(root / "nolock", engine):
            out["nolock"] = None
    except CheckpointError as err:
        out["nolock"] = f"{type(err).__name__}: {err}"
    return out


def test_a_locked_directory_and_a_full_disk_fail_every_rank_in_one_sentence(tmp_path):
    from hybrid.checkpoint import lock

    cfg = GPTConfig.from_yaml(CONFIG)
    lock.acquire(tmp_path / "locked")  # another job, as far as the ranks can tell
    try:
        ranks = run_local(_locked_and_full_world, 2, cfg.to_dict(), str(tmp_path), timeout_s=240)
    finally:
        lock.release(tmp_path / "locked")
    for got in ranks:
        assert got["locked"] == ranks[0]["locked"]
        assert got["locked"].startswith(f"checkpoint directory {tmp_path / 'locked' / 'checkpoints'} is in use "
                                        f"by another job (pid {os.getpid()} on ")
        assert got["full"] == ranks[0]["full"]
        assert got["full"].startswith(f"saving the step-2 checkpoint into {tmp_path / 'full' / 'checkpoints'} "
                                      f"failed (No space left on device on rank 1; the partial "
                                      f".tmp-step-000002 was removed)")
        assert got["after"] == ["latest", "step-000001"] and got["latest"] == 1
        assert got["unwritable"] == ranks[0]["unwritable"]
        assert got["unwritable"].startswith(f"saving the step-3 checkpoint into {tmp_path / 'full' / 'checkpoints'} "
                                            "failed (Permission denied on rank 0; nothing was written); make it "
                                            "writable for every rank")
        assert got["nolock"] == ranks[0]["nolock"]
        assert got["nolock"].startswith("CheckpointError: cannot create the checkpoint lock "), got["nolock"]
    assert not (tmp_path / "locked" / "checkpoints" / "step-000001").exists()


def _lr_set_by_hand_runs(run_dir: str) -> list:
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                               "warmup_num_steps": 4}}
    config = {"zero_optimization": {"stage": 2}, "scheduler": schedule,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    seen = []
    engine = hybrid.initialize(nn.Linear(4, 1), config)
    for step in range(4):
        if step == 2:
            engine.lr = 0.005  # half of optimizer.lr: the absolute warmup rates scale by half too
            seen.append(engine.lr)  # the next step's rate, read back at once
        engine.backward(engine(x[rank::world]).square().mean())
        engine.step()
        seen.append(engine.lr)
    checkpoint.save(run_dir, engine, 4)
    again = hybrid.initialize(nn.Linear(4, 1), config)
    again.lr = 0.1  # a rate set before the load does not outlive it
    checkpoint.load(run_dir, again)
    seen.append(again.lr)  # restored: the 5th step's rate at the hand-set scale
    return seen


def test_a_learning_rate_set_by_hand_scales_the_schedule_reads_back_and_survives_a_resume(tmp_path):
    warm = [0.02 * min(1.0, math.log(i + 1) / math.log(4)) for i in range(5)]  # DeepSpeed's log warmup
    expected = [warm[0], warm[1], warm[2] / 2, warm[2] / 2, warm[3] / 2, warm[4] / 2]
    for seen in run_local(_lr_set_by_hand_runs, 2, str(tmp_path / "run"), timeout_s=120):
        assert seen == pytest.approx(expected, rel=1e-12), seen


def _deepspeed_names_runs(run_dir: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    engine = hybrid.initialize(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), config)
    boundaries = []
    for _ in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = engine.train()(x[rank::world]).square().mean()
        assert engine.backward(loss) is loss
        engine.step()
    path = engine.save_checkpoint(run_dir, client_state={"epoch": 3})
    again = hybrid.initialize(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), config)
    loaded, client_state = again.load_checkpoint(run_dir)
    same = all(torch.equal(a, b) for a, b in zip(engine.full_state_dict().values(), again.full_state_dict().values()))
    refused = []  # a checkpoint holds no gradients: none is taken while some are pending
    engine.backward(engine(x[rank::world]).square().mean())
    for _ in range(2):  # between a backward and its step, then between the window's two micro-steps
        try:
            engine.save_checkpoint(run_dir)
        except UsageError as err:
            refused.append(str(err))
        if engine.micro_steps % 2 == 0:
            engine.step()
    return dict(boundaries=boundaries, path=path, loaded=loaded, client_state=client_state, same=same, refused=refused,
                steps=(engine.global_steps, again.global_steps), lr=again.get_lr(),
                norm=engine.get_global_grad_norm() == engine.last_grad_norm,
                training=(engine.eval().module.training, engine.train().module.training))


def test_deepspeed_engine_names_train_save_and_load_like_the_hybrid_ones(tmp_path):
    for res in run_local(_deepspeed_names_runs, 2, str(tmp_path / "run"), timeout_s=120):
        assert res["boundaries"] == [False, True, False, True]
        assert res["path"] == res["loaded"] == str(tmp_path / "run" / "checkpoints" / "step-000002")
        assert res["client_state"] == {"epoch": 3} and res["same"] and res["steps"] == (2, 2)
        assert res["lr"] == [0.01] and res["norm"] and res["training"] == (False, True)
        assert res["refused"] == [
            "cannot save a checkpoint now: engine.backward() ran without its engine.step(), so its gradients are "
            "pending, and a checkpoint holds no gradients, so a resume from it would drop them; save right after an "
            "engine.step() that returned True",
            "cannot save a checkpoint now: 1 of the 2 micro-steps of this optimizer step (gradient_accumulation_steps) "
            "have run, so their gradients are accumulated but not applied, and a checkpoint holds no gradients, so a "
            "resume from it would drop them; save right after an engine.step() that returned True"]
