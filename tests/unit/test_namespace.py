"""Installed, trajbus puts one name on the path: every package lives under ``trajbus.``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import trajbus

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("infra", "streams", "gateway", "consumers", "pipelines")


def test_every_folder_is_installed_under_trajbus_and_nothing_else():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(name == "trajbus" or name.startswith("trajbus.") for name in setuptools["packages"])
    assert setuptools["package-dir"] == {"trajbus": "trajbus", **{f"trajbus.{f}": f for f in FOLDERS}}


def test_every_package_folder_is_declared_so_a_wheel_carries_it():
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"trajbus." + ".".join(init.parent.relative_to(ROOT).parts)
               for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    assert folders - packages == set(), "a package folder pyproject.toml does not list: `pip install .` leaves it out"


def test_no_module_imports_a_bare_top_level_name():
    bare = re.compile(rf"^\s*(from|import) ({'|'.join(FOLDERS)})\b", re.M)
    offenders = [str(path.relative_to(ROOT)) for folder in (*FOLDERS, "tests", "benchmarks")
                 for path in (ROOT / folder).rglob("*.py") if bare.search(path.read_text())]
    assert offenders == []


def test_the_contract_names_are_exported_lazily():
    assert {"Step", "StepProducer", "BatchConsumer", "VerlBackend", "EnvManager"} <= set(trajbus.__all__)
    assert trajbus.Step.__module__ == "trajbus.streams.wire.records"
