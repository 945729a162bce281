"""pytest plugin (entry point ``pytest11``): ``--parity-device`` and the parity fixtures."""
