"""Load a checkpoint written by the `moetrain` command into plain Python and run inference.

    python examples/12_cli_checkpoint_inference.py runs/<date>_<time>_quickstart    # a run of yours
    python examples/12_cli_checkpoint_inference.py                                  # trains a short one first

A checkpoint (runs/<run>/checkpoints/step_<N>.pt) is one torch.save file holding the composed
config ("config", plain dicts) and the weights ("model"), among the optimizer and data state a
resumed run needs. The config names the builders (`_target_`), so the model is rebuilt with the
same code the command used, without Hydra, and the data set's evaluation split is rebuilt too.
"""

import json
import pydoc
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from moetrain.models.routing_settings import layer_kwargs


def latest_checkpoint(path: Path) -> Path:
    """A checkpoint file, or the newest one of a run directory."""
    if path.is_file():
        return path
    found = sorted((path / "checkpoints").glob("step_*.pt"))
    if not found:
        raise SystemExit(f"no checkpoints in {path / 'checkpoints'}: pass a run directory of the moetrain command")
    return found[-1]


def build(node: dict, **extra):
    """Call node["_target_"] with the node's other keys (what Hydra's instantiate does)."""
    kwargs = {key: value for key, value in node.items() if key != "_target_"}
    return pydoc.locate(node["_target_"])(**kwargs, **extra)


def load_for_inference(checkpoint: Path):
    # Our own checkpoint (it holds RNG states, not only tensors), so a full load is fine.
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    config = state["config"]
    data = build(config["data"])
    # As the command does: the data fixes the model's input/output sizes unless the model config
    # sets them, and every MoE layer gets the run's routing (the gate node it saved).
    inputs = {key: value for key, value in data.model_inputs.items() if key not in config["model"]}
    model = build(config["model"], **inputs, moe_kwargs=layer_kwargs(config["gate"]))
    model.load_state_dict(state["model"])
    return model.eval(), data, state["step"]


def train_a_short_run(run_dir: Path, steps: int) -> None:
    """The quickstart recipe, shortened: a small VisionMoE on synthetic images."""
    command = [sys.executable, "-m", "moetrain", "+recipe=quickstart", f"trainer.max_steps={steps}",
               "trainer.eval_every=0", "trainer.eval_batches=0", "trainer.checkpoint_every=0",
               "data.train_size=1024", "data.eval_size=256", "trainer.progress_bar=false", "logger=none",
               f"hydra.run.dir={run_dir}"]
    print("running:", " ".join(command[1:]))
    subprocess.run(command, check=True, capture_output=True)


@torch.no_grad()
def main(run_dir=None, steps=30):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as scratch:
        if run_dir is None:
            run_dir = Path(scratch, "run")
            train_a_short_run(run_dir, steps)
        run_dir = Path(run_dir)
        checkpoint = latest_checkpoint(run_dir)
        model, data, step = load_for_inference(checkpoint)
        model.to(device)
        print(f"{checkpoint}: {type(model).__name__} at step {step}")

        correct = total = 0
        for images, labels in torch.utils.data.DataLoader(data.eval_set, batch_size=256):
            predictions = model(images.to(device)).argmax(-1).cpu()
            correct += int((predictions == labels).sum())
            total += labels.numel()
        accuracy = correct / total
        metrics_file = run_dir / "metrics.json"
        reported = json.loads(metrics_file.read_text()).get("eval/accuracy") if metrics_file.exists() else None
    print(f"accuracy on the {total} evaluation images: {accuracy:.4f} (the run reported {reported})")
    images, labels = next(iter(torch.utils.data.DataLoader(data.eval_set, batch_size=8)))
    print(f"first 8 labels {labels.tolist()}, predicted {model(images.to(device)).argmax(-1).tolist()}")
    return {"accuracy": accuracy, "reported_accuracy": reported, "step": step,
            "num_classes": data.model_inputs.get("num_classes")}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
