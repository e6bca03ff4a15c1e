"""parkway's public API: what an agent program, an environment or a trainer may import.

    from parkway.actors.sdk import AgentProgram, RolloutContext, Environment, ToolSpec, Trainer

Everything else under ``parkway`` is the framework's own and may change without notice.
"""

from parkway.actors.sdk.chat import Message, ToolSpec, parse_reply, system_prompt
from parkway.actors.sdk.environments import CallAnswer, CallKey, Environment, Record, ToolError
from parkway.actors.sdk.rollout import AgentProgram, ModelReply, RolloutContext, RolloutFailure, ToolOutcome
from parkway.actors.sdk.trainer import GroupResult, Trainer, TrainStep

__all__ = [
    "AgentProgram",
    "CallAnswer",
    "CallKey",
    "Environment",
    "GroupResult",
    "Message",
    "ModelReply",
    "Record",
    "RolloutContext",
    "RolloutFailure",
    "ToolError",
    "ToolOutcome",
    "ToolSpec",
    "TrainStep",
    "Trainer",
    "parse_reply",
    "system_prompt",
]
