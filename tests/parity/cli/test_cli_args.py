"""The argument checks every subcommand shares (parity/cli/args.py)."""
import os

import pytest

from parity.cli.args import check_count, check_seed, check_text, write_output
from parity.errors import InputError


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_write_that_fails_late_is_one_line_naming_the_file():
    def write():
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 65536)

    with pytest.raises(InputError, match=r"^/dev/full: cannot write \(No space left on device\)$"):
        write_output("/dev/full", write)


def test_counts_seeds_and_text_are_bounded_with_the_limit_in_the_message():
    check_count("--steps", None, 10, "steps")
    check_count("--steps", 10, 10, "steps")
    with pytest.raises(InputError, match=r"^--steps 11: more than the limit of 10 steps$"):
        check_count("--steps", 11, 10, "steps")
    with pytest.raises(InputError, match=r"^--steps 0: expected a positive number of steps$"):
        check_count("--steps", 0, 10, "steps")
    check_seed("--seed", 2 ** 32 - 1)
    with pytest.raises(InputError, match=r"--seed: expected 0 <= S < 2\*\*32, got 4294967296"):
        check_seed("--seed", 2 ** 32)
    check_text("--prompt", "caf\xe9")
    with pytest.raises(InputError, match=r"^--prompt: not valid UTF-8 text \(bad byte at character 3\)$"):
        check_text("--prompt", "caf\udce9")
