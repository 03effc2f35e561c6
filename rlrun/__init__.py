"""rlrun: a declarative experiment runner for the efficiency techniques of LLM RL post-training."""

__version__ = "0.1.0"
