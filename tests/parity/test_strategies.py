"""parity.strategies: profiles chosen by PARITY_HYPOTHESIS_PROFILE, reproducible failures."""
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import settings

from parity import strategies

PY = sys.executable


def test_the_three_profiles_are_registered_and_ci_is_deterministic_without_a_database():
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.database is None and ci.deadline is None and ci.print_blob
    assert ci.max_examples <= 10 and strategies.CERTIFY_EXAMPLES["ci"] <= ci.max_examples
    assert settings.get_profile("dev").max_examples > ci.max_examples
    assert settings.get_profile("thorough").max_examples > settings.get_profile("dev").max_examples


def test_the_session_runs_the_profile_named_by_the_environment():
    expected = os.environ.get(strategies.PROFILE_ENV) or "ci"
    assert settings.default.max_examples == settings.get_profile(expected).max_examples


def test_an_unknown_profile_name_is_refused(monkeypatch):
    monkeypatch.setenv(strategies.PROFILE_ENV, "fastest")
    with pytest.raises(ValueError, match="fastest"):
        strategies.profile_name()


def test_a_failing_property_prints_a_reproducible_blob(tmp_path):
    test = tmp_path / "test_fails.py"
    test.write_text(textwrap.dedent("""
        from hypothesis import given
        from parity.strategies import seeds

        @given(seeds())
        def test_seed_is_small(seed):
            assert seed < 1000
    """))
    env = dict(os.environ, PARITY_HYPOTHESIS_PROFILE="ci")
    out = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert "@reproduce_failure(" in out.stdout, out.stdout[-2000:]
