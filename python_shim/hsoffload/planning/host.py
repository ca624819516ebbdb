"""The host side of a plan: what the offload moves to each node's RAM, the pinned model states there, the
`max_host_bytes=auto` budget and what spills; the longest length the host holds without spilling. Stdlib only.
"""

from __future__ import annotations

import dataclasses

from ..options import AUTO_HOST_BUDGET_FRACTION
from . import memory as pm

_GIB = float(1 << 30)


# Pinned model states beyond this fraction of a node's RAM leave too little for the OS, data loaders, the processes.
HOST_STATES_FRACTION = 0.8


def offloaded_bytes_per_rank(shape: pm.ModelShape, s: pm.Setup) -> int:
    """What the offload policy moves to the host per rank and step: what backward holds for every layer but the
    last `keep_last_layers`."""
    held = [pm.held_per_layer_bytes(shape, s, pm.is_moe_layer(shape, i)) for i in range(shape.layers)]
    return sum(held[: shape.layers - s.keep_last_layers])


def host_limit(shape: pm.ModelShape, s: pm.Setup, host_ram: int, local: int, unit: int) -> int:
    """The longest multiple of `unit` tokens whose offloaded bytes fit the node's host budget without spilling, the
    pinned model states counted first (0 if they alone do not fit). What is offloaded grows linearly in the
    sequence, so one evaluation at `unit` tokens gives the slope."""
    states = pm.model_states_host_bytes(shape, s) * local
    at_unit = dataclasses.replace(s, seq_len=unit)
    host = host_side(host_ram, states, offloaded_bytes_per_rank(shape, at_unit) * local)
    if not host.states_fit:
        return 0
    per_unit = offloaded_bytes_per_rank(shape, at_unit) * local
    return host.budget // per_unit * unit if per_unit else 0


@dataclasses.dataclass(frozen=True)
class HostSide:
    """One node's host memory: RAM, the pinned model states, hsoffload's budget and where the offloaded bytes go."""

    ram: int
    model_states: int  # pinned model states of the node's ranks (cpu_offload)
    budget: int  # hsoffload's max_host_bytes=auto for the node: 80 % of what the model states leave
    offloaded_in_host: int
    spill: int

    @property
    def states_fit(self) -> bool:
        """The model states stay within HOST_STATES_FRACTION of the node's RAM."""
        return self.model_states <= HOST_STATES_FRACTION * self.ram


def host_side(host_ram: int, model_states_node: int, offloaded_node: int) -> HostSide:
    """The node's host side: the model states are pinned first (before the first step), so max_host_bytes=auto, read
    from MemAvailable when the scope starts, is 80 % of what they leave; what the offload needs beyond it spills."""
    budget = int(max(0, host_ram - model_states_node) * AUTO_HOST_BUDGET_FRACTION)
    in_host = min(offloaded_node, budget)
    return HostSide(ram=host_ram, model_states=model_states_node, budget=budget, offloaded_in_host=in_host,
                    spill=offloaded_node - in_host)


def host_advice(host: HostSide, s: pm.Setup) -> str:
    """One sentence: the model states on the host do not fit the node's RAM, and what would."""
    need = (f"the model states on the host need {host.model_states / _GIB:,.1f} GiB per node, more than "
            f"{HOST_STATES_FRACTION:.0%} of its {host.ram / _GIB:,.1f} GiB of RAM")
    lighter = " or --cpu-offload optimizer (weights stay on the device)" if s.cpu_offload == "params" else ""
    return f"{need}: more nodes (fewer ranks per node), a lighter optimizer{lighter}"
