"""What a user installs: the wheel's dependencies, its built-in policies, and the layers of the code."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("clef_guard-*.whl")
    return built


def test_the_plain_install_pulls_neither_matplotlib_nor_peft(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    plain = {r.split(";")[0].split(">")[0].split("=")[0].split("[")[0].strip() for r in requires if "extra ==" not in r}
    assert "torch" in plain and "langchain-core" in plain
    assert not plain & {"matplotlib", "peft", "langchain", "langgraph", "starlette"}, plain
    train = {r.split(">")[0].strip() for r in requires if "extra == \"train\"" in r}
    assert {"peft", "matplotlib"} <= train


def test_an_installed_wheel_loads_its_built_in_policies_without_the_training_kit(wheel: Path, tmp_path: Path) -> None:
    """In a fresh venv (dependencies borrowed from this one), far from the checkout."""
    target = tmp_path / "venv"
    venv.create(target, with_pip=True)
    python = target / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    script = (
        "import sys, clef_guard\n"
        "assert clef_guard.__file__.startswith(sys.prefix), clef_guard.__file__\n"
        "policies = clef_guard.load_policies('destructive-actions', 'outbound-communication')\n"
        "print(sorted(p.name for p in policies), len(clef_guard.builtin_policies()))\n"
        "loaded = {m.split('.')[0] for m in sys.modules} | {m for m in sys.modules if m.startswith('clef_guard.')}\n"
        "print(sorted(loaded & {'matplotlib', 'peft', 'langchain', 'langgraph', 'clef_guard.training'}))\n"
    )
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([python, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    names, forbidden = done.stdout.splitlines()
    assert names == f"['destructive-actions', 'outbound-communication'] {len(list((ROOT / 'policies').glob('*.yaml')))}"
    assert forbidden == "[]"


def test_the_import_layers_hold() -> None:
    """pyproject.toml's import-linter contracts: layers, no training in an agent, no framework, no cycles."""
    done = subprocess.run([Path(sys.executable).parent / "lint-imports"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout
