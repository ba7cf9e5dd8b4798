"""A mistyped override names what it meant: the schema's closest key or choice, not Hydra's "use +key" (which
would add the typo as a new key). Through the command line, as a user meets it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from timeslice_verl.config.overrides import compose
from timeslice_verl.config.schema import ConfigError

TYPOS = [
    # override, the key named, what the message suggests
    ("timeslice.handof.swap=park", "timeslice.handof.swap", "did you mean timeslice.handoff.swap?"),
    ("+timeslice.handof.swap=park", "timeslice.handof.swap", "did you mean timeslice.handoff.swap?"),
    ("timeslice.handoff.swapp=park", "timeslice.handoff.swapp", "did you mean timeslice.handoff.swap?"),
    ("timeslice.tenant.urll=http://h:1", "timeslice.tenant.urll", "did you mean timeslice.tenant.url?"),
    ("timeslice.agent.backnd=sigstop", "timeslice.agent.backnd", "did you mean timeslice.agent.backend?"),
    ("timeslice.batch.prot=9000", "timeslice.batch.prot", "did you mean timeslice.batch.port?"),
    ("timeslice.handoff.swap=parkk", "timeslice.handoff.swap", "did you mean 'park'?"),
]


@pytest.mark.parametrize("override, key, hint", TYPOS)
def test_a_typo_is_named_with_what_it_meant(override, key, hint):
    with pytest.raises(ConfigError) as err:
        compose("interleave", [override])
    assert err.value.key == key
    assert hint in str(err.value)
    assert "To append" not in str(err.value)


NO_HINT = [
    # nothing close: Hydra's own words stand
    ("timeslice.zzzzz=1", "Could not override 'timeslice.zzzzz'"),
    # a free-form mapping takes new keys with "+": Hydra's advice is the right one
    ("timeslice.plugins.options.alert.threshold_s=30", "use +timeslice.plugins.options.alert.threshold_s=30"),
]


@pytest.mark.parametrize("override, words", NO_HINT)
def test_no_guess_where_nothing_is_close_or_keys_are_free(override, words):
    with pytest.raises(ConfigError) as err:
        compose("interleave", [override])
    assert words in str(err.value) and "did you mean" not in str(err.value)


def test_free_keys_appended_with_plus_compose():
    settings = compose("interleave", ["+timeslice.plugins.options.alert.threshold_s=30"])
    assert settings.plugins.options["alert"]["threshold_s"] == 30


def test_the_readme_example_through_the_command_line():
    out = subprocess.run([sys.executable, "-m", "timeslice_verl", "config", "timeslice.handof.swap=park"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "timeslice.handof.swap: no such setting; did you mean timeslice.handoff.swap?" in out.stderr
    assert "Traceback" not in out.stderr
