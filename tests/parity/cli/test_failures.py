"""A failure to run is never exit 1: an engine of any kind that cannot load or run, running out of
memory anywhere, a package that is not installed: one ``error:`` line and exit 2, nothing written.
A bug of parity itself keeps its traceback (nothing is caught wholesale)."""
import importlib

import pytest

from ..diff_helpers import PROMPT_IDS, one_line_error, run_cli

PLANTED = "tests.parity.diff.engines_planted"
HERE = "tests/parity/diff/engines_planted.py:"  # where the planted engines raise, as the line names it

ENGINES = {
    "the factory raises": (f"{PLANTED}:raises", f"engine {PLANTED}:raises: the factory raised RuntimeError: "
                           f"no GPU driver found (at {HERE}"),
    "prefill raises": (f"{PLANTED}:prefill_raises", "prefill raised KeyError: 'query' (at "),
    "decode raises": (f"{PLANTED}:decode_raises", "decode raised RuntimeError: CUDA error: an illegal memory "
                      "access was encountered CUDA kernel errors might be asynchronously reported (at "),
    "the factory runs out of GPU memory": (f"{PLANTED}:factory_out_of_memory",
                                           f"engine {PLANTED}:factory_out_of_memory: the factory: out of GPU "
                                           "memory: tried to allocate 2.00 GiB, 1.10 GiB free"),
    "prefill runs out of GPU memory": (f"{PLANTED}:prefill_out_of_gpu_memory",
                                       "prefill: out of GPU memory{on}: tried to allocate 2.00 GiB, 1.10 GiB free; try"),
    "decode runs out of host memory": (f"{PLANTED}:decode_out_of_host_memory",
                                       "decode: out of host memory: Unable to allocate"),
    "a file that is not a dump": ("dump:{tmp}/not-a-dump.safetensors", "not-a-dump.safetensors"),
}


def _diff(capsys, tmp_path, engine, *more, **kw):
    (tmp_path / "not-a-dump.safetensors").write_text("plain text")
    report = tmp_path / "out" / "r.json"
    report.parent.mkdir()
    got = run_cli(capsys, "diff", "--engine", engine.format(tmp=tmp_path), "--dtype", "float32", "--steps", "2",
                  "--prompt-ids", PROMPT_IDS, "--no-progress", "--json", str(report), *more, **kw)
    assert list(report.parent.iterdir()) == []
    return got


@pytest.mark.parametrize("case", list(ENGINES))
def test_an_engine_that_cannot_load_or_run_is_one_line_and_exit_2(tmp_path, capsys, case, parity_device):
    engine, message = ENGINES[case]
    on = "" if parity_device == "cpu" else f" on {parity_device}"  # where the run's device is a GPU, it is named
    one_line_error(*_diff(capsys, tmp_path, engine, "--device", parity_device), message.format(on=on))


def test_the_optimized_engine_that_cannot_fit_is_refused_before_it_loads(tmp_path, capsys, parity_device):
    rc, out, err = _diff(capsys, tmp_path, "optimized", "--device", parity_device, free_memory=lambda device: 1 << 16)
    one_line_error(rc, out, err, "the optimized model's weights (float32)")
    assert "nothing was loaded" in err and "0.1 MiB" in err


def test_certify_a_candidate_out_of_memory_is_one_line_and_exit_2(capsys, parity_device):
    """Not a finding (exit 1): the machine ran out, in this process or in a worker."""
    for workers in ("0", "1"):
        rc, out, err = run_cli(capsys, "certify", "--device", parity_device, "--ops", "kda.recurrent", "--workers",
                               workers, "--impl", "kda.recurrent=tests.parity.certify.planted_kda:out_of_memory",
                               "--dtype", "float32", "--examples", "1")
        assert rc == 2 and err.startswith("error: kda.recurrent: out of GPU memory") and err.count("\n") == 1, \
            (workers, out, err)
        assert "tried to allocate 2.00 GiB, 1.10 GiB free" in err


def test_a_package_that_is_not_installed_is_one_line_and_a_missing_module_of_ours_a_traceback(capsys):
    """Whatever raises ModuleNotFoundError: here the free-memory source, the first thing a diff asks."""
    def needs(module):
        return lambda device: importlib.import_module(module)

    rc, out, err = run_cli(capsys, "diff", "--steps", "1", free_memory=needs("no_such_package_here.sub"))
    assert rc == 2 and err.startswith("error: the package 'no_such_package_here' is not installed"), err
    with pytest.raises(ModuleNotFoundError, match="parity.no_such_module"):
        run_cli(capsys, "diff", "--steps", "1", free_memory=needs("parity.no_such_module"))


def test_a_bug_of_parity_itself_keeps_its_traceback(capsys):
    def broken(device):
        return 1 // 0

    with pytest.raises(ZeroDivisionError):
        run_cli(capsys, "diff", "--steps", "1", free_memory=broken)
