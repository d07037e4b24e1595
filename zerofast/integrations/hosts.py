"""What an integration relies on in its host framework (a `Reliance`), checked when the integration is imported.

An integration subclasses a framework's classes (transformers' Trainer, Accelerate's Accelerator, Lightning's
DDPStrategy and Precision) and overrides some of their methods, a few of them private. A host method renamed in a
new release would not fail: the override would simply stop being called, and training would go on without it. So
each integration keeps beside its code a table of what it overrides, reads and calls in its hosts, checked at
import (`check`: every member of a host class or module) and on the first host object it meets
(`check_instance`: attributes a host sets in its constructor, which no class carries).

A member missing or of another kind (a method become a property), an override that no longer takes every call
the host's method takes, a call the host no longer takes, or a member the integration adds under a name the host
now uses (it would hide the host's): an IncompatibleHostError naming each, with the versions written against and
those installed. A host version outside the supported range (the extras' range in pyproject.toml) is the same
error, unless ZEROFAST_ALLOW_UNTESTED_HOSTS=1 makes it a warning; one inside the range but not the one tested
(the Makefile's pin, which CI installs) is an UntestedHostWarning.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import os
import types
import warnings
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import IncompatibleHostError

__all__ = [
    "ALLOW_UNTESTED",
    "Calls",
    "IncompatibleHostError",
    "Overrides",
    "Pin",
    "Reads",
    "Reliance",
    "UntestedHostWarning",
    "check",
    "check_instance",
]

ALLOW_UNTESTED = "ZEROFAST_ALLOW_UNTESTED_HOSTS"  # =1: a host version outside the range warns instead
_MISSING = object()


class UntestedHostWarning(UserWarning):
    """The installed framework has everything the integration relies on, at a version it was not tested with."""


@dataclasses.dataclass(frozen=True)
class Pin:
    """One host distribution and its versions."""

    distribution: str  # as pip names it: "transformers", "pytorch-lightning"
    tested: str  # the version CI installs: the Makefile's pin
    supported: str  # the extras' range in pyproject.toml (a PEP 440 specifier set); the tested version is in it

    def contains(self, version: str) -> bool:
        try:
            return SpecifierSet(self.supported).contains(Version(version), prereleases=True)
        except InvalidVersion:
            return False


@dataclasses.dataclass(frozen=True)
class Overrides:
    """`ours` (a mixin or subclass) replaces these members of `host`: each must exist on `host`, be of
    the same kind (method, property, plain attribute) and, for a method, take every call the host's
    takes. Every other member `ours` defines must not exist on `host`, where it would replace the
    host's unnoticed. A constructor is not listed here: what it passes on is a `Calls`."""

    ours: type
    host: type
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Reads:
    """Members of a host class or module that the integration reads or calls as they are (methods,
    properties, dataclass fields, constants). on_instance: attributes the host's constructor sets,
    found on no class: check_instance checks them on the first object."""

    owner: Any  # a class or a module
    names: tuple[str, ...]
    on_instance: bool = False


@dataclasses.dataclass(frozen=True)
class Calls:
    """A host function or method that the integration calls with `positional` positional arguments
    (besides self) and these keywords: its signature must still take that call (no keyword gone, no
    new required argument)."""

    owner: Any  # a class or a module
    name: str
    positional: int = 0
    keywords: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Reliance:
    """What one integration relies on in its hosts: the table it keeps beside its code."""

    integration: str  # the module users import, e.g. "zerofast.integrations.hf"
    extra: str  # the pip extra that installs the supported versions: zerofast[<extra>]
    pins: tuple[Pin, ...]
    entries: tuple[Overrides | Reads | Calls, ...]


def check(reliance: Reliance, versions: dict[str, str | None] | None = None) -> None:
    """Check every class-level entry of `reliance` and the installed versions: raise an
    IncompatibleHostError naming what changed, or warn for an untested version (see the module's
    docstring). versions: distribution -> installed version (None: unknown), for tests; by default
    the installed distributions' metadata."""
    installed = (
        versions if versions is not None else {p.distribution: _installed(p.distribution) for p in reliance.pins}
    )
    problems = [
        text for entry in reliance.entries if not getattr(entry, "on_instance", False) for text in _problems(entry)
    ]
    if problems:
        raise IncompatibleHostError(_changed(reliance, installed, problems))
    outside = [p for p in reliance.pins if installed.get(p.distribution) and not p.contains(installed[p.distribution])]
    if outside and os.environ.get(ALLOW_UNTESTED) != "1":
        raise IncompatibleHostError(_outside(reliance, installed, outside))
    untested = [p for p in reliance.pins if not _same(installed.get(p.distribution), p.tested)]
    if untested:
        warnings.warn(_untested(reliance, installed, untested), UntestedHostWarning, stacklevel=2)


def check_instance(reliance: Reliance, obj: object) -> None:
    """The attributes `reliance` reads on instances of obj's host classes (Reads with on_instance):
    raise an IncompatibleHostError naming those obj lacks."""
    problems = [
        f"{_name(entry.owner, name)}: missing (an attribute its constructor set)"
        for entry in reliance.entries
        if isinstance(entry, Reads) and entry.on_instance and isinstance(obj, entry.owner)
        for name in entry.names
        if not hasattr(obj, name)
    ]
    if problems:
        versions = {p.distribution: _installed(p.distribution) for p in reliance.pins}
        raise IncompatibleHostError(_changed(reliance, versions, problems))


# --- the checks -----------------------------------------------------------------------------------


def _problems(entry: Overrides | Reads | Calls) -> list[str]:
    if isinstance(entry, Overrides):
        return _override_problems(entry)
    if isinstance(entry, Calls):
        return _call_problems(entry)
    return [f"{_name(entry.owner, name)}: missing" for name in entry.names if _lookup(entry.owner, name) is _MISSING]


def _override_problems(entry: Overrides) -> list[str]:
    ours, host, found = entry.ours, entry.host, []
    for name in entry.names:
        where = _name(host, name)
        mine, theirs = vars(ours).get(name, _MISSING), _lookup(host, name)
        if mine is _MISSING:  # the table is wrong, not the host: tests catch it before a release
            raise TypeError(f"hosts: {ours.__qualname__} does not define {name!r}, which its table says it overrides")
        if theirs is _MISSING:
            found.append(f"{where}: missing ({ours.__qualname__} overrides it)")
        elif _kind(theirs) != _kind(mine):
            found.append(f"{where}: a {_kind(theirs)} there, a {_kind(mine)} in {ours.__qualname__}")
        elif _kind(mine) == "method":
            host_signature, our_signature = _signature(theirs), _signature(mine)
            refused = _refused(host_signature, our_signature)
            if refused:
                found.append(
                    f"{where}{host_signature}: {ours.__qualname__}.{name}{our_signature} does not take "
                    f"{', '.join(refused)}"
                )
    for name in vars(ours):
        if name not in entry.names and not _dunder(name) and _lookup(host, name) is not _MISSING:
            found.append(f"{_name(host, name)}: now exists, and {ours.__qualname__}.{name} would replace it")
    return found


def _call_problems(entry: Calls) -> list[str]:
    where, static = _name(entry.owner, entry.name), _lookup(entry.owner, entry.name)
    if static is _MISSING:
        return [f"{where}: missing"]
    target = getattr(entry.owner, entry.name)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: its existence is all we can check
        return []
    # Through the class, a method is unbound (self comes first); static and class methods are not.
    takes_self = inspect.isclass(entry.owner) and not isinstance(static, (staticmethod, classmethod))
    arguments = [None] * (entry.positional + takes_self)
    try:
        signature.bind(*arguments, **dict.fromkeys(entry.keywords))
    except TypeError as e:
        call = ", ".join(["*"] * entry.positional + [f"{k}=" for k in entry.keywords])
        return [f"{where}{signature}: no longer takes the call ({call}): {e}"]
    return []


_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)


def _refused(host: inspect.Signature, ours: inspect.Signature) -> list[str]:
    """What a call the host's method takes may pass and ours would refuse, or leave out and ours requires."""
    return _refused_positions(host, ours) + _refused_keywords(host, ours) + _required_here(host, ours)


def _refused_positions(host: inspect.Signature, ours: inspect.Signature) -> list[str]:
    our_positional = [p.name for p in ours.parameters.values() if p.kind in _POSITIONAL]
    our_star = any(p.kind is _P.VAR_POSITIONAL for p in ours.parameters.values())
    refused = []
    for i, p in enumerate(p for p in host.parameters.values() if p.kind in _POSITIONAL):
        if i >= len(our_positional) and not our_star:
            refused.append(f"{p.name} (by position)")
        elif i < len(our_positional) and p.kind is _P.POSITIONAL_OR_KEYWORD and our_positional[i] != p.name:
            # passed by position it lands in ours, passed by keyword elsewhere
            refused.append(f"{p.name} (at position {i}, which is {our_positional[i]} here)")
    if any(p.kind is _P.VAR_POSITIONAL for p in host.parameters.values()) and not our_star:
        refused.append("more positional arguments (*args)")
    return refused


def _refused_keywords(host: inspect.Signature, ours: inspect.Signature) -> list[str]:
    our_keywords = {p.name for p in ours.parameters.values() if p.kind in _BY_KEYWORD}
    if any(p.kind is _P.VAR_KEYWORD for p in ours.parameters.values()):
        return []
    refused = [
        f"{p.name}= (by keyword)"
        for p in host.parameters.values()
        if p.kind in _BY_KEYWORD and p.name not in our_keywords
    ]
    if any(p.kind is _P.VAR_KEYWORD for p in host.parameters.values()):
        refused.append("more keyword arguments (**kwargs)")
    return refused


def _required_here(host: inspect.Signature, ours: inspect.Signature) -> list[str]:
    """Our parameters without a default that the host does not require: a call may leave them out."""
    required_there = {name for name, p in host.parameters.items() if _required(p)}
    return [
        f"a call without {name} (required here)"
        for name, p in ours.parameters.items()
        if _required(p) and name not in required_there
    ]


def _required(p: inspect.Parameter) -> bool:
    return p.default is _P.empty and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)


# --- lookups and names ------------------------------------------------------------------------------


def _lookup(owner: Any, name: str) -> Any:
    """The member as stored (a property, a function), without running a descriptor; a dataclass field
    without a class default counts; _MISSING if absent."""
    if inspect.isclass(owner):
        found = inspect.getattr_static(owner, name, _MISSING)
        if found is _MISSING and dataclasses.is_dataclass(owner):
            return next((f for f in dataclasses.fields(owner) if f.name == name), _MISSING)
        return found
    return getattr(owner, name, _MISSING)


def _kind(member: Any) -> str:
    if isinstance(member, (property, functools.cached_property)):
        return "property"
    if isinstance(member, (types.FunctionType, staticmethod, classmethod)):
        return "method"
    return "attribute"


def _signature(member: Any) -> inspect.Signature:
    return inspect.signature(member.__func__ if isinstance(member, (staticmethod, classmethod)) else member)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _name(owner: Any, name: str) -> str:
    if inspect.isclass(owner):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{owner.__name__}.{name}"


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None  # imported from a source tree without metadata: the version is unknown


def _same(installed: str | None, tested: str) -> bool:
    try:
        return installed is not None and Version(installed) == Version(tested)
    except InvalidVersion:
        return False


# --- the messages -------------------------------------------------------------------------------------


def _versions(pins, installed: dict[str, str | None]) -> str:
    return ", ".join(f"{p.distribution} {installed.get(p.distribution) or '(version unknown)'}" for p in pins)


def _against(reliance: Reliance) -> str:
    tested = ", ".join(f"{p.distribution} {p.tested}" for p in reliance.pins)
    supported = ", ".join(f"{p.distribution}{p.supported}" for p in reliance.pins)
    return f"written and tested against {tested}; supported: {supported}"


def _changed(reliance: Reliance, installed: dict[str, str | None], problems: list[str]) -> str:
    lines = "\n".join(f"  - {text}" for text in problems)
    return (
        f"{reliance.integration} relies on host members that the installed {_versions(reliance.pins, installed)} "
        f"no longer provide as it expects ({_against(reliance)}):\n{lines}\n"
        f'Install a supported version: pip install "zerofast[{reliance.extra}]".'
    )


def _outside(reliance: Reliance, installed: dict[str, str | None], outside: list[Pin]) -> str:
    return (
        f"{reliance.integration} does not support {_versions(outside, installed)} ({_against(reliance)}): it "
        f"overrides host methods, some of them private, whose behaviour may have changed although their names "
        f'remain. Install a supported version (pip install "zerofast[{reliance.extra}]"), or set '
        f"{ALLOW_UNTESTED}=1 to run anyway with a warning."
    )


def _untested(reliance: Reliance, installed: dict[str, str | None], untested: list[Pin]) -> str:
    return (
        f"{reliance.integration} runs on {_versions(untested, installed)}, which it was not tested with "
        f"({_against(reliance)}); every host member it relies on is present."
    )
