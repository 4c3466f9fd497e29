"""Reward functions for tests (importable as reward_fns:NAME when tests/ is on sys.path)."""


def odd_length(completion: str, reference: str) -> float:
    """Cheap, text-dependent reward so that groups have different rewards."""
    return float(len(completion) % 2)


def exact(completion: str, reference: str) -> float:
    return float(completion.strip() == reference.strip())
