"""Policies: YAML files compiled to typed questions and CEL rules, and their calibration files.

A policy file goes through :mod:`~clef_guard.policy.schema` (validation), is located for
error messages by :mod:`~clef_guard.policy.locate` and compiled by :mod:`~clef_guard.policy.load`.
"""

from clef_guard.policy.calibration import load_calibration as load_calibration
from clef_guard.policy.load import Policy as Policy
from clef_guard.policy.load import builtin_policies as builtin_policies
from clef_guard.policy.load import load_policies as load_policies
from clef_guard.policy.load import load_policy as load_policy
from clef_guard.policy.load import parse_policy as parse_policy

__all__ = ["Policy", "builtin_policies", "load_calibration", "load_policies", "load_policy", "parse_policy"]
