"""The planning wing: `hsoffload plan` (`plan`, public as `hsoffload.plan`) and its memory model (`memory`).

Arithmetic on a config.json: imports neither torch nor the op library (tests/planning/test_plan_without_torch.py).
"""
