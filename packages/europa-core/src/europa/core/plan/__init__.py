"""The analytic planner behind ``europa plan`` and ``europa train``'s pre-flight check."""

from europa.core.plan.hardware import HardwareProfile, load_profile, shipped_profiles, this_machine
from europa.core.plan.planner import Plan, make_plan
from europa.spec.units import human

__all__ = [
    "HardwareProfile",
    "Plan",
    "human",
    "load_profile",
    "make_plan",
    "shipped_profiles",
    "this_machine",
]
