"""`hsoffload.plan`: the planner (`hsoffload.plan.plan(PlanInput(...))`), the public name of `hsoffload.planning.plan`.

This name is that very module. Like the whole planning wing it imports neither torch nor the op library.
"""

import sys

from .planning import plan as _module

sys.modules[__name__] = _module
