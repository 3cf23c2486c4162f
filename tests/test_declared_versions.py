"""The version range setup.cfg declares is the one tested: ``launch/oldest-constraints.txt`` pins every bound
setup.cfg declares for torch, DeepSpeed, transformers, accelerate, TRL and PEFT to exactly that bound, and
``launch/newest-constraints.txt`` pins the same packages, each at or above it (``launch/versions.sh`` installs and
tests both ends)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
TESTED = ("torch", "deepspeed", "transformers", "accelerate", "trl", "peft")
"""The packages whose lowest and newest releases ``launch/versions.sh`` installs."""


def _declared_floors() -> dict[str, Version]:
    """``{package: lowest release}`` from setup.cfg's ``install_requires`` and its ``hf``, ``trl`` and ``peft``
    extras."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = config["options.extras_require"]
    lines = config["options"]["install_requires"].split("\n")
    for extra in ("hf", "trl", "peft"):
        lines += extras[extra].split("\n")
    floors = {}
    for line in filter(None, (line.strip() for line in lines)):
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                floors[requirement.name] = Version(spec.version)
    return floors


def _pins(name: str) -> dict[str, Version]:
    text = (ROOT / "launch" / f"{name}-constraints.txt").read_text()
    return {package: Version(release) for package, release in re.findall(r"^([\w.-]+)==(\S+)$", text, re.M)}


def test_the_oldest_pins_are_the_declared_floors() -> None:
    floors, oldest = _declared_floors(), _pins("oldest")
    assert set(TESTED) <= set(floors), f"setup.cfg declares no lower bound for {set(TESTED) - set(floors)}"
    assert {package: oldest.get(package) for package in TESTED} == {package: floors[package] for package in TESTED}


def test_the_newest_pins_are_at_or_above_the_floors() -> None:
    floors, newest = _declared_floors(), _pins("newest")
    assert set(newest) == set(_pins("oldest")), "the two constraint files pin different packages"
    assert all(newest[package] >= floors[package] for package in TESTED), newest
