"""One home per knob: every spelling of an option is made from the table in `hsoffload.options` or checked against it
here, so that editing one spelling by hand fails a test, and changing a default in the table changes it everywhere."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hsoffload import options

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_header_is_generated_from_the_table() -> None:
    """csrc/include/hsoffload/options.h is the generator's output byte for byte (after editing the table, run
    `PYTHONPATH=python_shim python -m hsoffload.options --write`)."""
    assert (ROOT / options.HEADER).read_text() == options.cpp_header(), (
        "csrc/include/hsoffload/options.h differs from the table: run "
        "`PYTHONPATH=python_shim python -m hsoffload.options --write` and rebuild")


def test_the_engine_spells_no_option_by_hand() -> None:
    """scope.h's fields and the constructor's arguments come from the X-macro: no option name is declared or given a
    default anywhere else in the engine or the ops."""
    scope_h = (ROOT / "csrc/include/hsoffload/scope.h").read_text()
    registration = (ROOT / "ops/registration.cpp").read_text()
    ops_h = (ROOT / "ops/ops.h").read_text()
    assert "HSOFFLOAD_ENGINE_OPTIONS(HSOFFLOAD_OPTION_FIELD)" in scope_h
    assert "HSOFFLOAD_ENGINE_OPTIONS(HSOFFLOAD_OPTION_ARG)" in registration
    assert "make_scope(HSOFFLOAD_ENGINE_OPTION_PARAMS)" in ops_h
    for option in options.ENGINE_OPTIONS:
        assert not re.search(rf"\b(int64_t|bool|std::string)\s+{option.name}\s*[=;]", scope_h), option.name
        assert f'torch::arg("{option.name}")' not in registration, option.name


def test_offload_config_is_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import hsoffload

    for option in options.OPTIONS:
        if option.env:
            monkeypatch.delenv(option.env, raising=False)
    fields = {f.name for f in dataclasses.fields(hsoffload.OffloadConfig)}
    assert fields == {o.name for o in options.CONFIG_OPTIONS}
    config = hsoffload.OffloadConfig()
    assert {o.name: getattr(config, o.name) for o in options.CONFIG_OPTIONS} == {
        o.name: o.default for o in options.CONFIG_OPTIONS}
    assert config.engine_kwargs() == {o.name: "" if o.kind == options.PATH else o.default
                                      for o in options.ENGINE_OPTIONS}
    monkeypatch.setenv("HSOFFLOAD_MAX_HOST_BYTES", "2GiB")
    assert hsoffload.OffloadConfig().max_host_bytes == 2 << 30


@pytest.mark.parametrize("option", options.CONFIG_OPTIONS, ids=lambda o: o.name)
def test_every_knob_is_checked_with_its_name(option: options.Option) -> None:
    """A value of the wrong kind is refused naming the knob (one validation for OffloadConfig and Axolotl)."""
    import hsoffload

    bad = {options.BOOL: 1, options.PATH: "", options.POLICY: "everything"}.get(option.kind, -1)
    with pytest.raises((TypeError, ValueError), match=option.name):
        hsoffload.OffloadConfig(**{option.name: bad})


def test_policy_is_one_type_that_takes_the_strings() -> None:
    import hsoffload

    config = hsoffload.OffloadConfig(policy="sac")
    assert config.policy == "sac" and type(config.policy) is str  # the string users pass (YAML/JSON dump it)
    assert config.policy_name is options.PolicyName.SAC
    assert config.policy_name.offloads_sac_saves and config.policy_name.marks_layer_inputs
    assert hsoffload.OffloadConfig(policy=lambda t, n: True).policy_name is None
    with pytest.raises(ValueError, match="'hidden_states', 'sac', 'all', 'auto' or a callable"):
        options.PolicyName.parse("everything")


def test_no_policy_is_compared_by_name_outside_its_type() -> None:
    """What a policy does is asked of PolicyName (or hsoffload.offload.policy's functions for callables): no module
    compares a policy with a name."""
    names = r"""["'](hidden_states|sac|all)["']"""
    pattern = re.compile(rf"""(policy|offload)\w*\s*(==|!=|\bin\b)\s*[(]?{names}|{names}\s*(==|!=)\s*\w*(policy|offload)""")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "python_shim/hsoffload").rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_axolotl_keys_model_and_docstring_are_the_table() -> None:
    from hsoffload.integrations import axolotl_plugin as plugin

    keys = {o.axolotl_key for o in options.OPTIONS}
    assert set(plugin.KEYS) == keys
    assert set(plugin.HsOffloadArgs.model_fields) == keys
    guide = (ROOT / "docs/axolotl.md").read_text()
    for where, pattern, text in (("the plugin's docstring", r"^\s{4}(hsoffload_\w+): (\S+)", plugin.__doc__),
                                 ("docs/axolotl.md", r"^(hsoffload_\w+): (\S+)", guide)):
        documented = dict(re.findall(pattern, text, re.M))
        assert set(documented) == keys, (where, sorted(set(documented) ^ keys))
        wrong = {k: v for k, v in documented.items() if v != options.yaml_value(plugin.KEYS[k].default)}
        assert not wrong, f"defaults in {where}'s YAML that are not the table's: {wrong}"
    schema = plugin.HsOffloadArgs.model_json_schema()["properties"]
    assert schema["hsoffload_offload_fraction"]["anyOf"][0] == {"maximum": 1.0, "minimum": 0.0, "type": "number"}


def test_plan_flags_are_the_table() -> None:
    from hsoffload.tools.cli import build_parser

    parser = build_parser()
    plan = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "plan")[1]
    by_flag = {flag: action for action in plan._actions for flag in action.option_strings}
    flagged = [o for o in options.OPTIONS if o.plan_flag]
    assert {o.name for o in flagged} == {"prefetch_depth", "policy", "keep_last_layers", "share_copies"}
    for option in flagged:
        default = by_flag[option.plan_flag].default
        # --policy: none, the planner picks the table's default with checkpointing (all without)
        assert default == (None if option.kind == options.POLICY else option.default), option.name


def _docs_rows() -> dict[str, str]:
    text = (ROOT / "docs/usage.md").read_text().split("### Knobs", 1)[1].split("\n\n|", 1)[1]
    table = "|" + text.split("\n\n", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M))


def test_the_docs_table_is_the_table() -> None:
    rows = _docs_rows()
    assert set(rows) == {o.name for o in options.CONFIG_OPTIONS}, sorted(set(rows) ^ {o.name for o in
                                                                                   options.CONFIG_OPTIONS})
    for option in options.CONFIG_OPTIONS:
        shown = f'`"{option.default.value}"`' if option.kind == options.POLICY else repr(option.default)
        if option.env:
            shown = f"`${option.env}`, else {shown}"
        assert rows[option.name].strip() == shown, (option.name, rows[option.name])


def test_a_default_changed_in_the_table_changes_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same table read by every consumer: a new default reaches OffloadConfig, the engine's arguments, the header,
    the Axolotl config and the plan flag without another edit."""
    import hsoffload
    from hsoffload.integrations import axolotl_plugin as plugin
    from hsoffload.tools.cli import build_parser

    changed = tuple(dataclasses.replace(o, default=3) if o.name == "prefetch_depth" else o for o in options.OPTIONS)
    monkeypatch.setattr(options, "OPTIONS", changed)
    monkeypatch.setattr(options, "BY_NAME", {o.name: o for o in changed})
    monkeypatch.setattr(options, "CONFIG_OPTIONS", tuple(o for o in changed if o.config))
    monkeypatch.setattr(options, "ENGINE_OPTIONS", tuple(o for o in changed if o.engine))
    assert hsoffload.OffloadConfig().prefetch_depth == 3
    assert hsoffload.OffloadConfig().engine_kwargs()["prefetch_depth"] == 3
    assert plugin.offload_config({}).prefetch_depth == 3
    assert "X(int64_t, prefetch_depth, 3)" in options.cpp_header()
    from hsoffload import plan

    assert plan.PlanInput(config="x", seq_len=8).prefetch_depth == 3
    assert build_parser().parse_args(["plan", "x", "--seq-len", "8"]).prefetch_depth == 3
