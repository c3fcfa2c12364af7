"""ExtConfig: every field, bad value, alias and conflict."""

from __future__ import annotations

import logging

import pytest

from rollout_ext.config import ALIASES, MODULES, ConfigError, ExtConfig


def test_defaults():
    cfg = ExtConfig.from_env({})
    assert cfg.enabled_modules == ["rope_cache"]
    assert (cfg.mc2_min_tokens, cfg.flashcomm_min_tokens) == (256, 256)
    assert cfg.strict is True
    assert cfg.task_queue_enable is None and cfg.hccl_op_expansion_mode is None
    assert cfg.graph_mode is None and cfg.tp_size is None and cfg.chunked_prefill is None


def test_frozen():
    cfg = ExtConfig.from_env({})
    with pytest.raises(AttributeError):
        cfg.mc2 = True


@pytest.mark.parametrize("field", MODULES + ("strict", "graph_mode"))
@pytest.mark.parametrize("raw,value", [("1", True), ("0", False), ("true", True), ("FALSE", False)])
def test_bool_fields(field, raw, value):
    cfg = ExtConfig.from_env({f"ROLLOUT_EXT_{field.upper()}": raw})
    assert getattr(cfg, field) is value


@pytest.mark.parametrize("field", MODULES + ("strict", "graph_mode"))
def test_bad_bool_names_variable_value_and_allowed(field):
    var = f"ROLLOUT_EXT_{field.upper()}"
    with pytest.raises(ConfigError) as e:
        ExtConfig.from_env({var: "maybe"})
    assert var in str(e.value) and "'maybe'" in str(e.value) and "0 or 1" in str(e.value)


@pytest.mark.parametrize("field", ["mc2_min_tokens", "flashcomm_min_tokens"])
def test_thresholds(field):
    var = f"ROLLOUT_EXT_{field.upper()}"
    assert getattr(ExtConfig.from_env({var: "1"}), field) == 1
    assert getattr(ExtConfig.from_env({var: " 4096 "}), field) == 4096
    for bad in ("0", "-3", "1.5", "many"):
        with pytest.raises(ConfigError, match=rf"{var}=.*integer >= 1"):
            ExtConfig.from_env({var: bad})


def test_empty_value_means_unset():
    assert ExtConfig.from_env({"ROLLOUT_EXT_MC2": ""}).mc2 is False


def test_task_queue_and_hccl():
    cfg = ExtConfig.from_env({"TASK_QUEUE_ENABLE": "1", "HCCL_OP_EXPANSION_MODE": "AIV"})
    assert cfg.task_queue_enable == 1 and cfg.hccl_op_expansion_mode == "AIV"
    with pytest.raises(ConfigError, match=r"TASK_QUEUE_ENABLE='3'.*0, 1 or 2"):
        ExtConfig.from_env({"TASK_QUEUE_ENABLE": "3"})
    with pytest.raises(ConfigError, match=r"HCCL_OP_EXPANSION_MODE='aiv'.*AIV"):
        ExtConfig.from_env({"HCCL_OP_EXPANSION_MODE": "aiv"})


def test_every_bad_value_reported_at_once():
    with pytest.raises(ConfigError) as e:
        ExtConfig.from_env({"ROLLOUT_EXT_MC2": "yes", "ROLLOUT_EXT_FLASHCOMM_MIN_TOKENS": "0"})
    assert "ROLLOUT_EXT_MC2" in str(e.value) and "ROLLOUT_EXT_FLASHCOMM_MIN_TOKENS" in str(e.value)


def test_unknown_prefixed_variable_is_a_typo():
    with pytest.raises(ConfigError, match="ROLLOUT_EXT_ROPECACHE is not a rollout_ext variable"):
        ExtConfig.from_env({"ROLLOUT_EXT_ROPECACHE": "1"})


@pytest.mark.parametrize("alias,field", sorted(ALIASES.items()))
def test_aliases_with_deprecation_note(alias, field, caplog):
    # The logger's own level: an earlier test in this worker may have raised the root logger's.
    caplog.set_level(logging.WARNING, logger="rollout_ext")
    cfg = ExtConfig.from_env({alias: "1"})
    assert getattr(cfg, field) is True
    assert any(alias in r.message and "deprecated" in r.message for r in caplog.records)


def test_alias_contradicting_canonical_is_an_error():
    with pytest.raises(ConfigError, match="contradicts ROLLOUT_EXT_MC2"):
        ExtConfig.from_env({"VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE": "1", "ROLLOUT_EXT_MC2": "0"})
    assert ExtConfig.from_env({"VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE": "1", "ROLLOUT_EXT_MC2": "1"}).mc2


CONFLICTS = [
    ({"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_FLASHCOMM": "1"}, {}, ["ROLLOUT_EXT_MC2", "ROLLOUT_EXT_FLASHCOMM"]),
    ({"ROLLOUT_EXT_FAV2": "1"}, {"chunked_prefill": True}, ["ROLLOUT_EXT_FAV2", "chunked prefill"]),
    ({"TASK_QUEUE_ENABLE": "2"}, {"enforce_eager": False}, ["TASK_QUEUE_ENABLE=2", "graph mode"]),
    ({"HCCL_OP_EXPANSION_MODE": "AIV", "ROLLOUT_EXT_MC2": "1"}, {}, ["HCCL_OP_EXPANSION_MODE=AIV"]),
    ({"ROLLOUT_EXT_FLASHCOMM": "1", "ROLLOUT_EXT_MLP_ONLY_TP": "1"}, {}, ["ROLLOUT_EXT_MLP_ONLY_TP"]),
]


@pytest.mark.parametrize("env,engine,words", CONFLICTS)
def test_each_conflict(env, engine, words):
    cfg = ExtConfig.from_env({})
    if engine:
        facts = dict(tp_size=2, chunked_prefill=False, enforce_eager=True) | engine
        cfg = ExtConfig.from_env(env).with_engine(**facts)
        with pytest.raises(ConfigError) as e:
            cfg.raise_on_conflicts()
    else:
        with pytest.raises(ConfigError) as e:
            ExtConfig.from_env(env)
    message = str(e.value)
    for word in words:
        assert word in message
    assert "1 feature conflict" in message


def test_conflicts_collected_in_one_error():
    env = {"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_FLASHCOMM": "1", "ROLLOUT_EXT_MLP_ONLY_TP": "1",
           "HCCL_OP_EXPANSION_MODE": "AIV"}
    with pytest.raises(ConfigError, match="3 feature conflict"):
        ExtConfig.from_env(env)


def test_explicit_graph_mode_wins_over_engine():
    cfg = ExtConfig.from_env({"ROLLOUT_EXT_GRAPH_MODE": "0", "TASK_QUEUE_ENABLE": "2"})
    merged = cfg.with_engine(tp_size=8, chunked_prefill=True, enforce_eager=False)
    assert merged.graph_mode is False and merged.conflicts() == []


def test_tp1_warns_not_fails():
    cfg = ExtConfig.from_env({"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_MLP_ONLY_TP": "1"})
    merged = cfg.with_engine(tp_size=1, chunked_prefill=True, enforce_eager=True)
    assert merged.conflicts() == []
    warnings = merged.warnings()
    assert any("ROLLOUT_EXT_MC2" in w for w in warnings) and any("MLP_ONLY_TP" in w for w in warnings)


def test_chunked_prefill_off_warns_unless_fav2():
    cfg = ExtConfig.from_env({})
    assert any("chunked prefill" in w for w in cfg.with_engine(tp_size=1, chunked_prefill=False, enforce_eager=True).warnings())
    fav2 = ExtConfig.from_env({"ROLLOUT_EXT_FAV2": "1"}).with_engine(tp_size=1, chunked_prefill=False, enforce_eager=True)
    assert not any("chunked prefill" in w for w in fav2.warnings())


def test_to_env_round_trips():
    env = {"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_MC2_MIN_TOKENS": "64", "ROLLOUT_EXT_STRICT": "0",
           "TASK_QUEUE_ENABLE": "2", "ROLLOUT_EXT_GRAPH_MODE": "0"}
    cfg = ExtConfig.from_env(env)
    assert ExtConfig.from_env(cfg.to_env()) == cfg


def test_every_module_record_is_a_switch_of_the_config():
    from rollout_ext import modules
    from rollout_ext.platform import STACKS

    fields = dict(zip(ExtConfig.__struct_fields__, ExtConfig.__struct_defaults__))
    for module in modules.MODULES:
        assert isinstance(fields[module.name], bool), module.name
        assert tuple(module.stacks) == STACKS, module.name
        for stack, binding in module.stacks.items():
            assert (binding.patch is None) != (binding.refusal == ""), (module.name, stack)
        cfg = ExtConfig.from_env({module.switch: "1", **{m.switch: "0" for m in modules.MODULES if m is not module}})
        assert cfg.enabled_modules == [module.name]


def test_module_switches_and_settings_come_from_the_module_table():
    from rollout_ext import modules

    cfg = ExtConfig()
    for module in modules.MODULES:
        assert getattr(cfg, module.name) is module.default, module.name
        flipped = ExtConfig.from_env({module.switch: "0" if module.default else "1"})
        assert getattr(flipped, module.name) is not module.default
    assert [s.name for s in modules.settings()] == ["mc2_min_tokens", "flashcomm_min_tokens", "draft_tokens",
                                                    "tail_batch_seqs"]
    for setting in modules.settings():
        assert getattr(cfg, setting.name) == setting.default
        assert getattr(ExtConfig.from_env({setting.variable: "3"}), setting.name) == 3
        with pytest.raises(ConfigError, match=f"{setting.variable}='0' is not allowed; use an integer >= 1"):
            ExtConfig.from_env({setting.variable: "0"})
