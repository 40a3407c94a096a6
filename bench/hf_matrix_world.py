"""The compatibility matrix's gloo world: many types, one after another, in one pair of ranks.

``python -m bench.hf_matrix_world WORKDIR TYPE[,TYPE...]`` runs ``world`` on 2 ranks
(``hybrid.runtime.local_launch.run_local``), so process start-up and imports are paid once for all its
types. For each type, in order (cells: ``bench/hf_matrix_cells.py``):

1. both ranks make the tiny config (``bench/hf_matrix_configs.py``);
2. single-process work, split: rank 0 checks the config in transformers alone, then the ``build`` and ``load``
   cells; rank 1 trains the torch references (fp32, fp64) meanwhile;
3. ``tp1``: TP 1 × DP 2 (``build_mesh(tp=1)``), ZeRO stage 3, then ``export`` from the same engine
   (``hybrid.checkpoint.save`` on both ranks, ``consolidate_hf`` and ``from_pretrained`` on rank 0);
4. ``tp2``: TP 2 × DP 1 by the model's own plan (``hybrid.tp.parallelize``), for a config with a plan.

The ranks agree after every step over a group of their own (``all_gather_object``), so a failure on one
rank is known to both; a rank that fails inside a collective step destroys the mesh's groups at once, so
its peer, waiting in a collective of that group, fails instead of waiting out the timeout, and both build
new groups for the next step. Nothing here waits forever: the groups time out (``COLLECTIVE_S`` for the
mesh, ``AGREE_S`` for the agreement) and the supervisor (``bench/hf_matrix.py``) stops a world that writes
no progress for its stall limit.

Files in WORKDIR: ``progress-rank{r}.jsonl`` (every step's start and end, what the supervisor watches),
``results.jsonl`` (rank 0: the type's row after every step, the last one complete), ``world-error.json``
(the run's failure, where the world itself failed), ``scratch/`` (removed type by type).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

COLLECTIVE_S, AGREE_S = 120, 900
RUN_LOCAL_S = 6 * 3600  # the default group's timeout: the supervisor's stall limit stops a world long before
PRELOAD = ("transformers", "transformers.models.auto.modeling_auto", "torch.distributed.checkpoint",
           "bench.hf_matrix_cells", "bench.hf_matrix_configs")


class Meshes:
    """The TP-1 and TP-2 meshes, built on first use and rebuilt after a step failed on them."""

    def __init__(self):
        self.held: dict = {}

    def get(self, tp: int):
        from hybrid.comm.mesh import build_mesh

        if tp not in self.held:
            self.held[tp] = build_mesh(tp=tp, timeout=timedelta(seconds=COLLECTIVE_S))
        return self.held[tp]

    def drop(self, tp: int) -> None:
        import torch.distributed as dist

        mesh = self.held.pop(tp, None)
        if mesh is None:
            return
        for comm in (mesh.dp_comm, mesh.tp_comm):
            try:
                comm.close()
            except Exception:  # noqa: BLE001 -- a group already broken
                pass
        for group in {id(g): g for g in (mesh.dp_group, mesh.tp_group)}.values():
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        for tp in list(self.held):
            self.drop(tp)


class World:
    """One rank's view: its rank, the agreement group, the meshes, the files."""

    def __init__(self, workdir: Path):
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.workdir = workdir
        self.agree_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREE_S))
        self.meshes = Meshes()
        self.progress = open(workdir / f"progress-rank{self.rank}.jsonl", "a", buffering=1)
        self.started: dict = {}
        self.timings: dict = {}  # the current type's steps, seconds each

    def note(self, model_type: str, step: str, **fields) -> None:
        """A progress line (what the supervisor watches); a step's ``end`` also times it into ``timings``."""
        now = time.time()
        if fields.get("event") == "start":
            self.started[step] = now
        elif fields.get("event") == "end" and step in self.started:
            self.timings[step] = round(now - self.started.pop(step), 2)
        self.progress.write(json.dumps(dict(t=now, type=model_type, step=step, **fields)) + "\n")

    def agree(self, mine) -> list:
        import torch.distributed as dist

        both = [None] * dist.get_world_size()
        dist.all_gather_object(both, mine, group=self.agree_group)
        return both

    def result(self, row: dict) -> None:
        if self.rank == 0:
            row = _placeholders(dict(row), self.workdir / "scratch" / row["type"].replace("/", "_"))
            with open(self.workdir / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


def _failed(both: list):
    """The cell of the first rank that failed a step (rank 0 first), or None."""
    return next((r["cell"] for r in both if not r["ok"]), None)


def _collective_step(world: World, model_type: str, step: str, tp: int, fn):
    """Run ``fn(mesh)`` -> (value, shared) on every rank; on a failure drop the mesh (releasing a peer waiting
    in one of its collectives); agree. Returns (every rank's report: ok, cell or shared; this rank's value)."""
    from bench.hf_matrix_cells import describe

    world.note(model_type, step, event="start")
    value = None
    try:
        value, shared = fn(world.meshes.get(tp))
        mine = dict(ok=True, shared=shared)
    except Exception as err:  # noqa: BLE001
        world.meshes.drop(tp)
        mine = dict(ok=False, cell=describe(err))
    world.note(model_type, step, event="end", cell=mine.get("cell", "ran"))
    both = world.agree(mine)
    if any(not r["ok"] for r in both):
        world.meshes.drop(tp)
    return both, value


def one_type(world: World, model_type: str) -> dict:
    from bench import hf_matrix_cells as cells
    from bench import hf_matrix_configs as configs

    start = time.time()
    world.timings = {}
    row = dict(type=model_type, cells={}, complete=False, steps=world.timings)
    scratch = world.workdir / "scratch" / model_type.replace("/", "_")  # rank 0's; the checkpoint: both ranks'
    if world.rank == 0:
        cells.fresh(scratch)
    world.note(model_type, "config", event="start")
    try:
        config = configs.tiny_config(model_type)
        world.note(model_type, "config", event="end")
        row.update(moe=configs.is_moe(config), plan=configs.has_plan(config), tied=configs.is_tied(config))
    except Exception as err:  # noqa: BLE001 -- the harness cannot make a config: said, not blamed
        config = None
        na = cells.not_applicable("no tiny config", err)
    if config is not None:  # 2. single-process work, split between the ranks
        world.note(model_type, "single", event="start")
        if world.rank == 0:
            mine = _single_cells(config, scratch)
        else:
            mine = _reference(config)
        world.note(model_type, "single", event="end")
        first, ref = world.agree(mine)[:2]
        na = first.get("na")
    if config is None or na:
        row["cells"] = {c: na for c in cells.CELLS}
        row.update(complete=True, seconds=round(time.time() - start, 2))
        return row
    row["cells"].update(build=first["build"], load=first["load"])
    world.result(row)
    if "error" in ref:
        why = cells.not_applicable(f"the torch reference fails ({ref['error']})")
        row["cells"].update(tp1=why, tp2=why, export=why)
    else:
        row["tolerance"] = dict(ref["tolerance"], how=ref["how"])
        _trained_cells(world, model_type, config, ref, row, scratch)
    if world.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    row.update(complete=True, seconds=round(time.time() - start, 2))
    return row


def _placeholders(row: dict, scratch: Path) -> dict:
    """Cells naming this run's temporary directories say DIR instead (the table does not change run to run)."""
    row["cells"] = {c: text.replace(str(scratch), "DIR") if isinstance(text, str) else text
                    for c, text in row["cells"].items()}
    return row


def _single_cells(config, scratch: Path) -> dict:
    from bench import hf_matrix_cells as cells

    try:
        cells.plain_check(config)
    except Exception as err:  # noqa: BLE001
        return dict(na=cells.not_applicable("transformers alone fails on the tiny config", err))
    out = dict(build=cells.cell(lambda: cells.build_cell(config)))
    try:
        out["load"] = cells.load_cell(config, scratch / "saved") or cells.PASS
    except Exception as err:  # noqa: BLE001
        out["load"] = cells.describe(err)
    return out


def _reference(config) -> dict:
    from bench import hf_matrix_cells as cells
    from hybrid.errors import first_line

    try:
        return cells.reference(config)
    except Exception as err:  # noqa: BLE001
        return dict(error=f"{type(err).__name__}: {first_line(err, limit=200)}")


def _trained_cells(world: World, model_type: str, config, ref: dict, row: dict, scratch: Path) -> None:
    from bench import hf_matrix_cells as cells
    from hybrid import checkpoint

    def check(both, value, what):
        failed = _failed(both)
        if failed is not None:
            return failed
        if world.rank != 0:
            return None
        _, losses, norms, weights = value
        mean = [sum(r["shared"][s] for r in both) / len(both) for s in range(len(losses))]
        return cells.cell(lambda: cells.check_run(dict(losses=mean, norms=norms, weights=weights), ref, what))

    def train(tp):
        def run(mesh):
            result = cells.train_tp(config, mesh, tp)
            return result, result[1]  # every rank shares its losses: the run's loss is their DP mean
        return run

    # 3. tp1, then export from its engine
    both, value = _collective_step(world, model_type, "tp1", 1, train(1))
    row["cells"]["tp1"] = check(both, value, "tp1")
    world.result(row)
    if _failed(both) is None:
        engine, weights = value[0], value[3]
        run_dir = scratch / "run"
        saved, _ = _collective_step(world, model_type, "save", 1, lambda mesh: (checkpoint.save(
            run_dir, engine, cells.STEPS, model_config=cells.hf_model_config(config)), None))
        del engine, value
        if _failed(saved) is not None:
            row["cells"]["export"] = _failed(saved)
        elif world.rank == 0:
            world.note(model_type, "export-check", event="start")
            row["cells"]["export"] = cells.cell(lambda: cells.export_cell(run_dir, scratch / "hf", weights))
            world.note(model_type, "export-check", event="end")
        world.agree(None)  # rank 1 waits for the export's check before the next step
    else:
        row["cells"]["export"] = cells.not_applicable("tp1 did not train")
    world.result(row)
    # 4. tp2 by the model's own plan
    if not row.get("plan"):
        row["cells"]["tp2"] = cells.not_applicable("no base_model_tp_plan")
        return
    both, value = _collective_step(world, model_type, "tp2", 2, train(2))
    row["cells"]["tp2"] = check(both, value, "tp2")
    del value


def world(types: list, workdir: str) -> None:
    """Every type of ``types`` on this rank (run by ``run_local`` on 2 ranks)."""
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    here = World(Path(workdir))
    try:
        for model_type in types:
            here.result(one_type(here, model_type))
    finally:
        here.meshes.close()


def main(argv: list) -> int:
    workdir, types = Path(argv[0]), [t for t in argv[1].split(",") if t]
    from hybrid.errors import first_line
    from hybrid.runtime.local_launch import LocalRunError, preload, run_local

    preload(*PRELOAD)
    try:
        run_local(world, 2, types, str(workdir), timeout_s=RUN_LOCAL_S)
    except LocalRunError as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        cause = lines[-1].strip() if len(lines) > 1 else first_line(err)
        (workdir / "world-error.json").write_text(json.dumps(dict(error=f"{first_line(err).rstrip(':')}: {cause}")))
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
