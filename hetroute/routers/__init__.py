"""Router registry: one file per router in this folder, found by name.

Adding a router means adding one module here that defines a ``Router``
subclass with a ``name``; nothing else changes. Discovery imports the modules
of this package on first use (no import-time registration, no mutable global
table). An out-of-tree router is named ``package.module:ClassName``, or registers
by name from an installed package through the ``hetroute.routers`` entry-point group.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from importlib.metadata import entry_points

from .base import Problem, Router, RouterParams

#: Installed packages register routers here, e.g. in pyproject.toml:
#: ``[project.entry-points."hetroute.routers"] mine = "mypkg.mine:MyRouter"``
ENTRY_POINT_GROUP = "hetroute.routers"

__all__ = ["Problem", "Router", "RouterParams", "available", "get_router"]


@cache
def _discover() -> dict[str, type[Router]]:
    found: dict[str, type[Router]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        try:
            module = importlib.import_module(f"{__name__}.{info.name}")
        except Exception as err:  # noqa: BLE001 - one broken router file is named, not a traceback
            raise KeyError(f"router module {__name__}.{info.name} failed to import: "
                           f"{type(err).__name__}: {err}") from None
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, Router) and obj.__module__ == module.__name__
                    and "name" in obj.__dict__):
                if obj.name in found:
                    raise RuntimeError(f"router name {obj.name!r} is defined twice "
                                       f"({found[obj.name].__module__} and {module.__name__})")
                found[obj.name] = obj
    for ep in entry_points(group=ENTRY_POINT_GROUP):  # installed plug-ins
        try:
            obj = ep.load()
        except Exception as err:  # noqa: BLE001
            raise KeyError(f"router plug-in {ep.name!r} ({ep.value}) failed to load: "
                           f"{type(err).__name__}: {err}") from None
        if not (isinstance(obj, type) and issubclass(obj, Router) and "name" in obj.__dict__):
            raise KeyError(f"router plug-in {ep.name!r} ({ep.value}) is not a Router subclass "
                           f"with a name")
        if obj.name in found and found[obj.name] is not obj:
            raise KeyError(f"router name {obj.name!r} of plug-in {ep.value} is taken by "
                           f"{found[obj.name].__module__}")
        found[obj.name] = obj
    return found


def available() -> list[str]:
    """Names of every in-tree router, sorted."""
    return sorted(_discover())


def get_router(name: str) -> type[Router]:
    """A router class by registered name, or by ``package.module:Class``."""
    if ":" in name:
        mod_name, _, cls_name = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), cls_name)
        except Exception as err:  # noqa: BLE001 - the module's own import-time code included
            raise KeyError(f"cannot load router {name!r}: {type(err).__name__}: {err}") from None
        if not (isinstance(obj, type) and issubclass(obj, Router)):
            raise KeyError(f"{name!r} is not a hetroute.routers.Router subclass")
        return obj
    routers = _discover()
    if name not in routers:
        raise KeyError(f"unknown router {name!r}; known: {', '.join(sorted(routers))}")
    return routers[name]
