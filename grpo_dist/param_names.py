"""Parameter names as the plain Hugging Face model spells them. A leaf: the engines and the 8-bit optimizer's
checkpoint code (optim8bit.py) both name parameters this way, and neither may import the other's package."""

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """Parameter name without FSDP / activation-checkpoint wrapper prefixes."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name
