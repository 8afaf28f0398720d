"""What comes after pretraining: a reward model, PPO, DPO, and distillation. Book: chapters 21-22.

    rlhf.py      a reward model from preference pairs (Bradley-Terry), PPO against it, and DPO
    distill.py   a small student trained on a teacher's soft targets

The losses themselves are layers (``gptlab.layers``: bradley_terry, ppo, dpo, value_loss,
token_logprobs, distillation), each a forward/backward pair with its gradient check; this room
holds the loops that use them. May import: ``gptlab.training`` and everything below it.
"""
