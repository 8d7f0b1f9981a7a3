"""Two optimizer steps of the Trainer against a hand-written forward, backward and update on the
same micro-batches: gradient accumulation (the mean over micro-batches), global-norm clipping,
weight decay on matrices only, linear warm-up, and AdamW (or SGD with momentum) written from the
published formulas. The model is an MoE classifier small enough to differentiate by hand:
flatten -> MoE layer (top-1 softmax gate, dropless, FFN experts) -> linear head, trained on
cross-entropy plus the weighted balance loss. Also: evaluation against a hand count, and
eval-mode determinism with router jitter on."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moetrain import MoELayer
from moetrain.config import LoggerConfig, OptimConfig, OptimizerName, TrainerConfig
from moetrain.data import synthetic
from moetrain.train import Trainer, seed_everything

FEATURES, EXPERTS, HIDDEN, CLASSES = 48, 4, 16, 4  # 3x4x4 images
BALANCE_WEIGHT = 0.1
LR, WEIGHT_DECAY, BETAS, EPS, MOMENTUM, WARMUP = 0.02, 0.3, (0.9, 0.95), 1e-6, 0.9, 3


class MoEClassifier(nn.Module):
    def __init__(self, jitter_eps: float = 0.0):
        super().__init__()
        self.moe = MoELayer(FEATURES, EXPERTS, HIDDEN, top_k=1, capacity_factor=0.0, impl="torch",
                            balance_loss_weight=BALANCE_WEIGHT, gate_kwargs={"jitter_eps": jitter_eps})
        self.head = nn.Linear(FEATURES, CLASSES)
        with torch.no_grad():  # non-zero expert biases, so their gradients and their (absent) decay show
            self.moe.experts.b1.normal_(std=0.3)
            self.moe.experts.b2.normal_(std=0.3)

    def forward(self, images):
        return self.head(self.moe(images.flatten(1)))


class Recording:
    """Wraps the trainer's batch stream and keeps every micro-batch it hands out."""

    def __init__(self, stream):
        self.stream, self.batches = stream, []

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.stream)
        self.batches.append(batch)
        return batch


def make_trainer(tmp_path, optimizer=OptimizerName.adamw, grad_clip=0.0, accum=3, jitter_eps=0.0) -> Trainer:
    seed_everything(0)
    data = synthetic(num_classes=CLASSES, image_size=4, train_size=48, eval_size=20, batch_size=8, eval_batch_size=6)
    return Trainer(
        MoEClassifier(jitter_eps),
        data,
        trainer=TrainerConfig(max_steps=50, grad_accum_steps=accum, grad_clip=grad_clip, progress_bar=False,
                              eval_every=0, checkpoint_every=0),
        optim=OptimConfig(name=optimizer, lr=LR, weight_decay=WEIGHT_DECAY, betas=list(BETAS), eps=EPS,
                          momentum=MOMENTUM, warmup_steps=WARMUP, min_lr_ratio=0.1),
        logger=LoggerConfig(tensorboard=False, log_every=1),
        run_dir=tmp_path,
        seed=0,
        run_config={"model": {"name": "reference"}},
    )


def hand_parameters(model: MoEClassifier) -> dict[str, torch.Tensor]:
    moe = model.moe
    names = {"gate": moe.gate.weight_ED, "w1": moe.experts.w1, "b1": moe.experts.b1, "w2": moe.experts.w2,
             "b2": moe.experts.b2, "head_w": model.head.weight, "head_b": model.head.bias}
    return {name: p.detach().double().clone() for name, p in names.items()}


# Weight decay applies to weight matrices: the router, the experts' w1/w2 and the head's weight;
# never to biases, including the experts' stacked [E, H] / [E, D] biases.
DECAYS = {"gate": True, "w1": True, "b1": False, "w2": True, "b2": False, "head_w": True, "head_b": False}


def hand_forward_backward(p: dict, images: torch.Tensor, labels: torch.Tensor):
    """-> (cross-entropy, balance loss, gradient of ce + BALANCE_WEIGHT * balance for each parameter)."""
    x = images.flatten(1).double()
    tokens = x.size(0)
    # Forward. Router: softmax over experts, the top-1 expert and its probability (Switch).
    z = x @ p["gate"].t()
    probs = torch.exp(z - z.max(1, keepdim=True).values)
    probs = probs / probs.sum(1, keepdim=True)
    expert = [int(row.argmax()) for row in probs]
    a = torch.stack([x[t] @ p["w1"][e] + p["b1"][e] for t, e in enumerate(expert)])
    r = a.clamp(min=0)
    o = torch.stack([r[t] @ p["w2"][e] + p["b2"][e] for t, e in enumerate(expert)])
    w = torch.stack([probs[t, e] for t, e in enumerate(expert)])
    h = w.unsqueeze(1) * o
    logits = h @ p["head_w"].t() + p["head_b"]
    shifted = logits - logits.max(1, keepdim=True).values
    log_softmax = shifted - shifted.exp().sum(1, keepdim=True).log()
    ce = -sum(log_softmax[t, int(labels[t])] for t in range(tokens)) / tokens
    f = torch.tensor([expert.count(e) / tokens for e in range(EXPERTS)], dtype=torch.float64)
    balance = EXPERTS * (f * probs.mean(0)).sum()

    # Backward, by the chain rule.
    g = {name: torch.zeros_like(value) for name, value in p.items()}
    dlogits = log_softmax.exp()
    for t in range(tokens):
        dlogits[t, int(labels[t])] -= 1
    dlogits /= tokens
    g["head_w"] = dlogits.t() @ h
    g["head_b"] = dlogits.sum(0)
    dh = dlogits @ p["head_w"]
    # d balance / d probs[t, e] = E * f_e / T (f counts choices, it carries no gradient).
    dprobs = (BALANCE_WEIGHT * EXPERTS * f / tokens).expand(tokens, EXPERTS).clone()
    for t, e in enumerate(expert):
        dprobs[t, e] += torch.dot(dh[t], o[t])
        do = w[t] * dh[t]
        g["w2"][e] += torch.outer(r[t], do)
        g["b2"][e] += do
        da = (p["w2"][e] @ do) * (a[t] > 0)
        g["w1"][e] += torch.outer(x[t], da)
        g["b1"][e] += da
    # Softmax backward: dz = p * (dp - <dp, p>).
    dz = probs * (dprobs - (dprobs * probs).sum(1, keepdim=True))
    g["gate"] = dz.t() @ x
    return float(ce), float(balance), g


def hand_steps(p: dict, steps: list[list[tuple]], optimizer: OptimizerName, grad_clip: float):
    """The update rule by hand -> (parameters after each step, (loss, aux, grad norm) of each step)."""
    state = {name: {"m": torch.zeros_like(v), "v": torch.zeros_like(v)} for name, v in p.items()}
    reports = []
    for step, micro_batches in enumerate(steps):
        accum = len(micro_batches)
        grads = {name: torch.zeros_like(v) for name, v in p.items()}
        ce_sum = aux_sum = 0.0
        for images, labels in micro_batches:  # the step's gradient: the mean over micro-batches
            ce, balance, g = hand_forward_backward(p, images, labels)
            ce_sum, aux_sum = ce_sum + ce, aux_sum + BALANCE_WEIGHT * balance
            for name in grads:
                grads[name] += g[name] / accum
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        if grad_clip and norm > grad_clip:  # scale the whole gradient onto the ball of radius grad_clip
            for name in grads:
                grads[name] *= grad_clip / (norm + 1e-6)
        lr = LR * (step + 1) / (WARMUP + 1)  # linear warm-up from lr / (warmup + 1) to lr
        for name, value in p.items():
            decay = WEIGHT_DECAY if DECAYS[name] else 0.0
            g, s = grads[name], state[name]
            if optimizer == OptimizerName.adamw:  # Loshchilov & Hutter: decoupled weight decay
                value.mul_(1 - lr * decay)
                s["m"] = BETAS[0] * s["m"] + (1 - BETAS[0]) * g
                s["v"] = BETAS[1] * s["v"] + (1 - BETAS[1]) * g * g
                m_hat = s["m"] / (1 - BETAS[0] ** (step + 1))
                v_hat = s["v"] / (1 - BETAS[1] ** (step + 1))
                value.sub_(lr * m_hat / (v_hat.sqrt() + EPS))
            else:  # SGD with momentum; weight decay as an L2 term in the gradient
                g = g + decay * value
                s["m"] = g if step == 0 else MOMENTUM * s["m"] + g
                value.sub_(lr * s["m"])
        reports.append((ce_sum / accum, aux_sum / accum, norm))
    return p, reports


@pytest.mark.parametrize(
    "optimizer,grad_clip",
    [(OptimizerName.adamw, 0.0), (OptimizerName.adamw, 0.3), (OptimizerName.adamw, 1000.0), (OptimizerName.sgd, 0.0),
     (OptimizerName.sgd, 0.3)],
    ids=["adamw", "adamw-clipped", "adamw-limit-not-reached", "sgd", "sgd-clipped"],
)
def test_two_steps_match_the_hand_written_update(tmp_path, optimizer, grad_clip):
    trainer = make_trainer(tmp_path, optimizer, grad_clip)
    start = hand_parameters(trainer.model)
    trainer.stream = Recording(trainer.stream)
    reported = [trainer._train_step().read() for _ in range(2)]
    reported = [(record.loss, record.aux, record.grad_norm) for record in reported]
    batches = trainer.stream.batches
    assert len(batches) == 6
    want, want_reports = hand_steps(start, [batches[:3], batches[3:]], optimizer, grad_clip)
    for (loss, aux, norm), (want_loss, want_aux, want_norm) in zip(reported, want_reports):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert aux == pytest.approx(want_aux, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-4)  # the norm before clipping
    if grad_clip == 0.3:
        assert min(report[2] for report in want_reports) > grad_clip  # clipping really acted
    elif grad_clip:
        assert max(report[2] for report in want_reports) < grad_clip  # on, but the limit is not reached
    got = hand_parameters(trainer.model)
    for name in want:
        moved, want_moved = got[name] - start[name], want[name] - start[name]
        torch.testing.assert_close(moved, want_moved, rtol=2e-3, atol=2e-6, msg=name)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(LR * 3 / (WARMUP + 1))  # after two steps


def test_accumulated_step_equals_one_big_batch(tmp_path):
    """Three micro-batches of 8 make the same gradient as the mean over their 24 samples' losses
    computed micro-batch by micro-batch (a sum instead of a mean would triple it)."""
    trainer = make_trainer(tmp_path, OptimizerName.sgd, grad_clip=0.0)
    trainer.stream = Recording(trainer.stream)
    start = hand_parameters(trainer.model)
    norm = trainer._train_step().read().grad_norm
    grads = [hand_forward_backward(start, *batch)[2] for batch in trainer.stream.batches]
    mean_norm = math.sqrt(sum(float(((sum(g[name] for g in grads) / 3) ** 2).sum()) for name in start))
    assert norm == pytest.approx(mean_norm, rel=1e-4)


def test_evaluate_matches_a_hand_count(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer._train_step()
    p = hand_parameters(trainer.model)
    loss_sum = correct = count = 0
    for images, labels in trainer.eval_loader:  # 20 samples in batches of 6, 6, 6, 2
        x = images.flatten(1).double()
        probs = torch.softmax(x @ p["gate"].t(), -1)
        rows = []
        for t in range(x.size(0)):
            e = int(probs[t].argmax())
            hidden = (x[t] @ p["w1"][e] + p["b1"][e]).clamp(min=0)
            rows.append(probs[t, e] * (hidden @ p["w2"][e] + p["b2"][e]))
        logits = torch.stack(rows) @ p["head_w"].t() + p["head_b"]
        for t in range(x.size(0)):
            loss_sum += float(torch.logsumexp(logits[t], 0) - logits[t, int(labels[t])])
            correct += int(int(logits[t].argmax()) == int(labels[t]))
            count += 1
    metrics = trainer.evaluate()
    assert count == 20
    assert metrics["eval/loss"] == pytest.approx(loss_sum / count, rel=1e-5)
    assert metrics["eval/accuracy"] == pytest.approx(correct / count)
    assert 0 < correct < count  # both right and wrong predictions are counted
    assert trainer.model.training  # evaluation hands the model back in training mode


def test_evaluation_is_deterministic_with_router_jitter(tmp_path):
    """Eval mode turns the jitter off: two evaluations agree exactly, and training-mode forward
    calls on the same batch do not."""
    trainer = make_trainer(tmp_path, jitter_eps=0.5)
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first == second
    images, _ = next(iter(trainer.eval_loader))
    with torch.no_grad():
        assert not torch.equal(trainer.model(images), trainer.model(images))
