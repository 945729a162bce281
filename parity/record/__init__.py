"""Recording a running program's op calls: ``watch`` (any Python program's named functions, judged
from their recorded outputs: ``parity watch``, ``parity judge``) and ``capture`` (the
inputs the optimized model's ops receive, replayed as examples: ``parity capture``,
``parity certify --cases``)."""
