"""Checkpoints of the real ZeRO engine on real gloo ranks: save at one layout, resume at another.

One world of 4 ranks trains gpt-tiny and saves at step 3: run A at ZeRO stage 2 with DP 4, run B at stage 1
with DP 2 × TP 2; each then keeps going for 3 more steps (the uninterrupted reference). One world of 2
ranks then resumes A at stage 3 with DP 2 and B at stage 0 with DP 1 × TP 2 (past an interrupted save and
a directory without its marker): the weights after the load are bit-identical to the saved ones, and the
next 3 steps' losses match the uninterrupted run. The same world checks stage-0 saves (every DP rank holds
everything: written once), a checkpoint of another model and one of another TP degree (one sentence, on
every rank, no hang). In this process: consolidation → torch.load(weights_only=True) → load_state_dict
into the single-process GPT, equal to the engine's full state dict.
"""

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import hybrid
from hybrid import checkpoint
from hybrid.config import TrainConfig
from hybrid.errors import CheckpointError
from hybrid.local_launch import run_local
from hybrid.mesh import build_mesh
from hybrid.models import GPT, GPTConfig
from hybrid.tp import gather_tp_state_dict

pytestmark = pytest.mark.slow

CONFIG = "configs/gpt-tiny.yaml"
GLOBAL_BATCH, SEED, SAVE_AT, MORE = 8, 0, 3, 3


def _train_config(stage: int) -> TrainConfig:
    # Small buckets and persistence threshold: parameters straddle shard edges and stage 3 partitions them.
    return TrainConfig.from_dict({
        "zero": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000,
                 "prefetch_bucket_size": 20_000, "param_persistence_threshold": 100},
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "gradient_clipping": 0.5,
    })


def _batch(step: int, cfg: GPTConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size


def _engine(cfg: GPTConfig, tp: int, dp: int, stage: int):
    mesh = build_mesh(tp=tp, dp=dp)
    model = GPT(cfg, tp_comm=mesh.tp_comm, seed=SEED)
    return mesh, hybrid.initialize(model, _train_config(stage), dp_group=mesh.dp_group, tp_group=mesh.tp_group)


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
    return gather_tp_state_dict(engine.full_state_dict(), engine.module, mesh.tp_comm)


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


def _resume_runs(cfg_dict: dict, other_dict: dict, run_a: str, run_b: str, run_c: str) -> dict:
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
    out["c"] = {"full": _by_value(_full(mesh, engine)), "fresh": checkpoint.resume_if_available(run_c + "-none", engine)}

    errors = []
    for model_dict, tp, run_dir in ((other_dict, 1, run_a), (cfg_dict, 2, run_a)):
        mesh, engine = _engine(GPTConfig.from_dict(model_dict), tp, 2 // tp, 1)
        try:
            checkpoint.load(run_dir, engine)
        except CheckpointError as err:
            errors.append(str(err))
    out["errors"] = errors
    return out


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _close(losses, reference) -> None:
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (losses, reference)


def test_checkpoint_round_trip_across_layouts(tmp_path):
    cfg = GPTConfig.from_yaml(CONFIG)
    runs = {k: str(tmp_path / k) for k in "abc"}
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

    resumed = run_local(_resume_runs, 2, cfg.to_dict(), {**cfg.to_dict(), "hidden": 32}, runs["a"], runs["b"],
                        runs["c"], timeout_s=180)[0]
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
