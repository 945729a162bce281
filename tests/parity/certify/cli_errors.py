"""The one shape of a refused ``parity certify`` command line, shared by the tests of its options."""
from parity.cli import main


def assert_certify_refuses(args, needle, capsys, device):
    """``parity certify --device device *args`` exits 2 with one line ``error: ...`` naming ``needle``
    (argparse's own refusals included)."""
    try:
        rc = main(["certify", "--device", device, *args])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and needle in err and err.count("\n") == 1, err
