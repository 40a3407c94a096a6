"""The model config's ``eval:`` section and what it turns into, without spawning a rank.

- ``eval_options`` (``hybrid.models.sections.EvalOptions``): defaults, YAML numbers, and every bad value, unknown
  key or missing held-out data is one ``ConfigError`` sentence naming ``eval.<field>`` and the fix; the launcher's
  ``check_model_config`` refuses the same before any rank starts.
- Held-out data (``hybrid.runtime.evaluate``): ``split_held_out`` holds out the last ``ceil(F x windows)``
  windows of a token file, which the training stream never reads over many epochs; the synthetic chain's
  held-out batches (``UnseenSteps``) are no training step's but come from the same chain; a held-out set too
  small for ``eval.batches`` is refused.
- ``Evaluation``: the cadence (every ``every`` steps and the last), the loss under ``no_grad`` in eval mode with
  each submodule's mode put back, and ``run_steps`` reporting ``eval_loss`` / ``eval_ppl`` in the step's report
  on a world-1 engine whose weights and optimizer state an evaluation leaves alone; the ``hf:`` loop (a tiny
  transformers Llama, in this process) evaluates its held-out windows.
- The driver's side: ``step_entry`` keeps the fields, ``metrics.jsonl`` and TensorBoard (``eval/loss``) get
  them, the progress display prints a line for each evaluation, the summary names the last one.
"""

import io
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hybrid
from hybrid.data import MarkovTokens, TokenFile, TokenFileMeta, metadata_path
from hybrid.errors import ConfigError
from hybrid.models.gpt.training import check_model_config
from hybrid.models.sections import EvalOptions, eval_options, held_out_stream
from hybrid.runtime.evaluate import Evaluation, UnseenSteps, split_held_out, stream_eval_batches
from hybrid.runtime.train import Context, JobSettings, run_steps
from launch.job.display import Progress
from launch.job.metrics import MetricsWriter, read_metrics, step_entry, summary_lines

MODEL = {"vocab_size": 64, "seq_len": 7, "n_layers": 1, "hidden": 16, "n_heads": 2}


def _one_sentence(message: str) -> None:
    assert message.endswith(".") and message.count(". ") == 0, message


def _token_file(path, tokens: int = 1000, vocab: int = 64):
    ids = (np.arange(tokens) % vocab).astype("<u2")
    ids.tofile(path)
    metadata_path(path).write_text(TokenFileMeta("uint16", vocab, tokens).to_json())
    return path


# ------------------------------------------------------------------------------------------ the section


def test_eval_options_defaults_and_yaml_numbers():
    assert eval_options(None, "corpus.bin") is None
    options = eval_options({"fraction": "5e-2", "every": 20}, "corpus.bin")
    assert options == EvalOptions(every=20, batches=4, fraction=0.05)
    assert eval_options({}, None) == EvalOptions()  # the synthetic chain needs no held-out data of its own
    assert eval_options({"data": "held.bin", "batches": 2}, None).data == "held.bin"


@pytest.mark.parametrize("section, training_data, field", [
    ({"fraction": 0}, "c.bin", "eval.fraction"),
    ({"fraction": 1}, "c.bin", "eval.fraction"),
    ({"fraction": "half"}, "c.bin", "eval.fraction"),
    ({"fraction": 0.1, "every": -1}, "c.bin", "eval.every"),
    ({"fraction": 0.1, "every": 2.5}, "c.bin", "eval.every"),
    ({"fraction": 0.1, "batches": 0}, "c.bin", "eval.batches"),
    ({"data": ""}, "c.bin", "eval.data"),
    ({"fraction": 0.1, "evry": 5}, "c.bin", "eval.evry"),
    ({"fraction": 0.1, "data": "h.bin"}, "c.bin", "eval.data and eval.fraction are both set"),
    ({"every": 5}, "c.bin", "set eval.fraction"),
    ({"fraction": 0.1}, None, "eval.fraction is 0.1, but the model config has no data:"),
    ([0.1], "c.bin", "eval must be a mapping"),
])
def test_eval_options_refuse_in_one_sentence(section, training_data, field):
    with pytest.raises(ConfigError) as err:
        eval_options(section, training_data)
    assert field in str(err.value)
    _one_sentence(str(err.value))


def test_the_launcher_checks_eval_before_any_rank(tmp_path):
    config = tmp_path / "model.yaml"
    data = _token_file(tmp_path / "corpus.bin")
    check_model_config({"model": MODEL, "data": data.name, "eval": {"fraction": 0.1}}, config)
    with pytest.raises(ConfigError, match="eval.batches"):
        check_model_config({"model": MODEL, "data": data.name, "eval": {"fraction": 0.1, "batches": -2}}, config)
    _token_file(tmp_path / "held.bin", vocab=128)  # a held-out file of a larger vocabulary than the model's
    with pytest.raises(ConfigError, match=r"model.vocab_size is 64, below the vocabulary of the data file .*held"):
        check_model_config({"model": MODEL, "data": data.name, "eval": {"data": "held.bin"}}, config)


# ---------------------------------------------------------------------------------------- held-out data


def test_split_held_out_keeps_the_tail_out_of_training(tmp_path):
    path = _token_file(tmp_path / "corpus.bin", tokens=1003, vocab=2048)  # each token's id is its position
    whole = TokenFile(path, 7, seed=3)  # windows of 8 tokens: 125 whole ones
    train, held = split_held_out(whole, 0.1)
    cut = 1003 - math.ceil(0.1 * 125) * 8  # 13 windows held out
    assert train.span == (0, cut) and held.span == (cut, 1003)
    # every token training reads, over 20 epochs of its 6 steps, lies before the cut; every held-out one after
    assert max(int(train.global_batch(step, 16).max()) for step in range(120)) < cut
    assert held.windows_per_epoch == 12  # its stream shifts its cut by up to seq_len tokens, as any token file's
    assert min(int(held.global_batch(i, 6).min()) for i in range(2)) >= cut
    with pytest.raises(ConfigError, match=r"eval.fraction is 0.99, .* lower eval.fraction") as err:
        split_held_out(whole, 0.99, field="eval.fraction")
    _one_sentence(str(err.value))


def test_held_out_stream_per_option(tmp_path):
    path = _token_file(tmp_path / "corpus.bin")
    stream = TokenFile(path, 7)
    assert held_out_stream(None, stream, None, None) == (stream, None)
    train, held = held_out_stream(EvalOptions(fraction=0.2), stream, None, None)
    assert train.span[1] == held.span[0] < stream.span[1]
    opened = []
    assert held_out_stream(EvalOptions(data="held.bin"), stream, str(tmp_path / "model.yaml"),
                           lambda p: opened.append(p) or "held") == (stream, "held")
    assert opened == [tmp_path / "held.bin"]  # relative to the model config
    chain = MarkovTokens(64, 7, seed=1)
    same, unseen = held_out_stream(EvalOptions(), chain, None, None)
    assert same is chain and isinstance(unseen, UnseenSteps)


def test_the_chain_is_evaluated_on_sequences_training_never_draws():
    chain = MarkovTokens(64, 7, seed=1, branching=2)
    held = UnseenSteps(chain)
    training = {tuple(chain.global_batch(step, 4)[0].tolist()) for step in range(50)}
    for i in range(3):
        inputs, targets = held.batch(i, 4)
        assert tuple(torch.cat([inputs[0], targets[0, -1:]]).tolist()) not in training
        for a, b in zip(inputs.flatten(), targets.flatten()):  # the same chain: every step is a successor
            assert int(b) in chain.successors[int(a)].tolist()


def test_a_held_out_set_too_small_for_the_batches_is_refused(tmp_path):
    _, held = split_held_out(TokenFile(_token_file(tmp_path / "corpus.bin"), 7), 0.1)  # 13 windows, 12 rows
    ctx = SimpleNamespace(mesh=SimpleNamespace(dp=2, dp_rank=1), device=torch.device("cpu"))
    batches = stream_eval_batches(ctx, held, rows=3, count=2)  # 12 rows: fits
    assert batches(1)[0].shape == (3, 7)
    with pytest.raises(ConfigError, match=r"eval.batches is 3: 3 batches of 3 rows x 2 DP ranks need 18 held-out "
                                          r"rows of seq_len 7, but .* holds 12; lower eval.batches") as err:
        stream_eval_batches(ctx, held, rows=3, count=3)
    _one_sentence(str(err.value))


# ------------------------------------------------------------------------------------------- evaluation


def test_due_every_n_steps_and_at_the_last():
    assert [s for s in range(1, 11) if Evaluation(None, 1, 4).due(s, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if Evaluation(None, 1, 0).due(s, 10)] == [10]
    with pytest.raises(ConfigError, match="Evaluation.count"):
        Evaluation(None, 0)


class Dropping(torch.nn.Module):
    """A model whose loss depends on its mode (dropout), recording whether gradients were on."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.drop = torch.nn.Dropout(0.5)
        self.frozen = torch.nn.Dropout(0.5)
        self.grad_enabled = []

    def forward(self, x, y):
        self.grad_enabled.append(torch.is_grad_enabled())
        return ((self.frozen(self.drop(self.linear(x))) - y) ** 2).mean()


def _engine(model):
    torch.manual_seed(0)
    return hybrid.initialize(model, {"zero_optimization": {"stage": 1}, "precision": "fp32",
                                     "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})


def test_run_steps_reports_the_held_out_loss_and_leaves_the_state_alone():
    model = Dropping()
    engine = _engine(model)
    engine.module.frozen.eval()  # a submodule the user keeps in eval mode stays so
    x, held = torch.randn(4, 4), torch.randn(2, 4)
    evaluation = Evaluation(lambda i: (held[i:i + 1], held[i:i + 1].sum(1, keepdim=True)), count=2, every=2)
    records = []
    ctx = Context(None, {}, JobSettings(steps=5, micro_batch=4, stage=1, precision="fp32"), reporter=records.append)
    states = {}

    def before_and_after(ctx, engine, step):
        if step == 5:
            states["before"] = {n: (v.master.clone(), {k: s.clone() for k, s in v.states.items()})
                                for n, v in engine.shard_views().items()}
            states["again"] = evaluation.run(ctx, engine)
            states["after"] = {n: (v.master.clone(), {k: s.clone() for k, s in v.states.items()})
                               for n, v in engine.shard_views().items()}

    summary = run_steps(ctx, engine, lambda step: (x, x.sum(1, keepdim=True)), evaluate=evaluation,
                        after_step=[before_and_after])
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps if "eval_loss" in r] == [2, 4, 5]
    last = steps[-1]
    assert last["eval_ppl"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-12)
    assert last["eval_time_s"] >= 0 and summary["eval_loss"] == last["eval_loss"]
    # the loss of the mode-free model (dropout off) on the held-out rows, without gradients
    with torch.no_grad():
        expected = sum(((model.linear(held[i:i + 1]) - held[i:i + 1].sum(1, keepdim=True)) ** 2).mean().item()
                       for i in range(2)) / 2
    assert last["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert states["again"]["eval_loss"] == last["eval_loss"]
    assert model.training and model.drop.training and not model.frozen.training  # each mode put back
    # forwards: 5 training ones with gradients, 3 + 1 evaluations of 2 batches without
    T, F = True, False
    assert model.grad_enabled == [T, T, F, F, T, T, F, F, T, F, F, F, F]
    for name, (master, st) in states["before"].items():
        assert torch.equal(master, states["after"][name][0])
        assert all(torch.equal(s, states["after"][name][1][k]) for k, s in st.items())
    assert engine.optimizer_step_count == 5 and all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------------------------- the driver


def _record(rank: int, step: int, evaluated: bool) -> dict:
    record = {"rank": rank, "step": step, "dp_rank": rank, "tp_rank": 0, "loss": 3.0 - step / 10,
              "job_loss": 3.0 - step / 10, "step_time_s": 0.1, "throughput_unit": "tokens", "tokens": 100}
    if evaluated:
        record.update(eval_loss=2.5 - step / 100, eval_ppl=math.exp(2.5 - step / 100), eval_time_s=0.02)
    return record


def test_the_driver_shows_writes_and_summarizes_the_evaluations(tmp_path):
    tensorboard = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    writer = MetricsWriter(tmp_path, tensorboard=True)
    out = io.StringIO()
    progress = Progress(total_steps=3, world_size=2, stream=out, tty=False, on_step=writer.write)
    for step in (1, 2, 3):
        for rank in (0, 1):
            progress.add({"rank": rank, "reports": [_record(rank, step, evaluated=step != 1)]})
    progress.close()
    writer.close()
    lines = out.getvalue().splitlines()
    assert lines[1:3] == ["step 2/3  loss 2.8000  1,000 tokens/s", "step 2: eval loss 2.4800  perplexity 11.94"]
    assert lines[-1] == "step 3: eval loss 2.4700  perplexity 11.82"
    entries = read_metrics(tmp_path / "metrics.jsonl")
    assert "eval_loss" not in entries[0]
    assert [e["eval_loss"] for e in entries[1:]] == [2.48, 2.47]
    assert entries[2]["eval_ppl"] == pytest.approx(math.exp(2.47)) and entries[2]["eval_time_s"] == 0.02
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[2])["eval_loss"] == 2.47
    events = tensorboard.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("eval/loss")] == [(2, 2.48), (3, 2.47)]
    assert "train/eval_loss" not in events.Tags()["scalars"]
    summary = summary_lines({0: {"reference_loss": {"name": "unigram entropy", "nats": 4.0}}}, progress.history,
                            writer, "/tmp/logs")
    assert "held-out loss 2.4700 nats, perplexity 11.82 (evaluated after step 3)" in summary


def test_step_entry_takes_the_eval_from_any_rank_that_reported_it():
    entry = step_entry(4, {1: _record(1, 4, True)})  # rank 0's report lost with its process
    assert entry["eval_loss"] == 2.46 and entry["ranks_reported"] == 1
    assert "eval_loss" not in step_entry(4, {0: _record(0, 4, False)})


@pytest.mark.slow  # imports transformers
def test_the_hf_loop_evaluates_its_held_out_windows(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hybrid.models import hf

    transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                             tie_word_embeddings=False).save_pretrained(tmp_path / "tiny")
    path = tmp_path / "corpus.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 2000).astype("<u2").tofile(path)
    metadata_path(path).write_text(TokenFileMeta("uint16", 64, 2000).to_json())
    records, engines = [], []
    model_config = {"hf": {"config": str(tmp_path / "tiny"), "seq_len": 7}, "data": str(path),
                    "eval": {"fraction": 0.2, "batches": 2}}
    mesh = SimpleNamespace(dp=1, dp_rank=0, tp=1, tp_rank=0, dp_group=None, tp_group=None, tp_comm=None)
    ctx = Context(mesh, model_config, JobSettings(steps=2, micro_batch=2, stage=1, precision="fp32"),
                  reporter=records.append)
    summary = hf.train(ctx, after_step=[lambda ctx, engine, step: engines.append(engine)])
    evaluated = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [2] and summary["eval_loss"] == evaluated[0]["eval_loss"]
    _, held = split_held_out(TokenFile(path, 7), 0.2)
    model = engines[-1].module
    with torch.no_grad():
        expected = sum(model(**hf.causal_lm_batch(*held.batch(i, 2))).loss.item() for i in range(2)) / 2
    assert evaluated[0]["eval_loss"] == pytest.approx(expected, rel=1e-6)
