"""The embedded visual task (hfjax.data.shapes): the answer is in the picture only, held-out
pictures are disjoint from training ones at the config's sizes whatever the seed, the rule
reward scores it, and a prompt batch writes each picture's image tokens where its placeholder
was."""

import io

import numpy as np
from PIL import Image

from configs import grpo_shapes
from hfjax import rewards  # noqa: F401  (registers the built-in rewards)
from hfjax.config import model_source
from hfjax.data import holdout, shapes
from hfjax.data.dataset import task_dataset, task_splits
from hfjax.rewards.registry import resolve_reward
from hfjax.workers import vision


def _red_cells(png: bytes) -> int:
    """Red squares counted from the decoded pixels, one sample at each cell's centre."""
    x = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    centres = x[shapes.CELL // 2::shapes.CELL, shapes.CELL // 2::shapes.CELL]
    return int(((centres[..., 0] > 150) & (centres[..., 1] < 100)).sum())


def test_held_out_pictures_are_disjoint_and_the_answer_is_in_them():
    cfg = grpo_shapes.get_config()
    tok = shapes.tokenizer()
    train, test = task_splits(cfg, tok)
    assert len(test) == cfg.data.n_test and len(train) == cfg.data.n_train
    keys = {holdout.problem_key(r) for r in test.rows}
    assert len(keys) == len(test) and all(holdout.is_heldout(k) for k in keys)
    assert not keys & {holdout.problem_key(r) for r in train.rows}
    cfg.seed, cfg.data.n_train = 3, 512
    assert not keys & {holdout.problem_key(r) for r in task_dataset(cfg, tok, "train").rows}
    # One question for every picture: only the picture tells the answers apart.
    assert {r["prompt"][-1]["content"] for r in train.rows} == {"<image>="}
    assert len({r["reward_model"]["ground_truth"] for r in test.rows}) == 4
    for r in test.rows[:32]:
        assert _red_cells(r["images"][0]) == int(r["reward_model"]["ground_truth"])
    score = resolve_reward(shapes.DATA_SOURCE, "rule").fn
    assert score(shapes.DATA_SOURCE, "#### 3", "3") == 1.0
    assert score(shapes.DATA_SOURCE, "#### 2", "3") == 0.0

    # The prompt batch: "<image>" written as the vision start, 4 image tokens (a 56 x 56
    # picture is 4 x 4 patches, merged 2 x 2), the vision end.
    vl = model_source.vision_model(cfg, tok, model_source.model_config(cfg, tok, "float32")
                                   ).config
    batch = vision.prompts(test.rows[:2], np.arange(2), tok.pad_id, 16, tok, vl)
    start, end, image = (tok.backend.token_to_id(t) for t in shapes.VISION_TOKENS)
    row = batch["prompts"][0][batch["prompt_mask"][0] > 0].tolist()
    assert row == [start, image, image, image, image, end, tok.encode("=")[0]]
    assert batch["image_grids"].tolist() == [[[1, 4, 4]], [[1, 4, 4]]]


def test_dry_run_prices_the_vision_tower():
    """The dry run compiles the tower's pass over the rollout's prompts and holds the frozen
    tower beside the actor: the state it counts exceeds the same model's without a tower by
    the tower's bytes; with the tower training, the actor's params and optimizer state hold it."""
    from hfjax.run import dry_run as dr

    cfg = grpo_shapes.get_config()
    cfg.sft.steps, cfg.trainer.test_freq = 0, 0
    report = dr.dry_run(cfg)
    text = cfg.copy_and_resolve_references()
    text.model.vision_depth, text.data.task = 0, "arith"
    text_state = sum(dr.global_bytes((g.params, g.opt_state))
                     for _, g in dr.device_groups(dr.abstract_groups(text)))
    actor = dr.abstract_groups(cfg).actor
    tower = actor.tower.frozen
    tower_bytes = dr.global_bytes(tower)
    assert tower_bytes > 0
    # Beyond the tower: the embedding rows of the shapes tokenizer's vision tokens.
    extra = report.state_bytes["global"] - text_state - tower_bytes
    assert 0 <= extra < tower_bytes / 50
    assert report.resident["global"]["actor vision tower (frozen)"] == dr.device_bytes(tower)
    encode = next(p for p in report.programs if p.name == "rollout.vision_encode")
    # The tower and 16 prompts of up to 16 x 4 patches of 3 x 2 x 14 x 14 values (with their
    # layout and order), per device.
    args = vision.abstract_prompts(actor, 16, 16)
    assert args[1].shape == (16, 64, 1176)
    assert encode.argument_bytes == dr.device_bytes(args) > dr.device_bytes(tower)
    assert encode.flops > 0
    # The tower is its argument, not resident besides: the pool's other state is.
    assert encode.resident_bytes == sum(report.resident["global"].values()) - dr.device_bytes(tower)
    assert [p.name for p in report.programs][:2] == ["rollout.vision_encode", "rollout.prefill"]

    cfg.actor.freeze_vision = False
    trains = dr.abstract_groups(cfg).actor
    text_actor = dr.abstract_groups(text).actor
    assert trains.tower.trains and trains.tower.frozen is None
    extra = dr.global_bytes(trains.params) - dr.global_bytes(text_actor.params) - tower_bytes
    assert 0 <= extra < tower_bytes / 50
    assert (dr.global_bytes(trains.opt_state)
            >= dr.global_bytes(text_actor.opt_state) + 2 * tower_bytes)
