"""Each fault class's behaviour in the twin, one module per class (named by its registry entry,
keel/fault_classes.py). A module has:

    fire_scheduled(faults, entry)      strike a scheduled fault (a keel.recovery.ResolvedFault)
    arrivals(faults, table, rng)       the SimPy process of its drawn faults (its rate is on)

`faults` is the run's twin.faults.Faults (fault ids, the cluster, detection and repair).
What the trainer does about a fault is the Simulation's (twin/model.py, twin/stragglers.py);
coordinator_loss's part of it lives in its module too (`CoordinatorLossMixin`).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from keel import fault_classes as FC


def module(fault_class: str) -> ModuleType:
    """The twin module of `fault_class`; an unknown class raises ValueError."""
    return importlib.import_module(FC.get(fault_class).twin)
