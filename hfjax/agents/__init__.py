"""Multi-turn rollouts with tools (docs/agents.md): the loop that alternates the rollout
engine's policy turns with tool turns (`loop`), how tool results are written into a trajectory
(`render`), the trajectories it returns (`trajectory`), and the checks of its settings made
when a run is built (`fit`). Its settings are `rollout.multi_turn`'s, read once into
`hfjax.engine.spec.MultiTurnSpec`."""

from hfjax.agents.fit import check_agent_fits, check_spec
from hfjax.agents.loop import AgentLoop
from hfjax.agents.render import close_tag_id, observation_renderer
from hfjax.agents.trajectory import AgentOutput, Trajectory, trajectory_json, turn_lists

__all__ = [
    "AgentLoop", "AgentOutput", "Trajectory", "check_agent_fits", "check_spec", "close_tag_id",
    "observation_renderer", "trajectory_json", "turn_lists",
]
