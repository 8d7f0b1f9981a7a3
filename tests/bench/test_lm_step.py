"""`python benchmarks/lm_step.py` on the CPU (a tiny preset): each optimizer choice trains the model it
names, with the moment dtype it names, and a step changes the weights."""

import pytest
import torch

from benchmarks import lm_step
from moetrain.train.optim import MasterWeightAdamW


@pytest.mark.parametrize("choice, moments", [("master", torch.float32), ("master-bf16", torch.bfloat16)])
def test_the_optimizer_choice_is_the_one_timed(monkeypatch, choice, moments):
    seen = []

    class Recorded(MasterWeightAdamW):
        def step(self, closure=None):
            before = [p.detach().clone() for group in self.param_groups for p in group["params"]]
            result = super().step(closure)
            after = [p for group in self.param_groups for p in group["params"]]
            seen.append((self.moment_dtype, {state["exp_avg"].dtype for state in self.state.values()},
                         sum(not torch.equal(b, a) for b, a in zip(before, after))))
            return result

    monkeypatch.setattr(lm_step, "MasterWeightAdamW", Recorded)
    results = lm_step.main(["--device", "cpu", "--preset", "qwen3_moe_tiny", "--batch-size", "2", "--seq-len", "16",
                            "--steps", "1", "--warmup", "1", "--variants", "moetrain:none", "--optimizer", choice])
    assert [r["variant"] for r in results] == ["moetrain:none:bf16:fused"] and "error" not in results[0]
    assert seen and all(dtype == moments and stored == {moments} and moved > 0 for dtype, stored, moved in seen)
