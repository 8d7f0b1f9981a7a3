"""data=folder: class subfolders of real PNG files, against pixel arrays and statistics computed
here with NumPy; a short training through the trainer and through the command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from image_folders import write_class_folders
from omegaconf import OmegaConf

from moetrain import cli
from moetrain.config import LoggerConfig, OptimConfig, SettingError, TrainerConfig
from moetrain.data import image_folder
from moetrain.models import VisionMoE
from moetrain.train import Trainer, seed_everything
from moetrain.train.stream import BatchStream

CLASSES = ["blue", "green", "red"]  # sorted: class i is the i-th name


def reference_normalised(pixels_HW3: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(((pixels_HW3.astype(np.float64) / 255 - mean) / std).transpose(2, 0, 1)).float()


def test_normalisation_comes_from_the_training_images_only(tmp_path):
    written = write_class_folders(tmp_path / "train", per_class=5, size=8, seed=1)
    held = write_class_folders(tmp_path / "eval", per_class=2, size=8, seed=2)
    data = image_folder(str(tmp_path / "train"), eval_path=str(tmp_path / "eval"), image_size=8)
    assert data.task == "classification" and data.model_inputs == {"image_size": 8, "in_channels": 3, "num_classes": 3}
    train_pixels = np.stack([array for name in CLASSES for array in written[name]])  # [N, H, W, 3]
    mean = train_pixels.reshape(-1, 3).mean(axis=0) / 255
    std = (train_pixels.reshape(-1, 3) / 255).std(axis=0)
    assert len(data.train_set) == 15 and len(data.eval_set) == 6
    for index in range(len(data.train_set)):
        image, label = data.train_set[index]
        name, position = CLASSES[index // 5], index % 5
        assert label == CLASSES.index(name)
        torch.testing.assert_close(image, reference_normalised(written[name][position], mean, std), atol=1e-5, rtol=0)
    for index in range(len(data.eval_set)):
        image, label = data.eval_set[index]
        name = CLASSES[index // 2]
        assert label == CLASSES.index(name)
        torch.testing.assert_close(image, reference_normalised(held[name][index % 2], mean, std), atol=1e-5, rtol=0)


def test_images_of_any_size_become_squares_and_grey_has_one_channel(tmp_path):
    write_class_folders(tmp_path / "photos", per_class=3, size=(10, 14))
    data = image_folder(str(tmp_path / "photos"), image_size=6, channels=1, eval_fraction=0.34)
    image, _ = data.train_set[0]
    assert image.shape == (1, 6, 6) and data.model_inputs["in_channels"] == 1
    pixels = torch.stack([data.train_set[i][0] for i in range(len(data.train_set))])
    assert pixels.mean().item() == pytest.approx(0.0, abs=1e-5)  # normalised by its own statistics
    assert pixels.std(correction=0).item() == pytest.approx(1.0, abs=1e-4)


def test_the_held_out_split_takes_a_share_of_every_class(tmp_path):
    write_class_folders(tmp_path / "photos", per_class=8, size=4, classes=("a", "b"))
    write_class_folders(tmp_path / "photos", per_class=3, size=4, classes=("c",))
    data = image_folder(str(tmp_path / "photos"), image_size=4, eval_fraction=0.25, seed=3)
    train, held = data.train_set, data.eval_set
    assert sorted(set(train.paths) | set(held.paths)) == sorted(str(p) for p in (tmp_path / "photos").rglob("*.png"))
    assert not set(train.paths) & set(held.paths)
    held_per_class = [sum(1 for i in range(len(held)) if held[i][1] == label) for label in range(3)]
    assert held_per_class == [2, 2, 1]  # round(0.25 * 8), round(0.25 * 8), at least one of 3
    for dataset in (train, held):
        for index, path in enumerate(dataset.paths):
            assert dataset[index][1] == "abc".index(Path(path).parent.name)
    again = image_folder(str(tmp_path / "photos"), image_size=4, eval_fraction=0.25, seed=3).eval_set
    other = image_folder(str(tmp_path / "photos"), image_size=4, eval_fraction=0.25, seed=4).eval_set
    assert again.paths == held.paths and other.paths != held.paths


def test_an_eval_folder_may_hold_fewer_classes_with_the_same_names(tmp_path):
    write_class_folders(tmp_path / "train", per_class=2, size=4)
    write_class_folders(tmp_path / "eval", per_class=2, size=4, classes=("red",))
    data = image_folder(str(tmp_path / "train"), eval_path=str(tmp_path / "eval"), image_size=4)
    assert [data.eval_set[i][1] for i in range(2)] == [CLASSES.index("red")] * 2
    write_class_folders(tmp_path / "eval", per_class=1, size=4, classes=("purple",))
    with pytest.raises(ValueError, match="classes the training folder lacks: purple"):
        image_folder(str(tmp_path / "train"), eval_path=str(tmp_path / "eval"), image_size=4)


def variants(pixels_HW3: np.ndarray, padding: int, mean, std) -> list[torch.Tensor]:
    """Every image a random crop (black padding) and an optional horizontal flip can give."""
    size = pixels_HW3.shape[0]
    padded = np.pad(pixels_HW3, ((padding, padding), (padding, padding), (0, 0)))
    found = []
    for top in range(2 * padding + 1):
        for left in range(2 * padding + 1):
            crop = padded[top:top + size, left:left + size]
            for image in (crop, crop[:, ::-1]):
                found.append(reference_normalised(np.ascontiguousarray(image), mean, std))
    return found


def test_augmentation_draws_crops_and_flips_per_image_and_epoch(tmp_path):
    written = write_class_folders(tmp_path / "photos", per_class=3, size=6, seed=4)
    data = image_folder(str(tmp_path / "photos"), eval_path=str(tmp_path / "photos"), image_size=6, crop_padding=2,
                        horizontal_flip=True, seed=9)
    pixels = np.stack([array for name in CLASSES for array in written[name]])
    mean, std = pixels.reshape(-1, 3).mean(axis=0) / 255, (pixels.reshape(-1, 3) / 255).std(axis=0)
    seen = set()
    for epoch in range(6):
        data.train_set.set_epoch(epoch)
        for index in range(len(data.train_set)):
            image, _ = data.train_set[index]
            torch.testing.assert_close(data.train_set[index][0], image, atol=0, rtol=0)  # (seed, epoch, index) fix it
            possible = variants(written[CLASSES[index // 3]][index % 3], 2, mean, std)
            matches = [i for i, candidate in enumerate(possible) if torch.allclose(image, candidate, atol=1e-5)]
            assert matches, (epoch, index)
            seen.add(matches[0])
    assert len(seen) > 10  # many different crops and both flips were drawn
    torch.testing.assert_close(data.eval_set[0][0], variants(written["blue"][0], 0, mean, std)[0], atol=1e-5, rtol=0)


def test_bad_folders_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    write_class_folders(tmp_path / "broken", per_class=2, size=4)
    (tmp_path / "broken" / "red" / "bad.png").write_bytes(b"not a png at all")
    write_class_folders(tmp_path / "single", per_class=1, size=4)
    cases = [(dict(path=None), "path=None: give the folder"), (dict(path=str(tmp_path / "nowhere")), "is not a folder"),
             (dict(path=str(tmp_path / "empty")), "find any class folder.*the layout is FOLDER/CLASS_NAME/IMAGE"),
             (dict(path=str(tmp_path / "broken")), "bad.png is not a readable image"),
             (dict(path=str(tmp_path / "single")), "nothing can be held out"),
             (dict(path=str(tmp_path / "single"), channels=2), "channels=2: must be 3"),
             (dict(path=str(tmp_path / "single"), crop_padding=-1), "crop_padding=-1: must be")]
    for arguments, expected in cases:
        with pytest.raises(ValueError, match=expected) as error:
            image_folder(**arguments)
        assert "\n" not in str(error.value)


def test_the_trainer_learns_an_easy_image_folder(tmp_path):
    write_class_folders(tmp_path / "photos", per_class=40, size=8, seed=5)
    data = image_folder(str(tmp_path / "photos"), image_size=8, eval_fraction=0.25, horizontal_flip=True,
                        batch_size=16, eval_batch_size=64)
    seed_everything(0)
    model = VisionMoE(image_size=8, in_channels=3, patch_size=4, num_classes=3, dim=16, depth=2, num_heads=2,
                      num_experts=4, expert_hidden_size=32, moe_every=1)
    trainer = Trainer(model, data, trainer=TrainerConfig(max_steps=40, eval_every=0, checkpoint_every=0,
                                                         progress_bar=False),
                      optim=OptimConfig(lr=3e-3, warmup_steps=5), logger=LoggerConfig(tensorboard=False),
                      run_dir=tmp_path, seed=0, run_config={"model": {}})
    metrics = trainer.fit()
    assert len(data.eval_set) == 30 and metrics["eval/accuracy"] >= 0.8  # chance: 1/3


def test_the_command_trains_on_data_folder(tmp_path, monkeypatch):
    """conf/data/folder.yaml: every key is an argument of its builder, and `data=folder` runs."""
    config = OmegaConf.load(Path(cli.__file__).parent.parent / "conf" / "data" / "folder.yaml")
    assert config._target_ == "moetrain.data.folder.image_folder"
    write_class_folders(tmp_path / "photos", per_class=6, size=(9, 7))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "moetrain", "+recipe=quickstart", "data=folder", "data.path=photos", "data.image_size=8", "data.batch_size=8",
        "data.crop_padding=1", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.checkpoint_every=0",
        "trainer.progress_bar=false", "logger=none", "hydra.run.dir=run", "hydra/job_logging=none",
        "hydra/hydra_logging=none"])
    cli.main()
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["step"] == 2 and 0.0 <= metrics["eval/accuracy"] <= 1.0


def test_a_folder_smaller_than_one_batch_builds_but_does_not_train(tmp_path):
    """Evaluation can use a folder of any size; training needs one whole batch: a SettingError of one
    line (the command's exit code 2), not a traceback, and the same for every batch size it lacks."""
    write_class_folders(tmp_path / "few", per_class=3)  # 3 classes: 6 images to train on, 3 held out
    for batch_size in (7, 64):
        data = image_folder(str(tmp_path / "few"), image_size=4, batch_size=batch_size)
        assert len(data.train_set) == 6 and len(data.eval_set) == 3
        with pytest.raises(SettingError, match=f"the training set has 6 items, fewer than one batch of {batch_size}: "
                                               "lower the data's batch_size"):
            BatchStream(data.train_set, data.batch_size, num_workers=0, seed=0)
    images_BCSS, labels_B = next(iter(BatchStream(data.train_set, 6, num_workers=0, seed=0)))
    assert images_BCSS.shape == (6, 3, 4, 4) and labels_B.shape == (6,)
