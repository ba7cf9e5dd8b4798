"""The Hydra group and the schema, composed with verl's own fully-async config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from timeslice_verl.config.schema import ConfigError, enabled_settings, load_settings
from timeslice_verl.config.overrides import compose, options


def compose_verl(overrides: list[str]):
    """verl's fully_async_ppo_trainer composed as its hydra.main would, via Hydra's compose API."""
    from verl_harness import compose as compose_with_verl

    return compose_with_verl(overrides)


@pytest.mark.verl
def test_verl_fully_async_config_accepts_the_option_and_dotted_overrides():
    cfg = compose_verl(
        ["+timeslice=interleave", "timeslice.agent.socket=/run/ts/agent.sock", "timeslice.tenant.url=http://127.0.0.1:9000"]
    )
    assert cfg.timeslice.enabled is True
    assert cfg.timeslice.agent.socket == "/run/ts/agent.sock"
    assert cfg.timeslice.tenant.url == "http://127.0.0.1:9000"
    # the option also sets the verl keys time-slicing needs
    assert cfg.async_training.trigger_parameter_sync_step == 1
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.TIMESLICE_JOB == cfg.timeslice.job == "timeslice"
    assert env.NCCL_CUMEM_ENABLE == "0" and env.NCCL_NVLS_ENABLE == "0"
    # verl's own keys are untouched
    assert cfg.async_training.require_batches == 1
    settings = enabled_settings(cfg)
    assert settings is not None and settings.tenant.url == "http://127.0.0.1:9000"


@pytest.mark.verl
def test_verl_config_without_the_option_has_no_section():
    cfg = compose_verl([])
    assert "timeslice" not in cfg
    assert enabled_settings(cfg) is None
    assert cfg.async_training.trigger_parameter_sync_step == 4


@pytest.mark.verl
def test_off_option_validates_but_is_disabled():
    cfg = compose_verl(["+timeslice=off", "timeslice.job=other"])
    assert cfg.timeslice.enabled is False
    assert enabled_settings(cfg) is None


@pytest.mark.verl
@pytest.mark.parametrize(
    "override, key",
    [
        ("timeslice.agent.sockett=/x", "timeslice.agent.sockett"),
        ("timeslice.agent.driver_timeout_s=soon", "timeslice.agent.driver_timeout_s"),
        ("timeslice.tenant.sleep_level=deep", "timeslice.tenant.sleep_level"),
    ],
)
def test_verl_compose_rejects_bad_keys_and_types_naming_the_key(override, key):
    with pytest.raises(Exception) as err:
        compose_verl(["+timeslice=interleave", override])
    text = f"{err.value}\n{err.value.__cause__}"
    assert key in text


@pytest.mark.parametrize(
    "override, key",
    [
        ("timeslice.agent.sockett=/x", "timeslice.agent.sockett"),
        ("timeslice.agent.gpus=abc", "timeslice.agent.gpus"),
        ("timeslice.adapter=forked", "timeslice.adapter"),
        ("timeslice.agent.backend=magic", "timeslice.agent.backend"),
        ("timeslice.job=no/slashes", "timeslice.job"),
        ("timeslice.tenant.url=localhost:8000", "timeslice.tenant.url"),
        ("timeslice.handoff.acquire_timeout_s=-1", "timeslice.handoff.acquire_timeout_s"),
    ],
)
def test_compose_outside_verl_names_the_bad_key(override, key):
    with pytest.raises(ConfigError) as err:
        compose("interleave", [override])
    assert err.value.key == key
    assert str(err.value).startswith(key + ":")


def test_load_settings_validates_plain_sections():
    with pytest.raises(ConfigError, match=r"^timeslice\.tenant\.request_timeout_s:"):
        load_settings({"tenant": {"request_timeout_s": "fast"}})
    with pytest.raises(ConfigError, match=r"^timeslice\.unknown:"):
        load_settings(OmegaConf.create({"unknown": 1}))
    assert load_settings({"agent": {"gpus": [0, 1]}}).agent.gpus == [0, 1]


def test_options_ship_with_the_package():
    assert {"interleave", "off", "observe"} <= set(options())
    assert compose("observe").plugins.disabled == ["agent"]
    assert compose("interleave", ["timeslice.agent.backend=sigstop"]).agent.backend == "sigstop"
    with pytest.raises(ConfigError, match="trainer.total_epochs"):
        compose("interleave", ["trainer.total_epochs=3"])  # refused: the command could not apply it


def test_the_one_gpu_option_alone_has_no_section_and_says_how_to_combine_it():
    from timeslice_verl.config.overrides import compose

    with pytest.raises(ConfigError, match=r"^timeslice: the option chosen sets only verl's keys .*\+timeslice=\[one_gpu,interleave\]"):
        compose("one_gpu")
    assert compose("interleave", ["+timeslice=[one_gpu,interleave]"]) == compose("interleave")
    with pytest.raises(ConfigError, match="an override removed it"):
        compose("interleave", ["+timeslice=interleave", "~timeslice"])


def test_one_tenant_per_gpu_replaces_the_options_single_url():
    from timeslice_verl.config.overrides import compose

    urls = '["http://127.0.0.1:8001","http://127.0.0.1:8002/"]'
    settings = compose("interleave", [f"timeslice.tenant.urls={urls}"])  # interleave sets tenant.url too
    assert settings.tenant.urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    with pytest.raises(ConfigError, match=r"timeslice.tenant.urls\[1\]"):
        compose("interleave", ['timeslice.tenant.urls=["http://127.0.0.1:8001","ftp://x"]'])
    with pytest.raises(ConfigError, match=r"timeslice.tenant.urls: 'http://127.0.0.1:8001/' is listed twice"):
        compose("interleave", ['timeslice.tenant.urls=["http://127.0.0.1:8001","http://127.0.0.1:8001/"]'])
    with pytest.raises(ConfigError, match=r"timeslice.tenant.url: 'http://a:1,http://a:1' is not an http\(s\) URL \(several"):
        compose("interleave", ["timeslice.tenant.url='http://a:1,http://a:1'"])


REFUSED_BY_VERL = [
    ["timeslice=interleave"],  # no '+': verl's config has no timeslice default to override
    ["+timeslice=interleave", "+timeslice=observe"],  # two options
    ["+timeslice=schema"],  # the schema is not an option
    ["+timeslice=interleavee"],
    ["+timeslice=interleave", "timeslice.bogus=1"],
    ["+timeslice=interleave", "timeslice.adapter=zz"],
    ["+timeslice=interleave", "timeslice.agent.gpus=abc"],
]


def _message(exc: BaseException) -> str:
    """Hydra's words without the name of the primary config (verl's differs from the CLI's) or its search path."""
    import re

    text = str(exc).split("Config search path:")[0]
    return " ".join(re.sub(r"^In '[^']+': ", "", text).split())


@pytest.mark.verl
@pytest.mark.parametrize("overrides", REFUSED_BY_VERL, ids=" ".join)
def test_the_config_command_refuses_what_verl_refuses_with_the_same_message(overrides):
    from click.testing import CliRunner

    from timeslice_verl.tools.cli import main

    with pytest.raises(Exception) as verl_refused:
        compose_verl(overrides)
    result = CliRunner().invoke(main, ["config", *overrides])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert _message(verl_refused.value) in " ".join(result.output.split()), (result.output, str(verl_refused.value))


@pytest.mark.parametrize("overrides", [*REFUSED_BY_VERL, ["timeslice.job=a/b"], ["trainer.x=1"], ["--option", "off", "+timeslice=observe"]],
                         ids=" ".join)
def test_no_refused_config_prints_a_traceback(overrides):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "timeslice_verl", "config", *overrides], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.splitlines()[-1].startswith("Error: ")


def test_the_config_command_prints_every_key_in_the_trainers_syntax_and_reads_it_back():
    from click.testing import CliRunner

    from timeslice_verl.tools.cli import main

    result = CliRunner().invoke(main, ["config", "+timeslice=observe", "timeslice.agent.gpus=[1,2]", "timeslice.job=x"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "+timeslice=observe" and "timeslice.agent.gpus=[1,2]" in lines
    assert compose("interleave", lines) == compose("observe", ["timeslice.agent.gpus=[1,2]", "timeslice.job=x"])
    assert "schema" not in options()


@pytest.mark.verl
def test_a_job_renamed_in_one_place_only_is_refused_before_launch():
    from timeslice_verl.adapters.preflight import preflight

    with pytest.raises(ConfigError, match=r"^timeslice.job: is 'other' but ray_kwargs.ray_init.runtime_env.env_vars.TIMESLICE_JOB is 'timeslice'"):
        preflight(compose_verl(["+timeslice=interleave", "timeslice.job=other"]))
    preflight(compose_verl(["+timeslice=interleave", "timeslice.job=other",
                            "ray_kwargs.ray_init.runtime_env.env_vars.TIMESLICE_JOB=other"]))


def test_tenant_addresses_are_a_list_from_the_config_on_and_a_comma_list_is_refused_by_name():
    settings = load_settings({"tenant": {"urls": ["http://127.0.0.1:8001/", "http://127.0.0.1:8002"]}})
    assert settings.tenant.urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert load_settings({"tenant": {"url": "http://127.0.0.1:8001/"}}).tenant.urls == ["http://127.0.0.1:8001"]
    assert load_settings({"tenant": {"url": "http://127.0.0.1:9",  # an option's default: urls wins
                                     "urls": ["http://localhost:8001", "http://127.0.0.1:8002"]}}).tenant.urls == [
        "http://localhost:8001", "http://127.0.0.1:8002"]
    assert load_settings({}).tenant.urls == []
    with pytest.raises(ConfigError, match=r"^timeslice.tenant.url: .* \(several servers: timeslice.tenant.urls=\[...\]\)"):
        load_settings({"tenant": {"url": "http://127.0.0.1:8001,http://127.0.0.1:8002"}})
    with pytest.raises(ConfigError, match=r"^timeslice.batch.tenant_urls\[1\]: 'x' is not an http"):
        load_settings({"batch": {"tenant_urls": ["http://127.0.0.1:8001", "x"]}})
    with pytest.raises(ConfigError, match=r"^timeslice.batch.tenant_urls: 'http://localhost:8001' is listed twice"):
        load_settings({"batch": {"tenant_urls": ["http://127.0.0.1:8001", "http://localhost:8001"]}})



@pytest.mark.parametrize("section, message", [
    ({"validate": {"enable": True}}, r"^timeslice.validate.policy_url: validation is on .* no policy tenant"),
    ({"validate": {"policy_url": "policy:8000"}}, r"^timeslice.validate.policy_url: 'policy:8000' is not an http"),
    ({"validate": {"policy_url": "http://127.0.0.1:8001"}, "batch": {"tenant_urls": ["http://127.0.0.1:8001"]}},
     r"^timeslice.validate.policy_url: .* also in batch.tenant_urls"),
    ({"validate": {"source": "weights"}}, r"^timeslice.validate.source: 'weights' is not 'package.module:factory'"),
    ({"validate": {"every": -1}}, r"^timeslice.validate.every: must be between 0"),
    ({"validate": {"priority": 101}}, r"^timeslice.validate.priority: must be between -100 and 100"),
    ({"validate": {"poll_s": 0}}, r"^timeslice.validate.poll_s: must be a number > 0"),
])
def test_a_validation_section_that_cannot_work_is_refused_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(section)


def test_validation_is_off_by_default_and_one_override_names_it():
    assert load_settings({}).validate.enable is False
    on = load_settings({"validate": {"enable": True, "policy_url": "http://127.0.0.1:8001"}}).validate
    assert on.enable and on.every == 0 and on.priority == 100
