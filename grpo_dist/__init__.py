"""grpo_dist: distributed GRPO for reasoning with verifiable rewards."""
__version__ = "0.1.0"
