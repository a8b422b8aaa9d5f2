"""The PPO trainer.

- `config.py`: `KLPPOConfig`, the training arguments;
- `build.py`: what the trainer is built from (checked inputs, policy, reference, critic, rewards);
- `plan.py`: the run's KL plan, decided once when the trainer is built;
- `trainer.py`: `KLPPOTrainer`, the loop and the steps of one update;
- `update.py`: the steps of one update after the rollout (rewards, KL, controller, advantages, the loss);
- `results.py`: the typed data each step of an update returns;
- `advantages.py`, `losses.py`: GAE, RLOO and GRPO advantages; the clipped policy and value losses;
- `actor_critic.py`: value heads, the separate critic and the actor-critic module the trainer optimises;
- `distributed.py`: what DDP, DeepSpeed and FSDP2 need from forward, backward and optimizer steps;
- `prompts.py`: dataset rows into left-padded prompt batches, and the endless stream of them;
- `generation/`: sampling responses: the engine seam, transformers' `generate`, vLLM, drift correction;
- `scoring/`: scoring sampled sequences under the policy, critic and reference; log-probs from logits;
- `safety/`: the KL guard, the checks of each optimizer step, non-finite values, rollback, PPO health;
- `run/`: what spans the updates: run state, checkpoints, reference resets, the output-dir lock, stop signals,
  callbacks.
"""

from .config import KLPPOConfig

__all__ = ["KLPPOConfig", "KLPPOTrainer"]


def __getattr__(name):
    if name == "KLPPOTrainer":
        from .trainer import KLPPOTrainer

        return KLPPOTrainer
    raise AttributeError(f"module 'klppo.ppo' has no attribute {name!r}")
