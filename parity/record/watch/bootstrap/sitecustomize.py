"""Put on PYTHONPATH by ``parity watch``: every Python process of the watched program starts the
watch (parity.record.watch.boot) before its own code runs, then runs any other sitecustomize it would have
run."""
import importlib.machinery
import importlib.util
import os
import sys


def _start():
    if not os.environ.get("PARITY_WATCH"):
        return
    try:   # here, and only when watching: this file runs in every Python process started with it on the path
        from parity.record.watch import boot

        boot.start()
    except Exception as exc:  # the program still runs; the line says why nothing is recorded
        print(f"parity watch: not watching this process ({type(exc).__name__}: {exc})", file=sys.stderr)


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_start()
_chain()
