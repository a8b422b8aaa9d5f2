"""TRL's GRPOTrainer with klppo's KL control (`results/grpo_kl_control/`)."""
