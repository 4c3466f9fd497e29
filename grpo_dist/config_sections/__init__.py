"""Config sections: each section's dataclass next to its checks (base: what they share). grpo_dist.config composes
them into GRPOConfig and re-exports them, so `from grpo_dist.config import DataConfig` keeps working."""
