"""trajbus under verl's default trainer (V1): one key on verl's own command.

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=trajbus.VerlAgentLoopManager

``VerlAgentLoopManager`` (``manager``) hands verl's prompts to agents through trajbus's gateway and
writes the groups the stream worker assembles into verl's TransferQueue (``feeder``); a resumed trainer
gets the groups that were ready before a crash from Kafka, not generated again (``dispatches``).
"""

from trajbus.pipelines.verl.manager import VerlAgentLoopManager, VerlSample

__all__ = ["VerlAgentLoopManager", "VerlSample"]
