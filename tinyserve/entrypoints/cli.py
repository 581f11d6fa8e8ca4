"""The ``tinyserve`` command: ``serve`` (the OpenAI-compatible server) and ``generate``."""

from __future__ import annotations

import argparse
import logging
import sys

from tinyserve.engine.arg_utils import EngineArgs, add_engine_args


def _generate(ns: argparse.Namespace) -> int:
    """A bad setting, file or prompt is one line and exit 1 (as ``serve``), not a traceback."""
    try:
        return _generate_or_raise(ns)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"tinyserve generate: {e}", file=sys.stderr)
        return 1


def _generate_or_raise(ns: argparse.Namespace) -> int:
    from tinyserve.entrypoints.llm import LLM
    from tinyserve.sampling_params import SamplingParams

    prompts = list(ns.prompt or [])
    if ns.file:
        with open(ns.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\r\n") for line in f if line.strip()]
    if not prompts:
        print("tinyserve generate: give a prompt or --file", file=sys.stderr)
        return 2
    # The sampling flags first: a bad one is told before the model loads.
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p,
                            max_tokens=ns.max_tokens, seed=ns.seed, stop=ns.stop or [])  # fmt: skip
    llm = LLM(**vars(EngineArgs.from_namespace(ns)))
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        if len(prompts) > 1:
            print(f"### {prompt}")
        print(out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the results")
    gen.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--log-level", default="warning")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    try:
        from tinyserve.entrypoints.api_server import add_serve_parser
    except ImportError:  # the server is optional at import time for `generate`
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(ns.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if _is_torchrun_worker(ns):
        return 0
    return int(ns.func(ns) or 0)


def _is_torchrun_worker(ns: argparse.Namespace) -> bool:
    """Under torchrun, ranks > 0 of `serve` / `generate` serve the model shard to rank 0
    (which runs the command itself) and exit when it stops."""
    if getattr(ns, "tensor_parallel_size", 1) == 1:
        return False
    from tinyserve.worker.tp_worker import run_torchrun_worker

    config = EngineArgs.from_namespace(ns).create_configs()
    return run_torchrun_worker(config.load, config.cache, config.parallel.tensor_parallel_size)


if __name__ == "__main__":
    sys.exit(main())
