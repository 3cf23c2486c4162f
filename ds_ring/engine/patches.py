"""Every change ds_ring makes to an object of transformers, DeepSpeed or accelerate is made here, and undone here.

A change is a :class:`Patch`: one attribute of an object (:func:`set_attribute`: a class's method, a module's
function, a model instance's ``forward``, an engine's ``destroy``) or one entry of a mapping (:func:`set_item`:
transformers' attention and mask registries, its loss table), its replacement, and how to put back what was there
(:meth:`Patch.undo`: the original value, or nothing where the attribute was the class's or the entry absent). Each
names its library and is refused (``ValueError``) on a release outside :data:`SUPPORTED`, the releases its
replacement was written against, before anything changes; ``tests/test_patches.py`` checks, per patch, that what it
replaces still exists with the signature the replacement calls, so a library that changes it fails a test first.

Whoever applies a patch keeps it and undoes it: a session (transformers' registries, a model instance's methods),
the engine's attachments (``engine.step``, ``engine.destroy``, DeepSpeed's gather), a context (the Trainer's
``deepspeed.initialize`` and ``prepare_data_loader``). A hook of another framework (accelerate, TRL) goes through
:func:`set_attribute` / :func:`set_item` the same way, from its own module.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["SUPPORTED", "Patch", "set_attribute", "keep_attribute", "set_item", "check_library", "undo_all"]

SUPPORTED: dict[str, str] = {"deepspeed": ">=0.16", "transformers": ">=5", "accelerate": ">=1.12"}
"""The releases of each patched library the replacements were written against (as ``setup.cfg`` declares them)."""

_ABSENT = object()


@cache
def check_library(library: str) -> Version:
    """The installed release of ``library``; ``ValueError`` naming it and :data:`SUPPORTED` when it is outside."""
    if library not in SUPPORTED:
        raise ValueError(f"ds_ring patches only {sorted(SUPPORTED)}, not {library!r}")
    version = Version(importlib.metadata.version(library).split("+")[0])
    if not SpecifierSet(SUPPORTED[library]).contains(version, prereleases=True):  # a dev build of a release counts
        raise ValueError(
            f"ds_ring changes objects of {library} written for {library}{SUPPORTED[library]}, but {version} is "
            f"installed; install a release in that range"
        )
    return version


@dataclass
class Patch:
    """One change to a third-party object: ``target``'s attribute (or, with ``item``, entry) ``name`` set to
    ``value``, ``original`` what was there (``_ABSENT``: nothing of its own), until :meth:`undo`."""

    target: Any
    name: Any
    value: Any
    library: str
    item: bool = False
    original: Any = field(default=_ABSENT, repr=False)
    applied: bool = True

    def undo(self) -> None:
        """Put back what was there (idempotent). An attribute that the class provided is deleted from the object;
        a mapping entry that did not exist is removed."""
        if not self.applied:
            return
        self.applied = False
        if self.item:
            if self.original is _ABSENT:
                self.target.pop(self.name, None)
            else:
                self.target[self.name] = self.original
        elif self.original is _ABSENT:
            if self.name in getattr(self.target, "__dict__", {}):
                delattr(self.target, self.name)
        else:
            setattr(self.target, self.name, self.original)


def set_attribute(target: Any, name: str, value: Any, *, library: str) -> Patch:
    """``setattr(target, name, value)``, undoable: ``target``'s own attribute ``name`` (an instance attribute that
    hides the class's method, or a module's or class's own) is kept to be put back."""
    check_library(library)
    own = vars(target) if hasattr(target, "__dict__") else {}
    patch = Patch(target, name, value, library, original=own.get(name, _ABSENT))
    setattr(target, name, value)
    return patch


def keep_attribute(target: Any, name: str, *, library: str) -> Patch:
    """Nothing changed yet: what :meth:`Patch.undo` puts back, ``target``'s own attribute ``name`` as it is now, kept
    before a library call that changes it on ds_ring's behalf (transformers' ``gradient_checkpointing_enable``)."""
    check_library(library)
    own = vars(target) if hasattr(target, "__dict__") else {}
    return Patch(target, name, own.get(name, _ABSENT), library, original=own.get(name, _ABSENT))


def set_item(mapping: MutableMapping[Any, Any], key: Any, value: Any, *, library: str) -> Patch:
    """``mapping[key] = value``, undoable (the entry put back, or removed where there was none)."""
    check_library(library)
    patch = Patch(mapping, key, value, library, item=True, original=mapping.get(key, _ABSENT))
    mapping[key] = value
    return patch


def undo_all(patches: list[Patch]) -> None:
    """Undo ``patches`` in reverse order and empty the list."""
    while patches:
        patches.pop().undo()
