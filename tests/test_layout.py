"""Packaging: the core imports no wing dependency, and every subpackage installs from a wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("peft", "lightning", "pytorch_lightning", "fastapi", "uvicorn", "datasets")
SUBPACKAGES = ("selfspec", "selfspec.train", "selfspec.adapters", "selfspec.serve")
DATA_PATTERNS = ("*.json", "*.jsonl", "*.yaml", "*.safetensors")  # as in pyproject.toml


def _python(code: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_core_imports_no_wing_dependency() -> None:
    code = f"import selfspec, sys; print([m for m in {HEAVY!r} if m in sys.modules])"
    assert _python(code, ROOT).strip() == "[]"


def _source_files(patterns: tuple[str, ...]) -> set[Path]:
    """Source files matching `patterns`, as paths relative to the installed `selfspec/` folder."""
    found: set[Path] = set()
    for top in ("selfspec", "train", "adapters", "serve"):
        for pattern in patterns:
            found |= {p.relative_to(ROOT) for p in (ROOT / top).glob(f"**/{pattern}")}
    # The core's files sit at the top of selfspec/; each wing becomes selfspec/<wing>/.
    return {p.relative_to("selfspec") if p.parts[0] == "selfspec" else p for p in found}


@pytest.mark.slow
def test_wheel_installs_every_subpackage(tmp_path: Path) -> None:
    # Build from a copy so the source tree gets no build/ or egg-info litter.
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("selfspec", "train", "adapters", "serve"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", source)
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
        check=True,
    )
    (wheel,) = wheels.glob("selfspec-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    for patterns in (("__init__.py",), DATA_PATTERNS):  # every package, every shipped data file
        installed = {
            p.relative_to(site / "selfspec")
            for pattern in patterns
            for p in site.glob(f"selfspec/**/{pattern}")
        }
        assert installed == _source_files(patterns)

    code = (
        "import importlib, json; "
        f"print(json.dumps({{m: importlib.import_module(m).__file__ for m in {SUBPACKAGES!r}}}))"
    )
    # cwd outside the source tree, so only the installed copy can be imported.
    files = json.loads(_python(code, tmp_path, env={**os.environ, "PYTHONPATH": str(site)}))
    for module, file in files.items():
        assert Path(file).resolve().is_relative_to(site.resolve()), (module, file)
