"""Which network each phase of a task gets, resolved by Harbor's own trial rules and enforced by Sprout.

A Sprout sandbox is either on the network or not: `public` is on, `no-network` is off, and a host
allowlist (`allowlist`, e.g. SWE-bench Pro's agent phase) is enforced as no network at all, the
strictest reading of it, and said so in what is recorded. A live sandbox switches between phases
(`Sandbox.set_network`), so a task's agent phase can run offline and its verifier online.
"""

from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.models.task.task import Task
from harbor.models.task.verifier_mode import resolve_task_verifier_mode
from harbor.models.trial.config import AgentConfig as TrialAgentConfig
from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
from harbor.trial.network_policy import TrialNetworkPlan, resolve_trial_network_plan


def network_plan(task: Task) -> TrialNetworkPlan:
    """The task's network policy per phase, as a Harbor trial with default settings resolves it."""
    return resolve_trial_network_plan(task.config, TrialAgentConfig(), TrialEnvironmentConfig(), None,
                                      verifier_mode=resolve_task_verifier_mode(task.config))


def online(policy: NetworkPolicy) -> bool:
    """Whether a sandbox under `policy` is on the network (an allowlist is enforced as off)."""
    return policy.network_mode == NetworkMode.PUBLIC


def describe(policy: NetworkPolicy) -> str:
    """How the policy was enforced, for summaries: `public`, `no-network`, or the allowlist's reading."""
    if policy.network_mode == NetworkMode.ALLOWLIST:
        hosts = ", ".join(policy.allowed_hosts) or "no hosts"
        return f"allowlist ({hosts}) enforced as no-network"
    return policy.network_mode.value
