"""Print exact pins for docker/constraints.txt from the active environment.

    python docker/pin_constraints.py > docker/constraints.txt.new

Walks grpo_dist's install_requires (setup.cfg) and torch's own requirements
through the installed distributions; torch, triton and nvidia-* are left out
because the image keeps the base image's CUDA build of torch.
"""
import configparser
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

HEADER = """\
# Exact versions installed into the image (pip install -c docker/constraints.txt):
# grpo_dist's dependencies and theirs, as tested in the project's CI venv.
# torch is not listed: the Dockerfile's TORCH_SPEC (default: the version CI tests) installs it.
# Refresh after changing setup.cfg: see docker/README.md."""


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": ""})


def main() -> None:
    cp = configparser.ConfigParser()
    cp.read("setup.cfg")
    roots = [Requirement(line).name for line in cp["options"]["install_requires"].splitlines() if line.strip()]
    pins: dict[str, str] = {}

    def walk(name: str) -> None:
        key = name.lower().replace("_", "-")
        if key in pins or key in ("torch", "triton") or key.startswith("nvidia-"):
            return
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            return
        pins[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if applies(req):
                walk(req.name)

    for name in roots:
        walk(name)
    for text in distribution("torch").requires or []:
        req = Requirement(text)
        if applies(req):
            walk(req.name)
    print(HEADER)
    for key in sorted(pins):
        print(f"{key}=={pins[key]}")


if __name__ == "__main__":
    main()
