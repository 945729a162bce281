"""Every malformed input of the corpus ends in exit 2 and one line ``error: ...`` that names the
problem, with no traceback and no byte of a file outside the checkpoint; the legitimate forms (hub
cache symlinks, a list-valued ``eos_token_id``) run. The CLI runs in-process; two subprocesses show
that nothing else reaches a terminal."""
import subprocess
import sys

import numpy as np
import pytest

from tests.malformed.corpus import CASES, SECRET_MARKERS, legitimate_hub_snapshot
from tests.parity.diff_helpers import run_cli


def assert_one_line_error(rc, out, err, message):
    assert rc == 2, out + err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in out + err
    for marker in SECRET_MARKERS:
        assert marker not in out + err, err


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    built = CASES[case](tmp_path)
    if built is None:
        pytest.skip("no folder here is unwritable for this user (root without a read-only /proc/sys)")
    argv, message = built
    assert_one_line_error(*run_cli(capsys, *argv), message)


REFERENCE_BACKENDS = [a for f in ("kda", "mla", "moe", "norm", "conv", "embed") for a in ("--backend", f"{f}=reference")]


def test_a_hub_snapshot_with_a_list_of_end_tokens_runs(tmp_path, capsys):
    """Links into the hub cache's blobs/ are followed, and ``eos_token_id`` may be a list; the diff
    runs to the end (every op family on the reference math, so it takes seconds)."""
    snap = legitimate_hub_snapshot(tmp_path, lambda c: c.update(eos_token_id=[2, 1]))
    rc, out, err = run_cli(capsys, "diff", str(snap), "--prompt", "hello", "--steps", "1", "--no-progress",
                           *REFERENCE_BACKENDS)
    assert rc == 0, out + err
    assert "1/1 tokens match" in out


def test_a_hub_snapshot_reads_the_same_weights_as_the_folder(tmp_path):
    from kimi.checkpoint import open_source
    from kimi.fixtures import default_checkpoint_path

    a, b = open_source(default_checkpoint_path()), open_source(legitimate_hub_snapshot(tmp_path))
    for name in a.names():
        np.testing.assert_array_equal(a.get_raw(name), b.get_raw(name), err_msg=name)


def test_a_link_out_of_a_hub_snapshot_other_than_its_blobs_is_refused(tmp_path, capsys):
    snap = legitimate_hub_snapshot(tmp_path)
    elsewhere = tmp_path / "hub" / "models--org--kimi-tiny" / "other"
    elsewhere.mkdir()
    target = elsewhere / "model.safetensors"
    target.write_bytes((snap / "model.safetensors").read_bytes())
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(target)
    rc, out, err = run_cli(capsys, "diff", str(snap), "--prompt-ids", "1")
    assert_one_line_error(rc, out, err, "model.safetensors: a link to a file outside the checkpoint folder")


@pytest.mark.parametrize("argv, message", [
    ([b"diff", b"--prompt", b"caf\xe9"], "--prompt: not valid UTF-8 text"),
    ([b"golden", b"check", b"{tmp}/g.json"], "g.json: JSON nested deeper than 127 levels"),
])
def test_no_traceback_reaches_the_terminal(tmp_path, argv, message):
    (tmp_path / "g.json").write_bytes(b'{"format": "kimi-parity/golden", "steps": [' + b"[" * 50_000)
    argv = [a.replace(b"{tmp}", str(tmp_path).encode()) for a in argv]
    proc = subprocess.run([sys.executable.encode(), b"-m", b"parity", *argv], capture_output=True, timeout=300)
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    assert_one_line_error(proc.returncode, out, err, message)
