"""The trainer's display while it evaluates: an eval bar that counts the batches read, and a training
bar whose rate (hence its ETA) leaves the evaluation's time out."""

import time

import tqdm as tqdm_module

from moetrain.train import trainer as trainer_module
from test_resume import tiny_trainer


class _Recorder(tqdm_module.tqdm):
    """tqdm that remembers every bar it made, its description, total and final count."""

    made: list = []

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = False
        kwargs["file"] = open("/dev/null", "w")
        super().__init__(*args, **kwargs)
        _Recorder.made.append(self)


def test_evaluation_has_its_own_bar_and_stays_out_of_the_training_rate(tmp_path, monkeypatch):
    _Recorder.made = []
    monkeypatch.setattr(trainer_module, "tqdm", _Recorder)
    trainer = tiny_trainer(tmp_path, max_steps=4, eval_every=2, eval_batches=0, progress_bar=True)
    pauses = []
    slow_evaluate = trainer.evaluate

    def evaluate():
        started = time.perf_counter()
        metrics = slow_evaluate()
        time.sleep(0.5)  # a long evaluation
        pauses.append(time.perf_counter() - started)
        return metrics

    trainer.evaluate = evaluate
    started = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - started
    bars = {bar.desc: [] for bar in _Recorder.made}
    for bar in _Recorder.made:
        bars[bar.desc].append(bar)
    eval_bars = bars["eval"]
    assert len(eval_bars) == 2  # evaluations at steps 2 and 4
    batches = len(trainer.eval_loader)
    assert batches > 1 and all(bar.total == batches and bar.n == batches for bar in eval_bars)
    (train_bar,) = bars["train"]
    assert train_bar.n == 4
    # unpause() moved the bar's clock past each evaluation: its elapsed time leaves them out (each
    # one includes a 0.5 s sleep), so the bar's rate and ETA are those of training alone.
    assert len(pauses) == 2
    assert train_bar.format_dict["elapsed"] < wall - 0.9
