"""What a GPU check runs on: Python, the CUDA device torch sees, and the versions of the packages
the check imports. Writes them as JSON to the path given; exits 1 with one line naming the first
package that does not import (pdserve cannot run without it).

    python tools/gpu_env.py OUT.json
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import platform
import sys

# import name -> distributions whose version is reported (the first one installed)
REQUIRED = {
    "torch": ("torch",),
    "triton": ("triton",),
    "transformers": ("transformers",),
    "msgspec": ("msgspec",),
    "nixl._api": ("nixl-cu12", "nixl-cu13", "nixl"),
    "pytest": ("pytest",),
}
OPTIONAL = {"fla.ops.gated_delta_rule": ("fla-core", "flash-linear-attention")}


def _version(dists) -> str:
    for d in dists:
        try:
            return f"{d} {md.version(d)}"
        except md.PackageNotFoundError:
            continue
    return "installed (version unknown)"


def main(path: str) -> int:
    env: dict = {"python": f"{platform.python_version()} ({sys.executable})", "packages": {}}
    for mod, dists in REQUIRED.items():
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 (any import failure is the answer)
            print(f"cannot import {mod}: {type(e).__name__}: {e}")
            return 1
        env["packages"][mod.split(".")[0]] = _version(dists)
    for mod, dists in OPTIONAL.items():
        try:
            importlib.import_module(mod)
            env["packages"]["fla"] = _version(dists)
        except Exception as e:  # noqa: BLE001
            env["packages"]["fla"] = f"fla not available ({type(e).__name__})"
    import torch

    env["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
        env["gpu_count"] = torch.cuda.device_count()
    else:
        env["gpu"] = None
    with open(path, "w") as f:
        json.dump(env, f, indent=1)
    print(json.dumps(env, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
