"""A reward model for the embedded arithmetic task (python -m launch.train_rm): a score head on
the SFT policy's trunk (model.path), trained with the Bradley–Terry loss on pairs where the
exact answer after `####` is preferred to the bare answer, a wrong answer or junk
(python -m launch.prepare_data --task=arith_prefs writes them), and scored by its pairwise
accuracy on held-out prompts' pairs. The model is written to <out_dir>/hf."""

from ml_collections import config_dict

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.model.path = "runs/rlhf_arith/sft/hf"  # the trunk to start from; empty: from scratch
    c.rm = config_dict.ConfigDict(
        dict(
            target="reward",  # reward | cost (the costlier side of each pair scores higher)
            train_files="runs/rlhf_arith/prefs/train.parquet",
            val_files="runs/rlhf_arith/prefs/test.parquet",
            max_response_length=0,  # 0: rollout.response_length
            steps=1500,
            batch_size=64,  # pairs per step
            micro_batch_size=64,
            lr=3e-4,
            weight_decay=0.0,
            grad_clip=1.0,
            sign_coef=0.0,  # Safe-RLHF's cost-sign term (needs unsafe labels)
            center_coef=0.01,  # keeps the scores' offset near 0
            mesh="fsdp=-1",
            eval_every=250,
        )
    )
    c.trainer.out_dir = "runs/rlhf_arith/rm"
    return c
