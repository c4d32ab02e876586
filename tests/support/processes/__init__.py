"""Entry points of the processes the tests start: `python -m tests.support.processes.NAME`."""
