"""benchmarks/gpu_check.py: the record of a check_gpu.sh run from its reports, and completing an
earlier run of the same code (``CHECK_RESUME``): refused for other code, the unfinished selections
named, the record naming the earlier run."""
import json
import tarfile

from benchmarks import gpu_check
from benchmarks.code_digest import code_digest

PASS = """<testsuites><testsuite>
<testcase classname="tests.benchmarks.test_gpu_check" name="test_a" time="1.5"/>
<testcase classname="tests.benchmarks.test_gpu_check" name="test_b" time="0.5"><skipped/></testcase>
</testsuite></testsuites>"""


def _earlier_run(tmp_path, digest):
    """An earlier run's directory: one file passed, tests/test_spec.py killed by the time limit (no
    report), certify passed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "junit-tests-benchmarks-test_gpu_check.xml").write_text(PASS)
    (out / "rc-tests-benchmarks-test_gpu_check").write_text("0\n")
    (out / "rc-tests-test_spec").write_text("124\n")
    (out / "rc-certify").write_text("0\n")
    doc = gpu_check.record(out, 400.0)
    doc["digest"] = digest
    run = tmp_path / "run"
    run.mkdir()
    (run / "gpu-check.json").write_text(json.dumps(doc))
    with tarfile.open(run / "parts.tar.gz", "w:gz") as tar:
        for p in out.iterdir():
            tar.add(p, arcname=p.name)
    return out, run, doc


def test_a_killed_selection_is_unfinished_and_the_run_not_green(tmp_path):
    _, _, doc = _earlier_run(tmp_path, code_digest(gpu_check.ROOT))
    assert not doc["green"] and not doc["complete"]
    assert doc["files"]["tests/benchmarks/test_gpu_check.py"] == {"passed": 1, "failed": 0, "skipped": 1,
                                                                  "error": 0, "seconds": 2.0}
    assert gpu_check.unfinished(doc) == ["tests-test_spec"]
    assert gpu_check.selection_file("tests-test_spec") == "tests/test_spec.py"


def test_only_a_run_of_this_code_is_resumed(tmp_path, capsys):
    _, run, _ = _earlier_run(tmp_path, "0" * 64)
    prev, why = gpu_check.resumable(run)
    assert prev is None and "other code" in why
    assert gpu_check.main(["--can-resume", str(run)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert gpu_check.resumable(tmp_path / "nothing")[0] is None


def test_the_resumed_record_names_the_earlier_run(tmp_path, capsys):
    out, run, _ = _earlier_run(tmp_path, code_digest(gpu_check.ROOT))
    assert gpu_check.main(["--unfinished", str(run)]) == 0
    assert capsys.readouterr().out.split() == ["tests/test_spec.py"]
    # the selection run again: its report replaces the kill
    (out / "rc-tests-test_spec").write_text("0\n")
    (out / "junit-tests-test_spec.xml").write_text(PASS.replace("tests.benchmarks.test_gpu_check", "tests.test_spec"))
    doc = gpu_check.record(out, 50.0, resumed=gpu_check.resumable(run)[0])
    assert doc["resumed"]["rerun"] == ["tests-test_spec"] and doc["resumed"]["wall_seconds"] == 400.0
    assert doc["wall_seconds"] == 450.0
    assert doc["selections"]["tests-test_spec"] == {"rc": 0}
