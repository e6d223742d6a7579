"""Run untrusted Python (model output) in a separate, isolated, limited process, never in
the training process: ``run_python(program, SandboxLimits(...)) -> SandboxResult``."""

from lightning_logra.sandbox.isolation import SandboxUnavailable
from lightning_logra.sandbox.limits import SandboxLimits
from lightning_logra.sandbox.runner import REPORT_FILE, SandboxResult, SandboxWarning, namespaces_problem, run_python

__all__ = [
    "REPORT_FILE",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "SandboxWarning",
    "namespaces_problem",
    "run_python",
]
