"""Reward functions for tests (importable as reward_fns:NAME when tests/ is on sys.path)."""


def odd_length(completion: str, reference: str) -> float:
    """Cheap, text-dependent reward so that groups have different rewards."""
    return float(len(completion) % 2)


def exact(completion: str, reference: str) -> float:
    return float(completion.strip() == reference.strip())


def char_parity(completion: str, reference: str) -> float:
    """Varies from completion to completion of random text (so groups are not flat)."""
    return float(sum(map(ord, completion)) % 2)
